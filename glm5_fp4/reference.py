"""GLM-5 router and the pure-torch MoE on NVFP4 experts: the oracle every kernel and engine path is tested against.

Router (DeepSeek-V3 ``noaux_tc``, as GLM-5 configures it): sigmoid scores; ``e_score_correction_bias`` is
added for *selection only*; groups ranked by the sum of their two best biased scores, the best
``topk_group`` groups kept; top-k experts among them; weights are the *unbiased* scores of the chosen
experts, renormalised to sum to one, times ``routed_scaling_factor``.

MoE: for each token, sum over its experts of ``weight * down(silu(gate(x)) * up(x))`` on dequantized NVFP4
weights, plus the shared expert. ``mode="w4a16"`` keeps activations in full precision (what GPUs without FP4
tensor cores do); ``mode="w4a4"`` quantizes each GEMM's input to NVFP4 the way Blackwell kernels do, with the
global scale ``1 / input_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glm5_fp4 import nvfp4
from glm5_fp4.errors import Glm5Fp4Error

MODES = ("w4a16", "w4a4")


def route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(topk_weights float32 [T, k], topk_ids int64 [T, k])`` for router logits ``[T, E]``."""
    t, e = router_logits.shape
    if e % n_group:
        raise Glm5Fp4Error(f"router: {e} experts not divisible into n_group={n_group} groups")
    if not 1 <= topk_group <= n_group:
        raise Glm5Fp4Error(f"router: topk_group={topk_group} must be in 1..n_group={n_group}")
    scores = torch.sigmoid(router_logits.float())
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        per_group = choice.view(t, n_group, e // n_group)
        group_scores = per_group.topk(min(2, e // n_group), dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros(t, n_group, dtype=torch.bool, device=choice.device).scatter_(1, keep, True)
        expert_mask = group_mask.repeat_interleave(e // n_group, dim=1)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights * routed_scaling_factor, topk_ids


@dataclass
class NvFp4Experts:
    """A stack of SwiGLU experts in NVFP4, laid out as the engines hold them after loading.

    ``w13``: gate rows then up rows, packed ``[E, 2I, H/2]`` uint8 with scales ``[E, 2I, H/16]`` e4m3 and
    one global scale per expert ``[E]`` (ModelOpt gives gate and up the same ``weight_scale_2``).
    ``w2``: ``[E, H, I/2]``, scales ``[E, H, I/16]``, global ``[E]``. ``a13_scale`` / ``a2_scale``: the
    static activation ``input_scale`` of each GEMM, ``[E]`` (used in W4A4 mode only).
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_global: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_global: torch.Tensor
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2] * 2

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    def validate(self, name: str = "experts") -> None:
        e, two_i, h_half = self.w13.shape
        i, h = two_i // 2, h_half * 2
        expected = {
            "w13": (self.w13, (e, 2 * i, h // 2), torch.uint8),
            "w13_scale": (self.w13_scale, (e, 2 * i, h // nvfp4.BLOCK_SIZE), torch.float8_e4m3fn),
            "w13_global": (self.w13_global, (e,), torch.float32),
            "w2": (self.w2, (e, h, i // 2), torch.uint8),
            "w2_scale": (self.w2_scale, (e, h, i // nvfp4.BLOCK_SIZE), torch.float8_e4m3fn),
            "w2_global": (self.w2_global, (e,), torch.float32),
        }
        if self.a13_scale is not None:
            expected["a13_scale"] = (self.a13_scale, (e,), torch.float32)
        if self.a2_scale is not None:
            expected["a2_scale"] = (self.a2_scale, (e,), torch.float32)
        for field, (tensor, shape, dtype) in expected.items():
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise Glm5Fp4Error(
                    f"{name}.{field}: expected {dtype} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}"
                )

    @classmethod
    def from_float(
        cls,
        w13: torch.Tensor,
        w2: torch.Tensor,
        a13_scale: torch.Tensor | None = None,
        a2_scale: torch.Tensor | None = None,
    ) -> "NvFp4Experts":
        """Quantize float experts ``w13 [E, 2I, H]`` (gate; up) and ``w2 [E, H, I]`` as ModelOpt does."""
        p13, s13, g13 = nvfp4.quantize(w13)
        p2, s2, g2 = nvfp4.quantize(w2)
        return cls(p13, s13, g13, p2, s2, g2, a13_scale, a2_scale)

    def dequantized(self, dtype: torch.dtype = torch.float32, expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13, w2)`` in ``dtype``: all experts, or only ``expert`` (``[2I, H]``, ``[H, I]``). One expert at
        a time is what a reference needs: GLM-5's 256 whole experts are 51 GB in float64."""
        if expert is None:
            return (
                nvfp4.dequantize(self.w13, self.w13_scale, self.w13_global, dtype),
                nvfp4.dequantize(self.w2, self.w2_scale, self.w2_global, dtype),
            )
        e = expert
        return (
            nvfp4.dequantize(self.w13[e], self.w13_scale[e], self.w13_global[e], dtype),
            nvfp4.dequantize(self.w2[e], self.w2_scale[e], self.w2_global[e], dtype),
        )

    def to(self, device: torch.device | str) -> "NvFp4Experts":
        return NvFp4Experts(
            **{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        )


def _swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, a13: torch.Tensor | None, a2: torch.Tensor | None):
    if a13 is not None:
        x = nvfp4.fake_quantize_activation(x, a13)
    gate, up = (x @ w13.T).chunk(2, dim=-1)
    act = F.silu(gate) * up
    if a2 is not None:
        act = nvfp4.fake_quantize_activation(act, a2)
    return act @ w2.T


def check_call(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, hidden: int, mode: str) -> None:
    """The mode and shapes every MoE path takes (the reference, the dequant backend, the kernels' check_inputs):
    ``x [T, hidden]``, ``topk_ids`` and ``topk_weights`` both ``[T, k]``."""
    if mode not in MODES:
        raise Glm5Fp4Error(f"unknown MoE mode {mode!r}; choose one of {MODES}")
    if x.dim() != 2 or x.shape[1] != hidden:
        raise Glm5Fp4Error(f"hidden states must be [T, {hidden}], got {list(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise Glm5Fp4Error(
            f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must both be [T={x.shape[0]}, k]"
        )


def _values_readable(t: torch.Tensor) -> bool:
    """A host tensor with values (not a fake one being traced by torch.compile or opcheck)."""
    if t.device.type != "cpu":  # (first: a GPU call pays nothing more)
        return False
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(t) and not torch.compiler.is_compiling()


def check_routing(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int,
                  dropped_without_map: bool = True) -> None:
    """Routing values, where reading them costs nothing (host tensors; on a GPU each check would synchronise a
    call and break CUDA-graph capture, so there the engines' routers are trusted): ``topk_ids`` in
    [0, experts), or -1 for a dropped slot (``dropped_without_map`` False: only through an expert map, which the
    kernels need to skip it); ``expert_map`` values local ids or -1 (another rank's expert)."""
    if not _values_readable(topk_ids) or not topk_ids.numel():
        return
    top = len(expert_map) if expert_map is not None else num_experts
    low = -1 if (expert_map is not None or dropped_without_map) else 0
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < low or hi >= top:
        bad = lo if lo < low else hi
        where = f"the expert_map's {top} entries" if expert_map is not None else f"the {num_experts} experts"
        raise Glm5Fp4Error(f"topk_ids holds {bad}: ids index {where}" + (", or are -1 (a dropped slot)" if low < 0
                           else "; a dropped slot (-1) needs an expert_map"))
    if expert_map is not None and _values_readable(expert_map) and expert_map.numel():
        lo, hi = int(expert_map.min()), int(expert_map.max())
        if lo < -1 or hi >= num_experts:
            raise Glm5Fp4Error(f"expert_map holds {lo if lo < -1 else hi}: its values are local expert ids "
                               f"(0..{num_experts - 1}) or -1 (another rank's expert)")


def local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """Each slot's local expert, -1 where the slot is dropped or its expert is another rank's (checked first)."""
    if expert_map is not None:
        emap = expert_map.to(topk_ids.device).long()
        if emap.dim() != 1:
            raise Glm5Fp4Error(f"expert_map must be 1-D (global id -> local id or -1), got {list(emap.shape)}")
        check_routing(topk_ids, emap, num_experts)
        ids = topk_ids.long()
        # a dropped slot stays dropped: emap[-1] is the last expert's entry
        return torch.where(ids < 0, -1, emap[ids.clamp(min=0)])
    check_routing(topk_ids, None, num_experts)
    return topk_ids


def moe_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: NvFp4Experts,
    shared: NvFp4Experts | None = None,
    mode: str = "w4a16",
    compute_dtype: torch.dtype = torch.float32,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts (+ shared expert) on NVFP4 weights; ``x [T, H]``, result in ``x.dtype``.

    ``topk_weights`` must already include ``routed_scaling_factor`` (as :func:`route` returns them). Computes
    in ``compute_dtype`` (float32, or float64 for exact comparisons), expert by expert, tokens gathered; only the
    experts the routing touches are dequantized, one at a time.
    ``expert_map`` (expert parallelism): ``experts`` are this rank's, ``topk_ids`` global, and
    ``expert_map[global] = local id`` or -1 for an expert of another rank, which contributes nothing.
    """
    check_call(x, topk_weights, topk_ids, experts.hidden_size, mode)
    w4a4 = mode == "w4a4"
    if w4a4 and (experts.a13_scale is None or experts.a2_scale is None):
        raise Glm5Fp4Error("w4a4 mode needs the experts' input scales (a13_scale, a2_scale)")
    topk_ids = local_ids(topk_ids, expert_map, experts.num_experts)
    xc = x.to(compute_dtype)
    out = torch.zeros_like(xc)
    for e in torch.unique(topk_ids).tolist():
        if e < 0:
            continue
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        a13 = experts.a13_scale[e] if w4a4 else None
        a2 = experts.a2_scale[e] if w4a4 else None
        # Only the experts the routing touches, one at a time (the whole set would not fit beside the kernel's).
        y = _swiglu(xc[tok], *experts.dequantized(compute_dtype, e), a13, a2)
        out.index_add_(0, tok, y * topk_weights[tok, slot].to(compute_dtype)[:, None])
    if shared is not None:
        s13, s2 = shared.dequantized(compute_dtype)
        for e in range(shared.num_experts):
            a13 = shared.a13_scale[e] if w4a4 else None
            a2 = shared.a2_scale[e] if w4a4 else None
            out += _swiglu(xc, s13[e], s2[e], a13, a2)
    return out.to(x.dtype)


def random_experts(
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    with_input_scales: bool = True,
) -> NvFp4Experts:
    """Random experts with realistic magnitudes (weights ~ N(0, 1/sqrt(fan_in))), quantized; for tests and benchmarks."""
    g = generator
    w13 = torch.randn(num_experts, 2 * intermediate_size, hidden_size, generator=g) / hidden_size**0.5
    w2 = torch.randn(num_experts, hidden_size, intermediate_size, generator=g) / intermediate_size**0.5
    experts = NvFp4Experts.from_float(w13, w2)
    if with_input_scales:
        # Static activation scales as ModelOpt calibrates them: amax / (6 * 448), amax drawn around a
        # typical unit-variance activation maximum.
        experts.a13_scale = (3.0 + torch.rand(num_experts, generator=g)) / (6 * 448)
        experts.a2_scale = (1.0 + torch.rand(num_experts, generator=g)) / (6 * 448)
    return experts.to(device)
