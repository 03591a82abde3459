"""Serve a launch profile: print the exact command, start it, wait for /health, keep serving until Ctrl-C.

vLLM goes through the plugin's launcher (:func:`glm5_fp4.engines.vllm.serve.launch_vllm`, which also
preflights the environment); SGLang is started here the same way: its own process group, output streamed to
a log file, stopped with SIGINT then SIGKILL of the group.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.server_process import (ServerProcess, check_model_dir, install_stop_signals, local_model_dir,
                                     serve_until_stopped, spawn)
from glm5_fp4.launch.commands import (EngineCommand, build_command, owned_advice, owned_flag, refuse_config_file,
                                      refuse_our_options)
from glm5_fp4.launch.engine_choices import OURS
from glm5_fp4.launch.profile import check_fits_model, load_profile, model_dims, resolve_profile
from glm5_fp4.launch.spelling import read_as, spelled
from glm5_fp4.loopback import check_bind_host
from glm5_fp4.telemetry.nvml_reader import visible_gpu_count

# Flags that spread a layout over several nodes, whose GPUs this one cannot see (vLLM 0.33: --nnodes/-n, Ray,
# per-node DP ranks; SGLang 0.5.23: --nnodes, --dist-init-addr): with one, the visible GPUs are not counted.
MULTI_NODE_FLAGS = {"vllm": ("--nnodes", "-n", "--data-parallel-size-local", "--headless"),
                    "sglang": ("--nnodes", "--dist-init-addr")}


def _spread_over_nodes(engine: str, args: list[str]) -> bool:
    """Whether ``args`` spread the layout over several nodes (a flag of MULTI_NODE_FLAGS, or vLLM's Ray executor:
    its mp and uni executors are one node's)."""
    from glm5_fp4.launch.commands import flag_value

    if any(read_as(engine, a, MULTI_NODE_FLAGS[engine]) for a in args):
        return True
    return engine == "vllm" and flag_value("vllm", args, "--distributed-executor-backend") == "ray"

# serve flag -> profile field; the flags `glm5-fp4 serve --profile` accepts as overrides
OVERRIDE_FLAGS = {
    "engine": "--engine",
    "model": "--model",
    "moe_backend": "--moe-backend",
    "cuda_graphs": "--cuda-graphs",
    "host": "--host",
    "port": "--port",
    "glm5_fp4": "--backend/--mode",
}


def describe(command: EngineCommand) -> str:
    return f"{command.shell()}\n# why:\n{command.annotated()}"


@dataclass
class EngineProcess(ServerProcess):
    """A server started from an :class:`EngineCommand` (leads its own process group)."""

    command: EngineCommand
    process: subprocess.Popen
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)
    ready_after_s: float | None = None

    @property
    def name(self) -> str:
        return self.command.engine

    @property
    def base_url(self) -> str:
        return self.command.base_url


def start(command: EngineCommand, log_path: str | os.PathLike):
    """Start ``command`` (through :func:`glm5_fp4.server_process.spawn`); returns a handle with
    ``wait_healthy()``, ``stop()``, ``process`` and ``log_path``."""
    log = Path(log_path)
    if command.engine == "vllm":
        from glm5_fp4.engines.vllm.serve import launch_vllm

        return launch_vllm(**command.launcher_kwargs, log_path=log)
    try:
        process = spawn(command.argv, {**os.environ, **command.env}, log, command.shell(),
                        listen=(command.host, command.port))
    except FileNotFoundError:
        raise Glm5Fp4Error(f"{command.program[0]!r} not found: install SGLang 0.5.23 in this environment "
                           "(pip install 'glm5-fp4[sglang]')") from None
    return EngineProcess(command, process, log)


def serve_profile(profile_path: str, overrides: dict, *, dry_run: bool = False, log_file: str | None = None,
                  timeout: float = 900.0, extra_args: list[str] | None = None, allow_remote: bool = False) -> int:
    """`glm5-fp4 serve --profile FILE [...]`: print the command; unless ``dry_run``, run it until Ctrl-C.

    ``overrides`` maps profile fields to command-line values (None = not given); ``extra_args`` (after ``--``)
    are appended to the profile's own. A host other than loopback needs ``allow_remote``.
    """
    profile_path = str(resolve_profile(profile_path))  # every message names the file read
    profile = load_profile(profile_path, overrides, OVERRIDE_FLAGS)
    refuse_config_file(profile.engine, list(extra_args or ()), "after --")
    refuse_our_options(profile.engine, list(extra_args or ()), "after --")
    for arg in extra_args or ():  # the command line's own extras: blamed on it, not on the file's extra_args
        owned = owned_flag(profile.engine, arg)
        if owned:
            flag, field = owned
            instead = (f"pass {OVERRIDE_FLAGS[field]} to glm5-fp4 serve" if field in OVERRIDE_FLAGS
                       else f"change field {field!r} in {profile_path}")
            raise Glm5Fp4Error(f"{spelled(profile.engine, arg, flag)} after --: the profile sets it from field "
                               f"{field!r}; {owned_advice(arg, owned, instead)}")
    where = "--model" if overrides.get("model") else f"model in {profile_path}:"
    local_model_dir(profile.model, where)  # a path the OS refuses (too long): named here, not a traceback later
    if extra_args:
        profile = profile.model_copy(update={"extra_args": [*profile.engine_extra_args(), *extra_args]})
    check_bind_host(profile.host, allow_remote, "--host" if overrides.get("host") else f"host in {profile_path}:")
    command = build_command(profile, origin=str(profile_path))
    if profile.moe_backend == OURS:
        for field, var in (("backend", "GLM5_FP4_BACKEND"), ("mode", "GLM5_FP4_MODE")):
            shell = os.environ.get(var, "").strip()
            if shell and shell.lower() != getattr(profile.glm5_fp4, field):
                print(f"warning: {var}={shell} in this shell is overridden by the profile's glm5_fp4.{field} "
                      f"{getattr(profile.glm5_fp4, field)} (set it there)", file=sys.stderr)
    print(f"# {profile_path}: {profile.engine} {profile.layout}, cuda_graphs={profile.cuda_graphs}, "
          f"moe_backend={profile.moe_backend}", flush=True)
    print(describe(command), flush=True)
    check_model_dir(profile.model, where)  # before the engine starts (and in a dry run, which ran it nowhere)
    check_fits_model(profile, str(profile_path), *model_dims(profile.model),
                     model_flag="--model" if overrides.get("model") else None)
    gpus = None if _spread_over_nodes(profile.engine, profile.engine_extra_args()) else visible_gpu_count()
    if gpus and gpus < profile.world_size:  # none visible: a CPU engine, or the engine's own clear error
        shortfall = (f"{profile_path}: {profile.layout} needs {profile.world_size} GPUs (tensor_parallel x "
                     f"pipeline_parallel x data_parallel); this machine shows {gpus}"
                     + (f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})"
                        if os.environ.get("CUDA_VISIBLE_DEVICES") else ""))
        if not dry_run:
            raise Glm5Fp4Error(shortfall)
        print(f"warning: {shortfall}: the command above would not start here", file=sys.stderr)
    if dry_run:
        return 0
    log = log_file or f"glm5-fp4-{profile.engine}-{profile.effective_port}.log"
    install_stop_signals()
    return serve_until_stopped(start(command, log), timeout, f"{command.base_url}/v1")
