"""Which of our NVFP4 MoE implementations serves a layer: a small registry engine adapters ask.

Engine adapters (vLLM, SGLang) never import kernels directly, and hold no rule of their own: they describe
the layer (device, shapes, activation dtype, whether the checkpoint has activation scales) and

* :func:`choose` resolves the mode (:func:`resolve_mode`) and answers with a :class:`Selection`: a
  :class:`Backend`, or the reason none fits, which the adapter logs before falling back to the engine's own
  NVFP4 path;
* after loading, :func:`prepare_layer` is the one call that turns the layer's ModelOpt parameters into what the
  backend runs (:func:`experts_from_layer`), reserves its buffers and frees the parameters it does not share
  (:func:`release_unshared`).

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
from dataclasses import dataclass, replace
from typing import Any

import torch

from glm5_fp4 import nvfp4
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.kernels import capability as kernel_capability
from glm5_fp4.reference import MODES, NvFp4Experts, moe_reference
from glm5_fp4.settings import PluginSettings

AUTO = "auto"
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
# A CUDA compute capability: 120, (12, 0) or None when unknown (glm5_fp4.kernels.capability.as_pair reads all).
Capability = int | tuple[int, int] | None


@dataclass(frozen=True)
class Backend:
    name: str
    summary: str
    supports_fn: Callable[[torch.device, MoEShape, torch.dtype, str, Capability], Support]
    prepare_fn: Callable[[NvFp4Experts, str, torch.dtype], Any]
    forward_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any, str, torch.Tensor | None], torch.Tensor]
    # True when, in W4A16 mode, an engine may run the prepared dense weights with its own unquantized MoE kernel.
    engine_dense_w4a16: bool = False
    # Allocate every buffer forward() will need for up to max_tokens tokens (before CUDA-graph capture).
    reserve_fn: Callable[[Any, int, int], None] | None = None
    # Compile ahead what forward() may launch for 1..max_tokens tokens (under the expert map its calls pass),
    # so no request waits for a JIT.
    warmup_fn: Callable[[Any, str, int, int, torch.dtype, torch.Tensor | None], None] | None = None

    def supports(self, device: torch.device | str, shape: MoEShape, dtype: torch.dtype, mode: str = "w4a16",
                 capability: Capability = None) -> Support:
        """``(ok, reason)``; the reason says what rules the layer out (empty when ok).

        ``capability``: the GPU's CUDA compute capability (120 or (12, 0) for SM120) when the caller knows it.
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

    def warm_up(self, prepared: Any, mode: str, top_k: int, max_tokens: int, dtype: torch.dtype,
                expert_map: torch.Tensor | None = None) -> None:
        if self.warmup_fn is not None:
            self.warmup_fn(prepared, mode, top_k, max_tokens, dtype, expert_map)

    def prepare(self, experts: NvFp4Experts, mode: str, dtype: torch.dtype) -> Any:
        return self.prepare_fn(experts, mode, dtype)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, prepared: Any, mode: str,
                expert_map: torch.Tensor | None = None) -> torch.Tensor:
        """Routed-expert output ``sum_k w_k * expert_k(x)`` for ``x [T, H]``; shared experts are the caller's.

        Expert parallelism: ``prepared`` holds this rank's experts, ``topk_ids`` are global ids and
        ``expert_map[global id]`` is the local id or -1 (an expert on another rank, which contributes nothing
        here: the engine's combine adds the ranks' partial sums).
        """
        return self.forward_fn(x, topk_weights, topk_ids, prepared, mode, expert_map)


def _common_support(shape: MoEShape, dtype: torch.dtype) -> Support:
    if shape.activation.lower() != "silu" or not shape.gated:
        return False, f"activation {shape.activation}{'' if shape.gated else ' (not gated)'} is not SwiGLU"
    if shape.has_bias:
        return False, "experts with biases are not supported"
    if dtype not in FLOAT_DTYPES:
        return False, f"activation dtype {dtype} is not bfloat16/float16"
    for what, n in (("hidden_size", shape.hidden_size), ("intermediate_size", shape.intermediate_size)):
        if n % (2 * nvfp4.BLOCK_SIZE):
            return False, f"{what}={n} is not a multiple of {2 * nvfp4.BLOCK_SIZE}"
    return True, ""


