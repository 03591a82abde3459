"""SM120 readiness without an SM120 GPU: ahead-of-time compilation of every MoE kernel configuration the
backend may launch (for sm_120, sm_100 and sm_90), resource and instruction checks on the result, and the
bandwidth/compute floors those kernels face on an RTX PRO 6000.

* :mod:`glm5_fp4.sm120.launches` - which launches the backend can make (derived from
  :mod:`glm5_fp4.kernels.configs` and recorded from :func:`glm5_fp4.kernels.moe.fused_moe_triton`),
* :mod:`glm5_fp4.sm120.build` - compile one launch for a target the way Triton's JIT would, read shared
  memory, registers, spills and the instructions the PTX uses,
* :mod:`glm5_fp4.sm120.matrix` - the whole matrix and its verdicts,
* :mod:`glm5_fp4.sm120.floors` - predicted floors per decode shape on a GPU from the hardware table,
* :mod:`glm5_fp4.sm120.report` - markdown, and ``glm5-fp4 compile-matrix`` (:mod:`glm5_fp4.sm120.cli`).
"""
