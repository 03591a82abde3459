"""What a bug report needs to know about the machine: GPU, driver, CUDA, software versions, table entry."""

from __future__ import annotations

import platform
import subprocess


def driver_version() -> str | None:
    """NVIDIA driver version from NVML if installed, else ``nvidia-smi``; None if neither answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML missing or failing: try the CLI
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
        line = out.stdout.strip().splitlines()
        return line[0].strip() if out.returncode == 0 and line else None
    except (OSError, subprocess.SubprocessError):
        return None


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", "unknown")
    except Exception:  # noqa: BLE001 - absent (or broken) optional package
        return None


def collect(device_index: int = 0) -> dict:
    """Everything about this GPU and software stack that matters for the MoE backend."""
    import torch

    from glm5_fp4 import __version__
    from glm5_fp4.hardware import detect_gpu_name, get_gpu
    from glm5_fp4.kernels import configs as C

    props = torch.cuda.get_device_properties(device_index)
    table_name = detect_gpu_name(props.name)
    table = get_gpu(table_name) if table_name else None
    return {
        "gpu": props.name,
        "device_index": device_index,
        "device_count": torch.cuda.device_count(),
        "compute_capability": f"{props.major}.{props.minor}",
        "arch": C.arch_of((props.major, props.minor)),
        "sm_count": props.multi_processor_count,
        "memory_gb": round(props.total_memory / 1e9, 1),
        "driver": driver_version(),
        "cuda_runtime": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "glm5_fp4": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "engines": {name: _version(name) for name in ("vllm", "sglang", "flashinfer")},
        "hardware_table": None if table is None else {
            "name": table.name,
            "mem_bandwidth_gbs": table.mem_bandwidth_gbs,
            "measured_copy_bandwidth_gbs": table.measured_copy_bandwidth_gbs,
            "smem_per_block_bytes": table.smem_per_block_bytes,
            "peak_bf16_tflops": table.peak_tflops("bf16"),
            "peak_nvfp4_tflops": table.peak_tflops("nvfp4"),
        },
    }