# -- triton ---------------------------------------------------------------------------------------

def _kernels():
    return importlib.import_module("glm5_fp4.kernels")


def _triton_supports(device: torch.device, shape: MoEShape, dtype: torch.dtype, mode: str,
                     capability: Capability) -> Support:
    if device.type != "cuda":
        return False, f"the Triton kernel needs a CUDA device (this layer is on {device.type})"
    if torch.version.hip:
        return False, "the Triton kernel is written and tested for NVIDIA GPUs only (this is ROCm)"
    ok, reason = kernel_capability.supports(device, capability=capability)  # the kernels' own GPU rule (SM89+)
    if not ok:
        return False, reason
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    try:
        kernels = _kernels()
    except ImportError as exc:
        return False, f"glm5_fp4.kernels cannot be imported ({exc})"
    ok, reason = _kernel_accepts_shape(kernels, shape)
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


def _triton_forward(x, topk_weights, topk_ids, prepared, mode, expert_map=None):
    return _kernels().fused_moe(x, topk_weights, topk_ids, prepared, mode, expert_map=expert_map)


def _triton_reserve(prepared, top_k: int, max_tokens: int) -> None:
    reserve = getattr(_kernels(), "reserve_workspace", None)
    if reserve is not None:
        reserve(prepared, top_k, max_tokens)


def _triton_warm_up(prepared, mode: str, top_k: int, max_tokens: int, dtype: torch.dtype,
                    expert_map: torch.Tensor | None = None) -> None:
    from glm5_fp4.kernels.warmup import warm_up

    warm_up(prepared, mode, top_k, max_tokens, dtype, expert_map)


# -- dequant --------------------------------------------------------------------------------------

@dataclass
class DenseExperts:
    """Experts dequantized to a float dtype, plus the static activation scales W4A4 emulation needs."""

    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    a13_scale: torch.Tensor | None = None  # [E]
    a2_scale: torch.Tensor | None = None  # [E]


def _dequant_supports(device: torch.device, shape: MoEShape, dtype: torch.dtype, mode: str,
                      capability: Capability) -> Support:
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


