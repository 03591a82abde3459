"""The load-time warm-up compiles what any batch would: the token counts it runs cover every launch signature
(kernel, constexprs, integer specialisations) that a call of 1..max_tokens tokens makes. Meta tensors only."""

from __future__ import annotations

import time

import pytest
import torch

from glm5_fp4.kernels import warmup as W
from glm5_fp4.sm120 import launches as L

SHAPES = {s.name: s for s in L.shape_classes()}
SHAPES["ep8"] = L.ShapeClass("ep8", 32, 8, 6144, 2048, "an EP8 rank: 32 whole experts of 256")


def _served_signature(prep, k, t, mode, arch, sms, map_size):
    """What a served call of ``t`` tokens launches: built the way fused_moe builds it (make_call, default_plan's
    plan_for), independently of the warm-up's own meta_launches."""
    from glm5_fp4.kernels import moe
    from glm5_fp4.kernels.launch import launches

    meta = torch.device("meta")
    x = torch.empty(t, prep.hidden_size, dtype=torch.bfloat16, device=meta)
    w = torch.empty(t, k, dtype=torch.float32, device=meta)
    ids = torch.empty(t, k, dtype=torch.int64, device=meta)  # make_call casts to int32
    emap = None if map_size is None else torch.empty(map_size, dtype=torch.int32, device=meta)
    ws = moe.Workspace(meta, prep.num_experts, k, prep.hidden_size, prep.intermediate_size, t)
    call = moe.make_call(x, w, ids, prep, mode, expert_map=emap, use_asm=True, workspace=ws)
    assert call.topk_ids.dtype == torch.int32
    return W.signature(launches(moe.plan_for(arch, sms, t, k, prep, mode, emap), call))


@pytest.mark.parametrize("arch,shape,mode,max_tokens,map_size", [
    ("sm90", "tp8", "w4a16", 3000, None),  # past the last plan change (2,561) and the align block's growth
    ("sm90", "tp1", "w4a16", 3000, 257),   # SGLang: its skip map on every call (E + 1 entries)
    ("sm90", "ep8", "w4a16", 3000, 256),   # vLLM EP8: 32 local experts, a map over all 256
    ("sm120", "tp4", "w4a4", 1400, None),
])
def test_warmup_counts_cover_every_token_count(arch, shape, mode, max_tokens, map_size):
    sc = SHAPES[shape]
    prep = L.meta_prepared(sc, layout="placed")
    k, sms = sc.top_k, 132 if arch == "sm90" else 188
    t0 = time.monotonic()
    counts = W.warmup_token_counts(prep, k, max_tokens, mode, torch.bfloat16, arch, sms, map_size=map_size)
    pick_s = time.monotonic() - t0
    warmed = {_served_signature(prep, k, t, mode, arch, sms, map_size) for t in counts}
    missed = [t for t in range(1, max_tokens + 1) if _served_signature(prep, k, t, mode, arch, sms, map_size) not in warmed]
    assert not missed, f"token counts whose kernels the warm-up would not compile: {missed[:20]}"
    assert len(counts) < 80, counts  # few runs at every server start
    assert pick_s < 10, pick_s


def test_counts_stop_at_the_launchers_32_bit_limit():
    from glm5_fp4.kernels.launch import MAX_TOKENS_X_HIDDEN

    prep = L.meta_prepared(SHAPES["tp8"])  # H = 6,144: the limit at 349,525 tokens (the tiny shape's 4 M took 95 s)
    top = (MAX_TOKENS_X_HIDDEN - 1) // prep.hidden_size
    counts = W.warmup_token_counts(prep, 4, top + 5000, "w4a16", torch.bfloat16, "sm90", 132)
    assert max(counts) <= top  # a count past it would make the warm-up itself raise at server start


def test_signature_tells_integer_specialisations_apart():
    prep = L.meta_prepared(SHAPES["tp8"], layout="placed")
    sig = lambda t: W.signature(W.meta_launches(prep, 8, t, "w4a16", torch.bfloat16, "sm90", 132))  # noqa: E731
    assert sig(40) != sig(41)  # 320 vs 328 slots: the same plan, another divisibility of the slot count


def _cpu_prepared():
    from glm5_fp4.kernels.layout import prepare_experts
    from glm5_fp4.reference import NvFp4Experts

    ex = NvFp4Experts.from_float(torch.randn(4, 256, 128), torch.randn(4, 128, 128))
    return prepare_experts(ex)


def test_warm_up_runs_each_count_once_per_shape_and_map(monkeypatch):
    monkeypatch.setattr(W, "_DONE", set())
    prep = _cpu_prepared()
    assert W.warm_up(prep, "w4a16", 2, 64, run=lambda *a, **k: pytest.fail("ran off the GPU")) == []
    monkeypatch.setattr(W, "_compiles_here", lambda device: True)  # stand in for a GPU
    calls = []

    def run(x, w, ids, prepared, mode, expert_map=None):
        calls.append((x.shape[0], ids.dtype, expert_map))

    emap = torch.arange(5, dtype=torch.int32)
    counts = W.warm_up(prep, "w4a16", 2, 64, run=run, expert_map=emap)
    assert counts and [c[0] for c in calls] == counts and all(c[1] == torch.int32 and c[2] is emap for c in calls)
    assert counts == W.warmup_token_counts(W._meta_like(prep), 2, 64, "w4a16", torch.bfloat16, "sm90", 132, False, 5)
    assert W.warm_up(prep, "w4a16", 2, 64, run=run, expert_map=emap) == []  # once per shape and map
    assert W.warm_up(prep, "w4a16", 2, 64, run=run) != []  # without a map: other kernels
    monkeypatch.setenv(W.ENV, "0")
    assert W.warm_up(prep, "w4a4", 2, 64, run=run) == []


def test_a_failed_warm_up_is_tried_again(monkeypatch):
    monkeypatch.setattr(W, "_DONE", set())
    monkeypatch.setattr(W, "_compiles_here", lambda device: True)
    prep = _cpu_prepared()

    def boom(*a, **k):
        raise RuntimeError("compile failed")

    monkeypatch.setattr(W.WATCH, "warm_ups", 0)
    with pytest.raises(RuntimeError):
        W.warm_up(prep, "w4a16", 2, 64, run=boom)
    assert W.WATCH.warm_ups == 0  # a failed warm-up missed everything: later compiles are not its misses
    assert W.warm_up(prep, "w4a16", 2, 64, run=lambda *a, **k: None) != []
    assert W.WATCH.warm_ups == 1


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
    counts = W.warmup_token_counts(meta, 4, 600, "w4a4", torch.bfloat16, "sm90", 132, map_size=17)
    assert counts[0] == 1 and counts == sorted(set(counts)) and max(counts) <= 600
