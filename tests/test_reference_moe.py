"""Router and reference MoE against straightforward loop implementations in float64."""

import pytest
import torch
import torch.nn.functional as F

from glm5_fp4 import nvfp4
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.reference import NvFp4Experts, moe_reference, random_experts, route


def route_loop(logits, bias, top_k, n_group, topk_group, scale):
    """Per-token, plain-Python noaux_tc routing."""
    t, e = logits.shape
    ids_out, w_out = [], []
    for i in range(t):
        scores = [1 / (1 + torch.exp(-logits[i, j].double()).item()) for j in range(e)]
        biased = [scores[j] + bias[j].item() for j in range(e)]
        size = e // n_group
        group_score = [sum(sorted(biased[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        allowed = [j for j in range(e) if j // size in groups]
        chosen = sorted(allowed, key=lambda j: -biased[j])[:top_k]
        total = sum(scores[j] for j in chosen)
        ids_out.append(chosen)
        w_out.append([scores[j] / total * scale for j in chosen])
    return torch.tensor(w_out, dtype=torch.float64), torch.tensor(ids_out)


@pytest.mark.parametrize("e,k,n_group,topk_group", [(16, 4, 1, 1), (32, 8, 4, 2), (256, 8, 1, 1), (64, 6, 8, 3)])
def test_router_matches_loop(e, k, n_group, topk_group):
    g = torch.Generator().manual_seed(e + k)
    logits = torch.randn(12, e, generator=g)
    bias = torch.randn(e, generator=g) * 0.5  # large enough to change the selection
    w, ids = route(logits, bias, k, n_group, topk_group, routed_scaling_factor=2.5)
    w_ref, ids_ref = route_loop(logits, bias, k, n_group, topk_group, 2.5)
    order = ids.sort(dim=1).indices
    order_ref = ids_ref.sort(dim=1).indices
    assert torch.equal(ids.gather(1, order), ids_ref.gather(1, order_ref))
    assert torch.allclose(w.gather(1, order).double(), w_ref.gather(1, order_ref), rtol=1e-5)
    assert torch.allclose(w.sum(1), torch.full((12,), 2.5), rtol=1e-5)


def test_bias_selects_but_does_not_weight():
    logits = torch.zeros(1, 4)
    bias = torch.tensor([0.0, 0.0, 1.0, 2.0])
    w, ids = route(logits, bias, 2)
    assert sorted(ids[0].tolist()) == [2, 3]
    assert torch.allclose(w, torch.full((1, 2), 0.5))  # equal unbiased scores -> equal weights


def moe_loop(x, w, ids, experts: NvFp4Experts, shared=None, w4a4=False):
    """Per token, per chosen expert, in float64 on dequantized weights."""
    w13 = nvfp4.dequantize(experts.w13, experts.w13_scale, experts.w13_global, torch.float64)
    w2 = nvfp4.dequantize(experts.w2, experts.w2_scale, experts.w2_global, torch.float64)
    out = torch.zeros(x.shape, dtype=torch.float64)

    def mlp(v, a, b, s13, s2):
        if w4a4:
            v = nvfp4.fake_quantize_activation(v[None], s13, torch.float64)[0]
        h = a @ v
        i = h.shape[0] // 2
        act = F.silu(h[:i]) * h[i:]
        if w4a4:
            act = nvfp4.fake_quantize_activation(act[None], s2, torch.float64)[0]
        return b @ act

    for t in range(x.shape[0]):
        v = x[t].double()
        for j in range(ids.shape[1]):
            e = ids[t, j].item()
            out[t] += w[t, j].double() * mlp(v, w13[e], w2[e], experts.a13_scale[e], experts.a2_scale[e])
        if shared is not None:
            s13 = nvfp4.dequantize(shared.w13, shared.w13_scale, shared.w13_global, torch.float64)
            s2 = nvfp4.dequantize(shared.w2, shared.w2_scale, shared.w2_global, torch.float64)
            out[t] += mlp(v, s13[0], s2[0], shared.a13_scale[0], shared.a2_scale[0])
    return out


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_reference_moe_matches_per_token_loop(mode):
    g = torch.Generator().manual_seed(11)
    experts = random_experts(8, 64, 32, generator=g)
    shared = random_experts(1, 64, 32, generator=g)
    x = torch.randn(10, 64, generator=g)
    w, ids = route(torch.randn(10, 8, generator=g), torch.zeros(8), top_k=3, routed_scaling_factor=2.5)
    ids[0] = torch.tensor([5, 5 - 1, 0])
    got = moe_reference(x.double(), w, ids, experts, shared, mode=mode, compute_dtype=torch.float64)
    ref = moe_loop(x, w, ids, experts, shared, w4a4=(mode == "w4a4"))
    assert torch.allclose(got, ref, rtol=1e-9, atol=1e-9)


def test_w4a4_differs_from_w4a16_but_stays_close():
    g = torch.Generator().manual_seed(12)
    experts = random_experts(4, 64, 32, generator=g)
    x = torch.randn(16, 64, generator=g)
    w, ids = route(torch.randn(16, 4, generator=g), None, top_k=2)
    a = moe_reference(x, w, ids, experts, mode="w4a16")
    b = moe_reference(x, w, ids, experts, mode="w4a4")
    rel = (a - b).norm() / a.norm()
    assert 1e-3 < rel < 0.3


def test_reference_moe_rejects_bad_input():
    experts = random_experts(4, 64, 32)
    x = torch.randn(3, 64)
    w, ids = route(torch.randn(3, 4), None, top_k=2)
    with pytest.raises(Glm5Fp4Error, match="hidden states"):
        moe_reference(torch.randn(3, 48), w, ids, experts)
    with pytest.raises(Glm5Fp4Error, match="mode"):
        moe_reference(x, w, ids, experts, mode="w8a8")
    bad = NvFp4Experts(**{**experts.__dict__, "w2_scale": experts.w2_scale[:, :, :1]})
    with pytest.raises(Glm5Fp4Error, match="w2_scale"):
        bad.validate()


def test_reference_dequantizes_only_the_touched_experts_one_at_a_time(monkeypatch):
    """The GPU gate's reference for GLM-5's 256 whole experts (TP1) asked for 48 GiB at once (H200, 2026-12-02): the
    reference must dequantize only the experts the routing picks, one at a time, and give the same layer."""
    g = torch.Generator().manual_seed(5)
    ex = random_experts(16, 64, 32, generator=g)
    x = torch.randn(3, 64, generator=g, dtype=torch.float64)
    ids = torch.tensor([[2, 7], [7, 11], [2, 11]])
    w = torch.rand(3, 2, generator=g, dtype=torch.float64)
    w13, w2 = ex.dequantized(torch.float64)
    want = torch.zeros_like(x)
    for t in range(3):
        for s in range(2):
            e = int(ids[t, s])
            gate, up = (x[t] @ w13[e].T).chunk(2)
            want[t] += w[t, s] * ((F.silu(gate) * up) @ w2[e].T)
    seen = []
    real = nvfp4.dequantize
    monkeypatch.setattr(nvfp4, "dequantize", lambda packed, *a, **k: (seen.append(tuple(packed.shape)), real(packed, *a, **k))[1])
    got = moe_reference(x, w, ids, ex, compute_dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert sorted(seen) == sorted([(64, 32), (64, 16)] * 3), seen  # w13 [2I, H/2] and w2 [H, I/2] of 3 experts
