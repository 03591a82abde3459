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
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.inputs import UniqueKeyLoader

ENV_VAR = "GLM5_FP4_HARDWARE"


# A figure no GPU can have (0, negative, NaN, infinite) gave negative step times or a ZeroDivisionError deep in the
# cost model; it is refused where the file is read, naming it.
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
# The tensor-core dtypes the cost model, the ceilings and selftest ask peaks for: a key spelled otherwise ('fp4',
# 'BF16') was kept and never asked for, so the expert GEMMs silently fell back to another roof.
PeakDtype = Literal["nvfp4", "fp8", "bf16", "fp16", "fp32", "tf32", "int8"]


class Peak(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dense: Positive | None = None
    sparse: Positive | None = None


class GpuSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    display_name: str
    device_names: tuple[str, ...] = ()  # what CUDA calls this part (torch.cuda.get_device_name), besides display_name
    arch: str
    compute_capability: tuple[int, int]
    sm_count: int = Field(gt=0)
    memory_gb: float = Field(gt=0, le=100_000, allow_inf_nan=False)  # le: 1e300 overflowed the byte counts
    # What the driver reports (cudaDeviceProp.totalGlobalMem, torch's total_memory), where measured: the engines size
    # their KV cache from it, and it is not the datasheet's GB (the H200's "141 GB" is 150.1e9 B, 139.8 GiB)
    memory_total_bytes: int | None = Field(default=None, gt=0)
    mem_bandwidth_gbs: Positive
    measured_copy_bandwidth_gbs: Positive | None = None
    smem_per_block_bytes: int = Field(gt=0)  # opt-in maximum; the table fills in the arch's when an entry omits it
    interconnect: str = ""
    p2p_bandwidth_gbs: Positive | None = None
    allreduce_bus_bandwidth_gbs: Positive | None = None
    allreduce_latency_us: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    power_w: Positive | None = None
    peaks_tflops: dict[PeakDtype, Peak]
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


BUILTIN = "glm5_fp4/data/hardware.yaml"
SECTIONS = ("gpus", "archs")


def gpu_key(name: str) -> str:
    """The one spelling of a GPU's table name: what ``--gpu`` and the file's keys are both read as
    ('RTX_PRO_6000_WS' and 'rtx pro 6000 ws' are 'rtx-pro-6000-ws')."""
    return str(name).strip().lower().replace("_", "-").replace(" ", "-")


def _sections(data: object, origin: str) -> dict[str, dict[str, dict]]:
    """{'gpus': {key: fields}, 'archs': {key: fields}} of one file, its shape checked (no values yet)."""
    if not isinstance(data, dict) or not any(k in data for k in SECTIONS):
        raise Glm5Fp4Error(f"{origin}: expected a mapping with a top-level 'gpus:' (name -> spec) and/or 'archs:' "
                           "(sm80/sm90/... -> limits) mapping")
    for key in data:
        if key not in SECTIONS:
            raise Glm5Fp4Error(f"{origin}: unknown top-level key {key!r} (a hardware file has 'gpus:' and 'archs:')")
    out: dict[str, dict[str, dict]] = {}
    for section, what, norm in (("gpus", "gpu", gpu_key), ("archs", "arch", arch_key)):
        entries = data.get(section)
        if entries is None:
            entries = {}
        if not isinstance(entries, dict):
            raise Glm5Fp4Error(f"{origin}: {section!r} must be a mapping of names to {what} entries, "
                               f"not {type(entries).__name__}")
        out[section] = {}
        for name, entry in entries.items():
            if not isinstance(entry, dict):
                raise Glm5Fp4Error(f"{origin}: {what} {name!r} must be a mapping of fields, "
                                   f"not {type(entry).__name__} ({entry!r:.60})")
            key = norm(str(name))
            if key in out[section]:
                raise Glm5Fp4Error(f"{origin}: {what} {name!r} is given twice (spelled as one: {key!r})")
            out[section][key] = entry
    return out


def _validated(model, key: str, fields: dict, origin: str, what: str):
    try:
        return model(**{**fields, "name": key})
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise Glm5Fp4Error(f"{origin}: {what} {key!r}, field {field!r}: {err['msg']}") from None


def _load_yaml(path: Path) -> object:
    if path.is_dir():
        raise Glm5Fp4Error(f"{path}: is a folder, not a hardware file (${ENV_VAR} names one YAML file)")
    try:
        return yaml.load(path.read_text(), Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except FileNotFoundError:
        raise Glm5Fp4Error(f"{path}: hardware file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise Glm5Fp4Error(f"{path}: cannot read the hardware file ({exc})") from None
    except yaml.YAMLError as exc:
        raise Glm5Fp4Error(f"{path}: not valid YAML ({exc})") from None


@lru_cache(maxsize=8)
def _load(extra: str | None) -> tuple[dict[str, GpuSpec], dict[str, ArchLimits]]:
    """The built-in table with the user's file on top. An entry the user's file names again is merged field by field
    (a bandwidth fixed without repeating device_names keeps them), validated as a whole, and placed after the
    built-ins, so that the user's entry is the one a device name finds. GPUs that omit shared memory take their
    arch's figure after the user's archs are in, so an arch override reaches them too."""
    builtin = resources.files("glm5_fp4") / "data" / "hardware.yaml"
    files = [(BUILTIN, _sections(yaml.safe_load(builtin.read_text()), BUILTIN))]
    if extra:
        files.append((str(extra), _sections(_load_yaml(Path(extra)), str(extra))))
    merged: dict[str, dict[str, tuple[dict, str]]] = {"gpus": {}, "archs": {}}
    for origin, sections in files:
        for section, entries in sections.items():
            for key, fields in entries.items():
                before = dict(merged[section].pop(key, ({}, origin))[0])
                if "memory_gb" in fields and "memory_total_bytes" not in fields:
                    before.pop("memory_total_bytes", None)  # the driver's figure was the other memory's
                peaks, old = fields.get("peaks_tflops"), before.get("peaks_tflops")
                if isinstance(peaks, dict) and isinstance(old, dict):
                    # one dtype's peak (or its dense figure alone) changes that, not every other dtype's
                    both = dict(old)
                    for d, p in peaks.items():
                        both[d] = {**old[d], **p} if isinstance(p, dict) and isinstance(old.get(d), dict) else p
                    fields = {**fields, "peaks_tflops": both}
                merged[section][key] = ({**before, **fields}, origin)
    archs = {k: _validated(ArchLimits, k, f, o, "arch") for k, (f, o) in merged["archs"].items()}
    gpus: dict[str, GpuSpec] = {}
    for key, (fields, origin) in merged["gpus"].items():
        arch = archs.get(arch_key(str(fields.get("arch", ""))))
        if "smem_per_block_bytes" not in fields and arch is not None:
            fields = {**fields, "smem_per_block_bytes": arch.smem_per_block_optin_bytes}
        gpus[key] = _validated(GpuSpec, key, fields, origin, "gpu")
    # Within one file a device is one entry's (which of two it is would depend on the order); across files the
    # user's entry, placed last, wins (detect_gpu_name).
    claimed: dict[tuple[str, str], str] = {}
    for key, gpu in gpus.items():
        origin = merged["gpus"][key][1]
        for dev, spelled in {_device_key(n): n for n in (gpu.display_name, *gpu.device_names)}.items():
            other = claimed.setdefault((origin, dev), key)
            if other != key:
                raise Glm5Fp4Error(f"{origin}: gpu entries {other!r} and {key!r} both name the device "
                                   f"{spelled!r}; a device is one entry's")
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
    key = gpu_key(name)
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