def dense_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, dense: DenseExperts, mode: str,
              expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU MoE on dense weights, float32 accumulation; in ``w4a4`` each GEMM input is NVFP4 fake-quantized.
    ``expert_map``: global -> local expert id, -1 for a remote expert (skipped)."""
    from glm5_fp4.reference import check_call, local_ids

    check_call(x, topk_weights, topk_ids, dense.w2.shape[1], mode)  # (a bogus mode ran w4a16)
    if not x.dtype.is_floating_point:
        raise Glm5Fp4Error(f"hidden states must be floating point, got {x.dtype}")
    w4a4 = mode == "w4a4"
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    topk_ids = local_ids(topk_ids, expert_map, dense.w13.shape[0])
    for e in torch.unique(topk_ids).tolist():
        if e < 0:
            continue
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
                        capability: Capability) -> Support:
    return True, ""


def _reference_prepare(experts: NvFp4Experts, mode: str, dtype: torch.dtype) -> NvFp4Experts:
    if mode == "w4a4" and (experts.a13_scale is None or experts.a2_scale is None):
        raise Glm5Fp4Error("w4a4 mode needs the experts' input scales (input_scale tensors)")
    return experts


def _reference_forward(x, topk_weights, topk_ids, prepared, mode, expert_map=None):
    return moe_reference(x, topk_weights, topk_ids, prepared, mode=mode, expert_map=expert_map)


# -- registry -------------------------------------------------------------------------------------

_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    if backend.name == AUTO:
        raise Glm5Fp4Error(f"{AUTO!r} is reserved for automatic selection")
    _REGISTRY[backend.name] = backend


register(Backend("triton", "fused Triton NVFP4 MoE kernel (CUDA)", _triton_supports, _triton_prepare, _triton_forward,
                 reserve_fn=_triton_reserve, warmup_fn=_triton_warm_up))
register(Backend("dequant", "weights dequantized once at load; engine's dense MoE kernel (CPU)", _dequant_supports,
                 _dequant_prepare, dense_moe, engine_dense_w4a16=True))
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
    mode: str = ""  # the layer's activation mode (set by choose)

    @property
    def ok(self) -> bool:
        return self.backend is not None


def select(name: str, device: torch.device | str, shape: MoEShape, dtype: torch.dtype, mode: str = "w4a16",
           capability: Capability = None) -> Selection:
    """Pick the backend for one layer: the named one if it supports the layer, for ``auto`` the first that does."""
    candidates = auto_order(device) if name == AUTO else (get(name).name,)
    reasons = []
    for candidate in candidates:
        ok, reason = get(candidate).supports(device, shape, dtype, mode, capability)
        if ok:
            return Selection(name, get(candidate), "")
        reasons.append(f"{candidate}: {reason}")
    return Selection(name, None, "; ".join(reasons))


# -- what an engine adapter calls -------------------------------------------------------------------

def resolve_mode(requested: str, device: torch.device | str, has_activation_scales: bool,
                 capability: Capability = None, where: str = "this layer") -> str:
    """The activation mode of a layer: explicit modes as asked; ``auto`` = W4A4 only where FP4 tensor cores
    multiply it (:func:`glm5_fp4.kernels.capability.fp4_mma_serves`: a Blackwell GPU with the native FP4 path on)
    and the checkpoint has activation scales, else W4A16 (emulated W4A4 is the slower of the two)."""
    if requested not in MODE_CHOICES:
        raise Glm5Fp4Error(f"{where}: unknown mode {requested!r} (choose one of {', '.join(MODE_CHOICES)})")
    if requested == "w4a4":
        if not has_activation_scales:
            raise Glm5Fp4Error(f"{where}: mode w4a4 needs the checkpoint's activation input scales, but this is a "
                               "W4A16_NVFP4 (weight-only) checkpoint; use mode w4a16 or auto")
        return "w4a4"
    if requested in MODES:
        return requested
    fp4_cores = torch.device(device).type == "cuda" and kernel_capability.fp4_mma_serves(capability)
    return "w4a4" if has_activation_scales and fp4_cores else "w4a16"


def choose(settings: PluginSettings, device: torch.device | str, shape: MoEShape, dtype: torch.dtype,
           has_activation_scales: bool, capability: Capability = None, refuse: str = "",
           where: str = "this layer") -> Selection:
    """Mode and backend for one MoE layer, as the user's settings ask. ``refuse``: a reason the engine knows
    rules our backends out (e.g. LoRA); ``capability`` None on a CUDA device: asked from torch."""
    device = torch.device(device)
    if capability is None:
        capability = kernel_capability.device_capability(device)
    mode = resolve_mode(settings.mode, device, has_activation_scales, capability, where)
    if refuse:
        return Selection(settings.backend, None, refuse, mode)
    return replace(select(settings.backend, device, shape, dtype, mode, capability), mode=mode)


# Parameter names of ModelOpt NVFP4 experts in both engines (vLLM ModelOptNvFp4FusedMoE, SGLang
# ModelOptNvFp4FusedMoEMethod register the same): [E, 2I, H/2] u8 codes, [E, 2I, H/16] E4M3 block scales,
# per-expert FP32 global scales ([E, 2] for gate and up) and static activation scales.
SCALE_PARAMS = ("w13_weight_scale", "w2_weight_scale", "w13_weight_scale_2", "w2_weight_scale_2", "w13_input_scale",
                "w2_input_scale")
CHECKPOINT_PARAMS = ("w13_weight", "w2_weight", *SCALE_PARAMS)


def experts_from_layer(layer: torch.nn.Module, mode: str, where: str = "experts",
                       warn: Callable[[str], None] | None = None) -> NvFp4Experts:
    """The layer's ModelOpt NVFP4 parameters as validated :class:`NvFp4Experts` (views, no copies); activation
    scales only in ``w4a4`` mode. SGLang sizes input scales for all global experts: the local ones are first."""
    gs13 = layer.w13_weight_scale_2.data
    if gs13.dim() == 2:
        if gs13.shape[1] == 2 and not torch.equal(gs13[:, 0], gs13[:, 1]) and warn is not None:
            warn(f"glm5_fp4: gate and up weight_scale_2 differ in {where}; using the gate's for both, as vLLM and "
                 "SGLang's Marlin path do (accuracy may suffer)")
        gs13 = gs13[:, 0]
    n_local = layer.w13_weight.shape[0]
    a13 = a2 = None
    if mode == "w4a4":
        # ModelOpt calibrates gate and up inputs separately; both see the same tensor, the max covers both.
        a13 = layer.w13_input_scale.data.float().reshape(layer.w13_input_scale.shape[0], -1).amax(dim=1)
        a13 = a13[:n_local].contiguous()
        a2 = layer.w2_input_scale.data.float().reshape(-1)[:n_local].contiguous()
    experts = NvFp4Experts(
        w13=layer.w13_weight.data, w13_scale=layer.w13_weight_scale.data, w13_global=gs13.contiguous(),
        w2=layer.w2_weight.data, w2_scale=layer.w2_weight_scale.data,
        w2_global=layer.w2_weight_scale_2.data.reshape(-1).contiguous(), a13_scale=a13, a2_scale=a2)
    experts.validate(where)
    return experts


def _storages(obj: Any, seen: set[int] | None = None) -> set[int]:
    """Data pointers of every non-empty tensor reachable from ``obj`` (attributes, containers)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return set()
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return {obj.untyped_storage().data_ptr()} if obj.numel() else set()
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple, set)):
        items = obj
    else:
        items = vars(obj).values() if hasattr(obj, "__dict__") else ()
    out: set[int] = set()
    for item in items:
        out |= _storages(item, seen)
    return out


