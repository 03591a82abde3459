"""The load-time warm-up compiles what any batch would: the token counts it runs cover every launch signature
(kernel, constexprs, integer specialisations) that a call of 1..max_tokens tokens makes. Meta tensors only."""

from __future__ import annotations

import time

import pytest
import torch

from glm5_fp4.kernels import warmup as W
from glm5_fp4.sm120 import launches as L

SHAPES = {s.name: s for s in L.shape_classes()}


@pytest.mark.parametrize("arch,shape,mode,max_tokens", [
    ("sm90", "tp8", "w4a16", 3000),   # past the last plan change (2,561) and the align block's growth
    ("sm90", "tp1", "w4a16", 3000),
    ("sm120", "tp4", "w4a4", 1400),
])
def test_warmup_counts_cover_every_token_count(arch, shape, mode, max_tokens):
    prep = L.meta_prepared(SHAPES[shape], layout="placed")
    k, sms = SHAPES[shape].top_k, 132 if arch == "sm90" else 188
    t0 = time.monotonic()
    counts = W.warmup_token_counts(prep, k, max_tokens, mode, torch.bfloat16, arch, sms)
    pick_s = time.monotonic() - t0
    warmed = {W.signature(W.meta_launches(prep, k, t, mode, torch.bfloat16, arch, sms)) for t in counts}
    missed = [t for t in range(1, max_tokens + 1)
              if W.signature(W.meta_launches(prep, k, t, mode, torch.bfloat16, arch, sms)) not in warmed]
    assert not missed, f"token counts whose kernels the warm-up would not compile: {missed[:20]}"
    assert len(counts) == len(warmed) and len(counts) < 80, counts  # one run per signature, and few
    assert pick_s < 10, pick_s  # it runs at every server start


def test_signature_tells_integer_specialisations_apart():
    prep = L.meta_prepared(SHAPES["tp8"], layout="placed")
    sig = lambda t: W.signature(W.meta_launches(prep, 8, t, "w4a16", torch.bfloat16, "sm90", 132))  # noqa: E731
    assert sig(40) != sig(41)  # 320 vs 328 slots: the same plan, another divisibility of the slot count


def test_warm_up_skips_off_gpu_and_when_disabled(monkeypatch):
    from glm5_fp4.kernels.layout import prepare_experts
    from glm5_fp4.reference import NvFp4Experts

    ex = NvFp4Experts.from_float(torch.randn(4, 256, 128), torch.randn(4, 128, 128))
    prep = prepare_experts(ex)
    calls = []
    assert W.warm_up(prep, "w4a16", 2, 64, run=lambda *a, **k: calls.append(a)) == []  # CPU: nothing to compile
    monkeypatch.setenv(W.ENV, "0")
    assert not W.enabled()
    assert calls == []


def test_counts_from_a_real_layers_prepared_experts():
    """warm_up plans on a meta copy of the layer's own prepared experts (shapes, dtypes, layout kept)."""
    from glm5_fp4.kernels.layout import prepare_experts
    from glm5_fp4.reference import NvFp4Experts

    ex = NvFp4Experts.from_float(torch.randn(16, 256, 512), torch.randn(16, 512, 128),
                                 torch.full((16,), 0.01), torch.full((16,), 0.01))
    prep = prepare_experts(ex)
    meta = W._meta_like(prep)
    assert meta.device.type == "meta" and meta.layout == prep.layout
    assert {n: (t.shape, t.dtype) for n, t in meta.tensors().items() if t is not None} == \
        {n: (t.shape, t.dtype) for n, t in prep.tensors().items() if t is not None}
    counts = W.warmup_token_counts(meta, 4, 600, "w4a4", torch.bfloat16, "sm90", 132)
    assert counts[0] == 1 and counts == sorted(set(counts)) and max(counts) <= 600
