"""The hardware table: GPU peaks (dense and sparse per dtype), bandwidth, SMs, shared memory, with sources;
and the limits of each architecture the kernels target (:func:`arch_limits`, :func:`smem_limit`,
:func:`sm_count_guess`).

Built-in entries live in ``glm5_fp4/data/hardware.yaml``. Users add or override GPUs (and architectures) with a
YAML file of the same shape, named by ``GLM5_FP4_HARDWARE`` or passed to :func:`load_gpus`.
"""

from __future__ import annotations

import os
from functools import lru_cache
from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from glm5_fp4.errors import Glm5Fp4Error

ENV_VAR = "GLM5_FP4_HARDWARE"


class Peak(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dense: float | None = None
    sparse: float | None = None


class GpuSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    display_name: str
    device_names: tuple[str, ...] = ()  # what CUDA calls this part (torch.cuda.get_device_name), besides display_name
    arch: str
    compute_capability: tuple[int, int]
    sm_count: int = Field(gt=0)
    memory_gb: float = Field(gt=0)
    mem_bandwidth_gbs: float = Field(gt=0)
    measured_copy_bandwidth_gbs: float | None = None
    smem_per_block_bytes: int = Field(gt=0)  # opt-in maximum; the table fills in the arch's when an entry omits it
    interconnect: str = ""
    p2p_bandwidth_gbs: float | None = None
    allreduce_bus_bandwidth_gbs: float | None = None
    allreduce_latency_us: float | None = None
    power_w: float | None = None
    peaks_tflops: dict[str, Peak]
    notes: str = ""
    source: str

    def peak_tflops(self, dtype: str, sparse: bool = False) -> float | None:
        """Peak for ``dtype`` (nvfp4, fp8, bf16, fp32); None where the GPU has no such tensor-core path."""
        peak = self.peaks_tflops.get(dtype)
        if peak is None:
            return None
        return peak.sparse if sparse else peak.dense

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.mem_bandwidth_gbs * 1e9

    def ridge_flop_per_byte(self, dtype: str) -> float | None:
        """Arithmetic intensity where the dense ``dtype`` roof meets the bandwidth roof."""
        peak = self.peak_tflops(dtype)
        return None if peak is None else peak * 1e12 / self.bandwidth_bytes_per_s


class ArchLimits(BaseModel):
    """What every GPU of one architecture allows a kernel (names as the kernels spell them: sm80, sm120)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    smem_per_block_optin_bytes: int = Field(gt=0)
    sm_count_guess: int = Field(gt=0)  # when no device can be asked (compiling ahead of time, meta tensors)
    source: str


def arch_key(arch: str) -> str:
    """``sm_120`` / ``SM120`` / ``sm120`` -> ``sm120``."""
    return arch.lower().replace("_", "")


def _entries(data: dict, key: str, model, origin: str, what: str, **fill) -> dict:
    out = {}
    for name, entry in (data.get(key) or {}).items():
        try:
            out[name] = model(name=name, **{**fill.get(name, {}), **(entry or {})})
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"])
            raise Glm5Fp4Error(f"{origin}: {what} {name!r}, field {field!r}: {err['msg']}") from None
    return out


def _parse(data: object, origin: str, archs: dict[str, ArchLimits] | None = None
           ) -> tuple[dict[str, GpuSpec], dict[str, ArchLimits]]:
    if not isinstance(data, dict) or not any(isinstance(data.get(k), dict) for k in ("gpus", "archs")):
        raise Glm5Fp4Error(f"{origin}: expected a mapping with a top-level 'gpus:' (name -> spec) and/or 'archs:' "
                           "(sm80/sm90/... -> limits) mapping")
    archs = {**(archs or {}), **{arch_key(n): a for n, a in _entries(data, "archs", ArchLimits, origin, "arch").items()}}
    # a GPU without its own shared-memory figure has its architecture's
    fill = {name: {"smem_per_block_bytes": archs[arch_key(e["arch"])].smem_per_block_optin_bytes}
            for name, e in (data.get("gpus") or {}).items()
            if isinstance(e, dict) and "smem_per_block_bytes" not in e and arch_key(str(e.get("arch", ""))) in archs}
    gpus = _entries(data, "gpus", GpuSpec, origin, "gpu", **fill)
    claimed: dict[str, str] = {}
    for gpu in gpus.values():
        for key, spelled in {_device_key(n): n for n in (gpu.display_name, *gpu.device_names)}.items():
            other = claimed.setdefault(key, gpu.name)
            if other != gpu.name:  # which of the two a device is would depend on the file's order
                raise Glm5Fp4Error(f"{origin}: gpu entries {other!r} and {gpu.name!r} both name the device "
                                   f"{spelled!r}; a device is one entry's")
    return gpus, archs


def _load_yaml(path: Path) -> object:
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise Glm5Fp4Error(f"{path}: hardware file not found") from None
    except yaml.YAMLError as exc:
        raise Glm5Fp4Error(f"{path}: not valid YAML ({exc})") from None


@lru_cache(maxsize=8)
def _load(extra: str | None) -> tuple[dict[str, GpuSpec], dict[str, ArchLimits]]:
    builtin = resources.files("glm5_fp4") / "data" / "hardware.yaml"
    gpus, archs = _parse(yaml.safe_load(builtin.read_text()), "glm5_fp4/data/hardware.yaml")
    if extra:
        more_gpus, archs = _parse(_load_yaml(Path(extra)), str(extra), archs)
        gpus = {**gpus, **more_gpus}
    return gpus, archs


def load_gpus(extra: str | None = None) -> dict[str, GpuSpec]:
    """Built-in GPUs, then the user's file (``extra`` or ``$GLM5_FP4_HARDWARE``) added on top."""
    return dict(_load(extra or os.environ.get(ENV_VAR))[0])


def arch_limits(arch: str) -> ArchLimits:
    """The limits of architecture ``arch`` (``sm120``, ``sm_90``, ...) from the table's ``archs:``."""
    archs = _load(os.environ.get(ENV_VAR))[1]
    key = arch_key(arch)
    if key not in archs:
        raise Glm5Fp4Error(f"unknown GPU architecture {arch!r}; known: {', '.join(sorted(archs))} (add it under "
                           f"'archs:' via ${ENV_VAR})")
    return archs[key]


def smem_limit(arch: str) -> int:
    """Shared memory one block may use on ``arch`` (the opt-in maximum), bytes."""
    return arch_limits(arch).smem_per_block_optin_bytes


def sm_count_guess(arch: str) -> int:
    """SMs to plan for on ``arch`` when no device can be asked."""
    return arch_limits(arch).sm_count_guess


def list_gpus() -> list[str]:
    return sorted(load_gpus(os.environ.get(ENV_VAR)))


def get_gpu(name: str) -> GpuSpec:
    gpus = load_gpus(os.environ.get(ENV_VAR))
    key = name.lower().replace("_", "-").replace(" ", "-")
    if key not in gpus:
        raise Glm5Fp4Error(f"unknown GPU {name!r}; known: {', '.join(sorted(gpus))} (add yours via ${ENV_VAR})")
    return gpus[key]


def _device_key(name: str) -> str:
    return " ".join(name.lower().split())


def detect_gpu_name(device_name: str) -> str | None:
    """The table entry a CUDA device name (torch.cuda.get_device_name) is: the one whose display_name or
    device_names equal it, case and spacing aside; None for any other name. Names are never matched in part:
    'NVIDIA H20', 'NVIDIA GH200 480GB' and 'NVIDIA H200 NVL' are other parts than the H200 SXM, with other peaks
    and bandwidth. The user's file, added last, wins over a built-in entry naming the same device."""
    key = _device_key(device_name)
    for name, spec in reversed(load_gpus(os.environ.get(ENV_VAR)).items()):
        if key in {_device_key(n) for n in (spec.display_name, *spec.device_names)}:
            return name
    return None
