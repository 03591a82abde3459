"""Which of our NVFP4 MoE implementations serves a layer: a small registry engine adapters ask.

Engine adapters (vLLM, SGLang) never import kernels directly. They describe the layer (device, shapes,
activation dtype, mode) and :func:`select` answers with a :class:`Backend` or with the reason none fits,
which the adapter logs before falling back to the engine's own NVFP4 path.

Backends:

* ``triton``    the fused Triton kernel (``glm5_fp4.kernels``); CUDA only.
* ``dequant``   weights dequantized once at load to the activation dtype. In W4A16 mode engines hand the
                dense weights to their own unquantized MoE kernel (so the result equals serving the BF16
                twin of the checkpoint bit for bit); W4A4 mode fake-quantizes activations in torch. CPU
                only: on GPUs it would quadruple expert memory, and the engines' NVFP4 backends are the
                better fallback there.
* ``reference`` :func:`glm5_fp4.reference.moe_reference`, the float32 oracle; any device, slow.
* ``auto``      ``triton`` on CUDA, ``dequant`` elsewhere.

Modes: ``w4a16`` (weight-only, what GPUs without FP4 tensor cores do) and ``w4a4`` (activations quantized to
NVFP4 per 16-block with the checkpoint's static global scale, as Blackwell kernels do).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from glm5_fp4 import nvfp4
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.reference import MODES, NvFp4Experts, moe_reference

AUTO = "auto"
# Environment variables every engine adapter honours (an engine's own config, where it has one, wins).
ENV_BACKEND = "GLM5_FP4_BACKEND"
ENV_MODE = "GLM5_FP4_MODE"
MODE_CHOICES = (AUTO, *MODES)
FLOAT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MoEShape:
    """What a backend needs to know about a MoE layer to say whether it can serve it."""

    num_experts: int
    hidden_size: int
    intermediate_size: int  # per tensor-parallel partition
    top_k: int = 0
    activation: str = "silu"
    gated: bool = True  # SwiGLU: w13 holds gate and up
    has_bias: bool = False
    expert_parallel: bool = False


Support = tuple[bool, str]


@dataclass(frozen=True)
class Backend:
    name: str
    summary: str
    supports_fn: Callable[[torch.device, MoEShape, torch.dtype, str, int | None], Support]
    prepare_fn: Callable[[NvFp4Experts, str, torch.dtype], Any]
    forward_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any, str], torch.Tensor]
    # True when, in W4A16 mode, an engine may run the prepared dense weights with its own unquantized MoE kernel.
    engine_dense_w4a16: bool = False
    # Allocate every buffer forward() will need for up to max_tokens tokens (before CUDA-graph capture).
    reserve_fn: Callable[[Any, int, int], None] | None = None

    def supports(self, device: torch.device | str, shape: MoEShape, dtype: torch.dtype, mode: str = "w4a16",
                 capability: int | None = None) -> Support:
        """``(ok, reason)``; the reason says what rules the layer out (empty when ok).

        ``capability``: CUDA compute capability as an int (120 for SM120) when the caller knows it.
        """
        if mode not in MODES:
            return False, f"unknown mode {mode!r} (choose one of {', '.join(MODES)})"
        common = _common_support(shape, dtype)
        if not common[0]:
            return common
        return self.supports_fn(torch.device(device), shape, dtype, mode, capability)

    def reserve(self, prepared: Any, top_k: int, max_tokens: int) -> None:
        if self.reserve_fn is not None:
            self.reserve_fn(prepared, top_k, max_tokens)

    def prepare(self, experts: NvFp4Experts, mode: str, dtype: torch.dtype) -> Any:
        return self.prepare_fn(experts, mode, dtype)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, prepared: Any, mode: str) -> torch.Tensor:
        """Routed-expert output ``sum_k w_k * expert_k(x)`` for ``x [T, H]``; shared experts are the caller's."""
        return self.forward_fn(x, topk_weights, topk_ids, prepared, mode)


