"""The registered op torch.ops.glm5_fp4.moe_nvfp4 and fused_moe's CPU path: results, fake impl, errors."""

import pytest
import torch

import glm5_fp4.kernels.op as op
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4 import nvfp4
from glm5_fp4.kernels import fused_moe, prepare_experts
from glm5_fp4.reference import random_experts, route
from glm5_fp4.tolerances import moe_tolerance, rel_error

E, H, I, K = 8, 128, 128, 2


@pytest.fixture(scope="module")
def experts():
    ex = random_experts(E, H, I, generator=torch.Generator().manual_seed(5))
    return ex, prepare_experts(ex)


def inputs(t, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    w, ids = route(torch.randn(t, E, generator=g), None, K, routed_scaling_factor=2.5)
    return x, w, ids


def _loop_moe(x, w, ids, ex, expert_map=None):
    """An independent float64 W4A16 MoE: codes unpacked and scaled by hand, token by token, expert by expert."""

    def dense(packed, scale, glob):
        codes = nvfp4.unpack_fp4(packed)
        vals = nvfp4.e2m1_decode(codes).double().unflatten(-1, (-1, 16)) * scale.double()[..., None]
        return vals.flatten(-2) * glob.double()

    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) if expert_map is None else int(expert_map[int(ids[t, j])])
            if e < 0:
                continue
            w13 = dense(ex.w13[e], ex.w13_scale[e], ex.w13_global[e])
            w2 = dense(ex.w2[e], ex.w2_scale[e], ex.w2_global[e])
            gate, up = (w13 @ x[t].double()).chunk(2)
            out[t] += float(w[t, j]) * (w2 @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("use_map", [False, True])
def test_cpu_path_and_op_equal_an_independent_loop(experts, use_map):
    """fused_moe's CPU path, and the registered op on experts whose checkpoint layout it must rebuild from the
    kernel layout, against a float64 loop over tokens and experts (with an expert map: half the experts
    remote)."""
    ex, prep = experts
    x, w, ids = inputs(7, seed=11)
    emap = torch.tensor([0, -1, 1, -1, 2, -1, 3, 4], dtype=torch.int32) if use_map else None
    sub = ex
    if use_map:  # this rank holds 5 of the 8 experts
        local = torch.tensor([0, 2, 4, 6, 7])
        sub = type(ex)(**{k: (v[local] if isinstance(v, torch.Tensor) else v) for k, v in vars(ex).items()})
        prep = prepare_experts(sub)
    want = _loop_moe(x, w, ids, sub, emap)
    tol = moe_tolerance("w4a16", x.dtype)
    assert rel_error(fused_moe(x, w, ids, prep, expert_map=emap), want) < tol
    out = torch.full_like(x, float("nan"))
    prep.source = None  # the op rebuilds the checkpoint layout from the kernel layout
    try:
        assert op.moe_nvfp4(x, w, ids, prep, out=out, expert_map=emap) is out
    finally:
        prep.source = sub
    assert rel_error(out, want) < tol


def _op_args(prep, x, w, ids, mode, out):
    t = prep.tensors()
    return (x, w, ids, t["w13"], t["w13_scale"], t["w13_alpha"], t["w2"], t["w2_scale"], t["w2_alpha"],
            t["a13_scale"], t["a2_scale"], t["a13_gscale"], t["a2_gscale"], mode, out, prep.layout)


def test_opcheck_fake_impl_and_schema(experts):
    _, prep = experts
    x, w, ids = inputs(5, seed=12)
    torch.library.opcheck(torch.ops.glm5_fp4.moe_nvfp4.default, _op_args(prep, x, w, ids, "w4a16", torch.empty_like(x)))


def test_fake_impl_shapes_under_fake_tensors(experts):
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, prep = experts
    x, w, ids = inputs(4, seed=13)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx = mode.from_tensor(x)
        out = torch.empty_like(fx)
        torch.ops.glm5_fp4.moe_nvfp4(*_op_args(prep, fx, w, ids, "w4a16", out))
        assert out.shape == x.shape and out.dtype == x.dtype
        bad = torch.empty(4, H + 16, dtype=torch.bfloat16)
        with pytest.raises(Glm5Fp4Error, match="hidden states"):
            torch.ops.glm5_fp4.moe_nvfp4(*_op_args(prep, bad, w, ids, "w4a16", torch.empty_like(bad)))


def test_traces_through_torch_compile(experts):
    ex, prep = experts

    class Block(torch.nn.Module):
        def forward(self, x, w, ids):
            return op.moe_nvfp4(x * 2, w, ids, prep) + x

    x, w, ids = inputs(6, seed=14)
    compiled = torch.compile(Block(), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, w, ids), Block()(x, w, ids))


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda x, w, ids: (x[:, :64], w, ids), "hidden states must be"),
        (lambda x, w, ids: (x.float(), w, ids), "bfloat16 or float16"),
        (lambda x, w, ids: (x, w[:, :1], ids), "topk_ids"),
        (lambda x, w, ids: (x, w, ids.float()), "int32 or int64"),
    ],
)
def test_bad_inputs_name_the_culprit(experts, change, match):
    _, prep = experts
    with pytest.raises(Glm5Fp4Error, match=match):
        fused_moe(*change(*inputs(3, seed=15)), prep)


def test_bad_mode_and_missing_input_scales(experts):
    ex, prep = experts
    x, w, ids = inputs(3, seed=16)
    with pytest.raises(Glm5Fp4Error, match="unknown MoE mode"):
        fused_moe(x, w, ids, prep, mode="w8a8")
    no_scales = prepare_experts(random_experts(E, H, I, generator=torch.Generator().manual_seed(1), with_input_scales=False))
    with pytest.raises(Glm5Fp4Error, match="input scales"):
        fused_moe(x, w, ids, no_scales, mode="w4a4")


@pytest.mark.parametrize("bad", [torch.float32, torch.float16, "rows"])
def test_an_out_tensor_that_does_not_fit_is_refused_on_every_path(experts, bad):
    """The fake implementation refused a wrong `out`, the eager op and fused_moe's CPU path cast into it (float32 /
    float16) or failed inside a copy: eager and compiled disagreed. One check now, naming out's dtype and shape."""
    _, prep = experts
    x, w, ids = inputs(3, seed=2)
    out = torch.empty(5, H, dtype=torch.bfloat16) if bad == "rows" else torch.empty(3, H, dtype=bad)
    for call in (lambda: op.moe_nvfp4(x, w, ids, prep, out=out), lambda: fused_moe(x, w, ids, prep, out=out)):
        with pytest.raises(Glm5Fp4Error, match=r"out must be .*bfloat16 \[3, 128\]"):
            call()
