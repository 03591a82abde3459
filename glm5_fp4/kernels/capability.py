"""Which GPUs the fused NVFP4 MoE kernels run on: the one home of that rule.

Engine adapters and the backend registry ask :func:`supports` (through ``glm5_fp4.kernels.supports``)
instead of restating thresholds, so a GPU the kernel cannot run on falls back to the engine's own NVFP4
MoE path at load time rather than failing at the first forward.

* The W4A16 / W4A4-emulation kernels decode E2M1 through the FP8 hardware conversion
  (``cvt.rn.f16x2.e4m3x2``) and Triton's ``float8e4nv`` type, both SM89 (Ada) and newer. Ampere
  (SM80/86/87: A100, A10, RTX 3090) has neither.
* FP4 tensor cores (``mma ... kind::mxf4nvf4``, ``tcgen05``) exist on SM100 and newer; ``auto`` mode
  quantizes activations (W4A4) only where they multiply them: there, with the native FP4 path switched on
  (:func:`fp4_mma_serves`). Otherwise W4A4 is emulated by the 16-bit MMA kernels, which is slower than W4A16.
* TMA (tensor-descriptor copies, ``Gemm1Config.tma``) exists on SM90 and newer.
"""

from __future__ import annotations

import torch

MIN_CAPABILITY = (8, 9)
FP4_MMA_MIN_CAPABILITY = (10, 0)
TMA_MIN_CAPABILITY = (9, 0)


def as_pair(capability) -> tuple[int, int] | None:
    """``(major, minor)`` from a pair, an int such as 120 / 89, or None."""
    if capability is None:
        return None
    if isinstance(capability, int):
        return (capability // 10, capability % 10)
    major, minor = capability
    return (int(major), int(minor))


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def has_fp4_mma(capability) -> bool:
    """Whether a GPU of this capability has FP4 tensor cores (Blackwell and newer)."""
    cap = as_pair(capability)
    return cap is not None and cap >= FP4_MMA_MIN_CAPABILITY


# The switch of the opt-in native FP4 path (glm5_fp4.kernels.native_fp4), here so that mode resolution can read it
# without importing the kernels.
NATIVE_FP4_ENV = "GLM5_FP4_NATIVE_FP4"


def native_fp4_requested() -> bool:
    """Whether the user switched the native FP4-MMA path on (``GLM5_FP4_NATIVE_FP4=1``)."""
    from glm5_fp4 import envvars

    return envvars.flag(NATIVE_FP4_ENV)


def fp4_mma_serves(capability) -> bool:
    """Whether W4A4 runs on FP4 tensor cores on a GPU of this capability: it has them and the native path is on.
    Otherwise the W4A16 kernels emulate W4A4 (activations quantized in GEMM1 for every N tile): on an H200 2.9-19.5x
    slower than W4A16 (benchmarks/results/moe_kernel_h200_w4a4_tp8_5138df7.json, TP8 T = 1-4,096)."""
    return has_fp4_mma(capability) and native_fp4_requested()


def has_tma(capability) -> bool:
    """Whether a GPU of this capability has TMA (tensor-descriptor copies: Hopper and newer)."""
    cap = as_pair(capability)
    return cap is not None and cap >= TMA_MIN_CAPABILITY


def supports_capability(capability) -> tuple[bool, str]:
    cap = as_pair(capability)
    if cap is None:
        return True, ""  # unknown here; the launcher checks the real device again
    if cap < MIN_CAPABILITY:
        need = f"sm_{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]}"
        return False, (f"the fused NVFP4 MoE kernel needs {need}+ (hardware FP8 conversion for the E2M1 decode); "
                       f"this GPU is sm_{cap[0]}{cap[1]}")
    return True, ""


def supports(device: torch.device | str | None = None, capability=None, **_ignored) -> tuple[bool, str]:
    """``(ok, reason)`` for running the Triton kernels on ``device`` (or a GPU of ``capability``).

    Extra keyword arguments (shape, dtype, mode) are accepted so the backend registry can pass what it
    knows; the kernels' shape rules live in :func:`glm5_fp4.kernels.layout.prepare_experts`.
    """
    if device is not None:
        dev = torch.device(device)
        if dev.type != "cuda":
            return False, f"the fused NVFP4 MoE kernel runs on CUDA devices (this is {dev.type})"
        if capability is None:
            capability = device_capability(dev)
    return supports_capability(capability)
