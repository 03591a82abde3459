"""The hardware table: GPU peaks (dense and sparse per dtype), bandwidth, SMs, shared memory, with sources.

Built-in entries live in ``glm5_fp4/data/hardware.yaml``. Users add or override GPUs with a YAML file of
the same shape, named by ``GLM5_FP4_HARDWARE`` or passed to :func:`load_gpus`.
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
    arch: str
    compute_capability: tuple[int, int]
    sm_count: int = Field(gt=0)
    memory_gb: float = Field(gt=0)
    mem_bandwidth_gbs: float = Field(gt=0)
    measured_copy_bandwidth_gbs: float | None = None
    smem_per_block_bytes: int = Field(gt=0)
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


def _parse(data: object, origin: str) -> dict[str, GpuSpec]:
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), dict):
        raise Glm5Fp4Error(f"{origin}: expected a mapping with a top-level 'gpus:' mapping of name -> spec")
    out = {}
    for name, entry in data["gpus"].items():
        try:
            out[name] = GpuSpec(name=name, **(entry or {}))
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"])
            raise Glm5Fp4Error(f"{origin}: gpu {name!r}, field {field!r}: {err['msg']}") from None
    return out


def _load_yaml(path: Path) -> dict[str, GpuSpec]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise Glm5Fp4Error(f"{path}: hardware file not found") from None
    except yaml.YAMLError as exc:
        raise Glm5Fp4Error(f"{path}: not valid YAML ({exc})") from None
    return _parse(data, str(path))


@lru_cache(maxsize=8)
def load_gpus(extra: str | None = None) -> dict[str, GpuSpec]:
    """Built-in GPUs, then the user's file (``extra`` or ``$GLM5_FP4_HARDWARE``) added on top."""
    builtin = resources.files("glm5_fp4") / "data" / "hardware.yaml"
    gpus = _parse(yaml.safe_load(builtin.read_text()), "glm5_fp4/data/hardware.yaml")
    extra = extra or os.environ.get(ENV_VAR)
    if extra:
        gpus.update(_load_yaml(Path(extra)))
    return gpus


def list_gpus() -> list[str]:
    return sorted(load_gpus(os.environ.get(ENV_VAR)))


def get_gpu(name: str) -> GpuSpec:
    gpus = load_gpus(os.environ.get(ENV_VAR))
    key = name.lower().replace("_", "-").replace(" ", "-")
    if key not in gpus:
        raise Glm5Fp4Error(f"unknown GPU {name!r}; known: {', '.join(sorted(gpus))} (add yours via ${ENV_VAR})")
    return gpus[key]


def detect_gpu_name(device_name: str) -> str | None:
    """Map a CUDA device name (torch.cuda.get_device_name) to a table entry, if one matches."""
    lowered = device_name.lower()
    for name, spec in load_gpus(os.environ.get(ENV_VAR)).items():
        if spec.display_name.lower() in lowered or lowered in spec.display_name.lower():
            return name
    if "h200" in lowered:
        return "h200"
    if "b200" in lowered:
        return "b200"
    if "rtx pro 6000" in lowered:
        return "rtx-pro-6000-server" if "server" in lowered else "rtx-pro-6000-ws"
    return None