def _common_support(shape: MoEShape, dtype: torch.dtype) -> Support:
    if shape.activation.lower() != "silu" or not shape.gated:
        return False, f"activation {shape.activation}{'' if shape.gated else ' (not gated)'} is not SwiGLU"
    if shape.has_bias:
        return False, "experts with biases are not supported"
    if shape.expert_parallel:
        return False, "expert parallelism (expert_map) is not supported"
    if dtype not in FLOAT_DTYPES:
        return False, f"activation dtype {dtype} is not bfloat16/float16"
    for what, n in (("hidden_size", shape.hidden_size), ("intermediate_size", shape.intermediate_size)):
        if n % (2 * nvfp4.BLOCK_SIZE):
            return False, f"{what}={n} is not a multiple of {2 * nvfp4.BLOCK_SIZE}"
    return True, ""


# -- triton ---------------------------------------------------------------------------------------

def _kernels():
    return importlib.import_module("glm5_fp4.kernels")


# The kernel's tile configs cover sm80 (Ampere) and newer.
TRITON_MIN_CAPABILITY = 80


def _triton_supports(device: torch.device, shape: MoEShape, dtype: torch.dtype, mode: str,
                     capability: int | None) -> Support:
    if device.type != "cuda":
        return False, f"the Triton kernel needs a CUDA device (this layer is on {device.type})"
    if torch.version.hip:
        return False, "the Triton kernel is written and tested for NVIDIA GPUs only (this is ROCm)"
    if capability is not None and capability < TRITON_MIN_CAPABILITY:
        return False, f"the Triton kernel needs compute capability >= {TRITON_MIN_CAPABILITY}, this GPU has {capability}"
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    try:
        kernels = _kernels()
    except ImportError as exc:
        return False, f"glm5_fp4.kernels cannot be imported ({exc})"
    ok, reason = _kernel_accepts_shape(kernels, shape)
    if not ok:
        return False, f"the Triton kernel does not support this layer: {reason}"
    check = getattr(kernels, "supports", None)
    if check is not None:
        ok, reason = check(device=device, shape=shape, dtype=dtype, mode=mode)
        if not ok:
            return False, f"the Triton kernel does not support this layer: {reason}"
    return True, ""