def _empty_parameter(layer: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    setattr(layer, name, torch.nn.Parameter(tensor, requires_grad=False))


def release_unshared(layer: torch.nn.Module, names: tuple[str, ...], prepared: Any,
                     replace_fn: Callable[[torch.nn.Module, str, torch.Tensor], None] = _empty_parameter) -> list[str]:
    """Replace by empty tensors the parameters ``names`` whose memory ``prepared`` does not use (the backend
    keeps its own copy); ``replace_fn(layer, name, tensor)`` is the engine's way to swap a parameter. Returns
    the names freed."""
    keep = _storages(prepared)
    freed = []
    for name in names:
        param = getattr(layer, name, None)
        if isinstance(param, torch.Tensor) and param.numel() and param.untyped_storage().data_ptr() not in keep:
            replace_fn(layer, name, torch.empty(0, dtype=param.dtype, device=param.device))
            freed.append(name)
    return freed


def prepare_layer(selection: Selection, layer: torch.nn.Module, dtype: torch.dtype, top_k: int, max_tokens: int,
                  where: str = "experts", replace_fn: Callable[[torch.nn.Module, str, torch.Tensor], None] = _empty_parameter,
                  warn: Callable[[str], None] | None = None, expert_map: torch.Tensor | None = None) -> Any:
    """After loading, the one call: the layer's experts in the selected backend's form, its buffers reserved for
    ``max_tokens`` (before any CUDA-graph capture), its kernels compiled for the calls it will get (with
    ``expert_map``, the map forward() will be passed), the checkpoint-layout parameters it does not share freed."""
    if selection.backend is None:
        raise Glm5Fp4Error(f"{where}: no backend was selected ({selection.reason})")
    experts = experts_from_layer(layer, selection.mode, where, warn)
    # W4A4 emulation keeps float32 weights: FP4 MMA multiplies exact FP4 values and accumulates in float32, so
    # rounding the weights to BF16 would add an error the hardware does not have.
    prepared = selection.backend.prepare(experts, selection.mode,
                                         torch.float32 if selection.mode == "w4a4" else dtype)
    selection.backend.reserve(prepared, top_k, max_tokens)
    selection.backend.warm_up(prepared, selection.mode, top_k, max_tokens, dtype, expert_map)
    release_unshared(layer, CHECKPOINT_PARAMS, prepared, replace_fn)
    return prepared
