"""Relative-error tolerances of the MoE implementations against the float64/float32 reference: one table.

Error is the relative Frobenius norm ``||out - ref|| / ||ref||`` over a whole layer output, the reference
computed from the same NVFP4 codes and scales (so quantization itself is not an error here). Each bound is
derived from the arithmetic, then checked against what was measured; tests, the self-test and benchmarks
import :func:`moe_tolerance` instead of writing literals.
"""

from __future__ import annotations

import torch

# W4A16 kernels: x and the SwiGLU activation are rounded to fp16 (unit roundoff 2^-11 each), products are exact
# in fp16 x fp16 -> fp32 MMAs, and the output is rounded once to its dtype (bf16 2^-9, RMS relative error of
# round-to-nearest ~ u/sqrt(3) = 1.1e-3; fp16 2^-11). Measured on H200 (2026-11-29): 1.6-1.7e-3 for bf16
# outputs. Bound: about twice the measured value, still well under the ~1e-2 an indexing or scale error gives
# (one wrong expert of eight moves the output by ~1/sqrt(8) = 0.35).
_W4A16 = {torch.bfloat16: 4e-3, torch.float16: 2e-3, torch.float32: 1e-3}
# W4A4 emulation: activations are quantized to E2M1 per 16-block. The kernel computes the value it quantizes
# in a different precision and order than the reference (fp16/fp32 MMA vs float32 matmul), so values near a
# rounding boundary may round to the neighbouring code (one E2M1 step is 25-50 % of a value); a few such
# flips per layer cost ~1e-3 each. Measured 1.6-1.7e-3 (vLLM CPU emulation vs reference); bound 1e-2.
_W4A4 = 1e-2
# The torch reference in float32 against a float64 evaluation of the same codes: float32 accumulation over
# K = 6144 terms (sqrt(K) * 2^-24 ~ 5e-6) plus the output rounding.
_REFERENCE_F32 = 1e-5


def moe_tolerance(mode: str, dtype: torch.dtype = torch.bfloat16) -> float:
    """Largest relative error a correct implementation may show in ``mode`` with outputs of ``dtype``."""
    if mode == "w4a4":
        return max(_W4A4, _W4A16.get(dtype, _W4A16[torch.bfloat16]))
    if mode == "w4a16":
        return _W4A16.get(dtype, _W4A16[torch.bfloat16])
    if mode == "reference":
        return _REFERENCE_F32
    raise ValueError(f"no tolerance for mode {mode!r}")


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN/inf anywhere in ``out`` gives inf (never passes)."""
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-300))
