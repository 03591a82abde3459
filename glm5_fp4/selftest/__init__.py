"""``glm5-fp4 selftest``: prove the MoE backend on the user's own GPU and produce one attachable report.

* :mod:`glm5_fp4.selftest.env` - GPU, driver and software versions, the hardware-table entry,
* :mod:`glm5_fp4.selftest.checks` - the fused MoE against the float64 reference at GLM-5 shapes,
* :mod:`glm5_fp4.selftest.bench` - the kernel benchmark (``benchmarks/moe_kernel.py``) with same-run baselines,
* :mod:`glm5_fp4.selftest.report` - JSON + markdown,
* :mod:`glm5_fp4.selftest.cli` - the subcommand.
"""

# Exit status when there is no CUDA GPU to test (documented; tests rely on it).
NO_GPU_EXIT = 2
