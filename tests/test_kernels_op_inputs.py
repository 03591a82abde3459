"""What an engine integrator can hand the MoE op that is not the happy path (found by a review feeding it odd
routings and tensors): ids out of range, -1 under an expert map, an expert map that points nowhere, k = 0, integer
router weights, tensors of another layer or layout, the dequant backend's own checks. Each is one clear error
naming the argument, or the answer the float64 loop gives; never a wrong result."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import glm5_fp4.kernels.op as op
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.kernels import fused_moe, prepare_experts
from glm5_fp4.reference import moe_reference, random_experts

E, H, I, K, T = 4, 128, 128, 2, 3


@pytest.fixture(scope="module")
def experts():
    ex = random_experts(E, H, I, generator=torch.Generator().manual_seed(21))
    return ex, prepare_experts(ex)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, w, ids


@pytest.mark.parametrize("bad", [E, 1000, -2])
def test_ids_out_of_range_name_topk_ids(experts, bad):
    _, prep = experts
    x, w, ids = _inputs()
    ids[1, 0] = bad
    for call in (lambda: fused_moe(x, w, ids, prep), lambda: op.moe_nvfp4(x, w, ids, prep),
                 lambda: moe_reference(x, w, ids, experts[0])):
        with pytest.raises(Glm5Fp4Error, match=r"topk_ids"):
            call()


def test_minus_one_under_an_expert_map_is_a_dropped_slot_not_the_last_expert(experts):
    """emap[-1] wrapped to the last entry: the slot ran expert 3 with its weight."""
    ex, prep = experts
    x, w, ids = _inputs(1)
    emap = torch.arange(E)
    dropped_ids, dropped_w = ids.clone(), w.clone()
    dropped_ids[0, 0] = -1
    dropped_w[0, 0] = 0.0  # the slot's weight is then irrelevant
    want = moe_reference(x, dropped_w, ids.clamp(min=0), ex)  # the same call with the slot weighted 0
    for got in (fused_moe(x, w, dropped_ids, prep, expert_map=emap), moe_reference(x, w, dropped_ids, ex, expert_map=emap)):
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2)


@pytest.mark.parametrize("emap,match", [(torch.arange(2), "expert_map"), (torch.tensor([0, 1, 2, 9]), "expert_map"),
                                        (torch.tensor([0, 1, -3, 2]), "expert_map")])
def test_an_expert_map_that_points_nowhere(experts, emap, match):
    _, prep = experts
    x, w, ids = _inputs(2)
    with pytest.raises(Glm5Fp4Error, match=match):
        fused_moe(x, w, ids, prep, expert_map=emap)


def test_no_expert_per_token_and_integer_weights_are_refused(experts):
    _, prep = experts
    x, w, ids = _inputs(3)
    with pytest.raises(Glm5Fp4Error, match=r"k = 0|k=0|no expert"):
        fused_moe(x, w[:, :0], ids[:, :0], prep)
    with pytest.raises(Glm5Fp4Error, match="topk_weights"):
        fused_moe(x, (w * 10).long(), ids, prep)


def test_the_op_checks_the_weights_it_is_given(experts):
    """A w13_alpha for 2 of 4 experts read out of bounds (Triton) or raised a bare IndexError (CPU); w2 of
    another layer's I failed in a matmul (the fake refused it clearly, the real op did not)."""
    _, prep = experts
    x, w, ids = _inputs(4)
    short = dataclasses.replace(prep, w13_alpha=prep.w13_alpha[:2], source=None)
    with pytest.raises(Glm5Fp4Error, match="w13_alpha"):
        op.moe_nvfp4(x, w, ids, short)
    other = prepare_experts(random_experts(E, H, 2 * I, generator=torch.Generator().manual_seed(3)))
    mixed = dataclasses.replace(prep, w2=other.w2, w2_scale=other.w2_scale, source=None)
    with pytest.raises(Glm5Fp4Error, match="w2"):
        op.moe_nvfp4(x, w, ids, mixed)


def test_the_raw_op_names_its_layout(experts):
    """Its default was 'split' while prepare_experts' is 'tiled': tensors passed without a layout were decoded
    wrong (error 2.0 on an output of 1.33). The layout is now required, and an unknown one refused."""
    _, prep = experts
    x, w, ids = _inputs(5)
    t = dataclasses.replace(prep, source=None).tensors()
    args = [x, w, ids, *t.values()][:13]
    with pytest.raises(Exception, match="layout"):
        torch.ops.glm5_fp4.moe_nvfp4(*args, "w4a16", torch.empty_like(x))
    with pytest.raises(Glm5Fp4Error, match="bogus"):
        torch.ops.glm5_fp4.moe_nvfp4(*args, "w4a16", torch.empty_like(x), "bogus")


def test_the_fake_refuses_what_the_real_op_refuses(experts):
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, prep = experts
    x, w, ids = _inputs(6)
    t = dataclasses.replace(prep, source=None).tensors()
    with FakeTensorMode(allow_non_fake_inputs=True):
        for bad_x, bad_ids, match in ((x.float(), ids, "bfloat16 or float16"), (x, ids.float(), "int32 or int64")):
            with pytest.raises(Glm5Fp4Error, match=match):
                torch.ops.glm5_fp4.moe_nvfp4(bad_x, w, bad_ids, *t.values(), "w4a16", torch.empty_like(bad_x),
                                             prep.layout)


def test_the_dequant_backend_checks_its_inputs(experts):
    from glm5_fp4.backends import dense_moe, dequantize_experts

    ex = dequantize_experts(experts[0], torch.float32)
    x, w, ids = _inputs(7)
    with pytest.raises(Glm5Fp4Error, match="mode"):
        dense_moe(x, w, ids, ex, mode="bogus")
    with pytest.raises(Glm5Fp4Error, match="hidden states"):  # (a matmul error before)
        dense_moe(x[:, :64], w, ids, ex, "w4a16")
    bad = ids.clone()
    bad[0, 0] = E
    with pytest.raises(Glm5Fp4Error, match="topk_ids"):
        dense_moe(x, w, bad, ex, "w4a16")