def _kernel_accepts_shape(kernels, shape: MoEShape) -> Support:
    """Ask the kernel's own ``prepare_experts`` about this shape, on meta tensors (no memory, no device).

    The kernel's shape rules (tile and nibble-group alignment) live in one place, its preparation code;
    probing it keeps them out of this module.
    """
    prepare = getattr(kernels, "prepare_experts", None)
    if prepare is None:
        return False, "glm5_fp4.kernels has no prepare_experts"
    h, i = shape.hidden_size, shape.intermediate_size
    meta = dict(device="meta")
    probe = NvFp4Experts(
        w13=torch.empty(1, 2 * i, h // 2, dtype=torch.uint8, **meta),
        w13_scale=torch.empty(1, 2 * i, h // nvfp4.BLOCK_SIZE, dtype=torch.float8_e4m3fn, **meta),
        w13_global=torch.empty(1, dtype=torch.float32, **meta),
        w2=torch.empty(1, h, i // 2, dtype=torch.uint8, **meta),
        w2_scale=torch.empty(1, h, i // nvfp4.BLOCK_SIZE, dtype=torch.float8_e4m3fn, **meta),
        w2_global=torch.empty(1, dtype=torch.float32, **meta),
    )
    try:
        prepare(probe)
    except Glm5Fp4Error as exc:
        return False, str(exc)
    except (NotImplementedError, RuntimeError):
        pass  # an op without a meta implementation: the probe cannot tell, loading will
    return True, ""


def _triton_prepare(experts: NvFp4Experts, mode: str, dtype: torch.dtype) -> Any:
    return _kernels().prepare_experts(experts)


def _triton_forward(x, topk_weights, topk_ids, prepared, mode):
    return _kernels().fused_moe(x, topk_weights, topk_ids, prepared, mode)


def _triton_reserve(prepared, top_k: int, max_tokens: int) -> None:
    reserve = getattr(_kernels(), "reserve_workspace", None)
    if reserve is not None:
        reserve(prepared, top_k, max_tokens)


# -- dequant --------------------------------------------------------------------------------------

@dataclass
class DenseExperts:
    """Experts dequantized to a float dtype, plus the static activation scales W4A4 emulation needs."""

    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    a13_scale: torch.Tensor | None = None  # [E]
    a2_scale: torch.Tensor | None = None  # [E]


def _dequant_supports(device: torch.device, shape: MoEShape, dtype: torch.dtype, mode: str,
                      capability: int | None) -> Support:
    if device.type == "cuda":
        return False, ("dequant is the CPU path: on GPUs it would quadruple expert memory and is not "
                       "CUDA-graph safe")
    return True, ""


def dequantize_experts(experts: NvFp4Experts, dtype: torch.dtype) -> DenseExperts:
    w13, w2 = experts.dequantized(dtype)
    return DenseExperts(w13, w2, experts.a13_scale, experts.a2_scale)


def _dequant_prepare(experts: NvFp4Experts, mode: str, dtype: torch.dtype) -> DenseExperts:
    if mode == "w4a4" and (experts.a13_scale is None or experts.a2_scale is None):
        raise Glm5Fp4Error("w4a4 mode needs the experts' input scales (input_scale tensors)")
    return dequantize_experts(experts, dtype)


def dense_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, dense: DenseExperts, mode: str) -> torch.Tensor:
    """SwiGLU MoE on dense weights, float32 accumulation; in ``w4a4`` each GEMM input is NVFP4 fake-quantized."""
    w4a4 = mode == "w4a4"
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        xe = x[tok].float()
        if w4a4:
            xe = nvfp4.fake_quantize_activation(xe, dense.a13_scale[e])
        gate, up = (xe @ dense.w13[e].float().T).chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        if w4a4:
            act = nvfp4.fake_quantize_activation(act, dense.a2_scale[e])
        y = act @ dense.w2[e].float().T
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out.to(x.dtype)


# -- reference ------------------------------------------------------------------------------------

def _reference_supports(device: torch.device, shape: MoEShape, dtype: torch.dtype, mode: str,
                        capability: int | None) -> Support:
    return True, ""


def _reference_prepare(experts: NvFp4Experts, mode: str, dtype: torch.dtype) -> NvFp4Experts:
    if mode == "w4a4" and (experts.a13_scale is None or experts.a2_scale is None):
        raise Glm5Fp4Error("w4a4 mode needs the experts' input scales (input_scale tensors)")
    return experts


def _reference_forward(x, topk_weights, topk_ids, prepared, mode):
    return moe_reference(x, topk_weights, topk_ids, prepared, mode=mode)


# -- registry -------------------------------------------------------------------------------------

_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    if backend.name == AUTO:
        raise Glm5Fp4Error(f"{AUTO!r} is reserved for automatic selection")
    _REGISTRY[backend.name] = backend


register(Backend("triton", "fused Triton NVFP4 MoE kernel (CUDA)", _triton_supports, _triton_prepare, _triton_forward,
                 reserve_fn=_triton_reserve))
register(Backend("dequant", "weights dequantized once at load; engine's dense MoE kernel (CPU)", _dequant_supports,
                 _dequant_prepare, lambda x, w, i, p, m: dense_moe(x, w, i, p, m), engine_dense_w4a16=True))
register(Backend("reference", "float32 oracle MoE (any device, slow)", _reference_supports, _reference_prepare,
                 _reference_forward))


def names() -> tuple[str, ...]:
    """Every name :func:`select` accepts, ``auto`` first."""
    return (AUTO, *_REGISTRY)


def get(name: str) -> Backend:
    if name not in _REGISTRY:
        raise Glm5Fp4Error(f"unknown MoE backend {name!r}; choose one of {', '.join(names())}")
    return _REGISTRY[name]


def auto_order(device: torch.device | str) -> tuple[str, ...]:
    """The backends ``auto`` tries, in order, on this kind of device."""
    return ("triton",) if torch.device(device).type == "cuda" else ("dequant",)


@dataclass(frozen=True)
class Selection:
    requested: str
    backend: Backend | None
    reason: str  # why nothing was selected (empty when a backend was)

    @property
    def ok(self) -> bool:
        return self.backend is not None


def select(name: str, device: torch.device | str, shape: MoEShape, dtype: torch.dtype, mode: str = "w4a16",
           capability: int | None = None) -> Selection:
    """Pick the backend for one layer: the named one if it supports the layer, for ``auto`` the first that does."""
    candidates = auto_order(device) if name == AUTO else (get(name).name,)
    reasons = []
    for candidate in candidates:
        ok, reason = get(candidate).supports(device, shape, dtype, mode, capability)
        if ok:
            return Selection(name, get(candidate), "")
        reasons.append(f"{candidate}: {reason}")
    return Selection(name, None, "; ".join(reasons))
