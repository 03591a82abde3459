"""A fast, deterministic OpenAI-style streaming server for tests and for benchmarking the client.

Timing is a schedule, not a model: request number n (in arrival order, warm-ups included) gets
TTFT `ttft_ms[n % len]`; chunk j >= 1 is sent `itl_ms[(j-1) % len]` after chunk j-1 and every
chunk j carries `tokens_per_chunk[j % len]` tokens (the last one is cut to max_tokens). Chunks are
sent at absolute deadlines measured from the request's arrival, so a late wake-up never shifts
the rest of the stream. One pacer task sends every chunk of every stream in deadline order, which
keeps the server cheap enough to feed 512 streams from one core. Streams started together tick
together, like sequences in one decode batch of a real engine. With `record_sends` the server keeps each chunk's actual send time
(perf_counter, which is CLOCK_MONOTONIC on Linux and so comparable across processes) for
measuring what the client adds on top of the server.

Failure injection is deterministic by arrival number too (`*_every=K` hits requests
K-1, 2K-1, ...): HTTP errors, malformed SSE, an SSE error event, a truncated connection, a hung
stream, and the whole process dying (`die_after_*`, only when run as its own process).

It also serves a toy word-level `/tokenize` and `/detokenize` (vLLM's request/response shape):
token i is the word "w<i>", a BOS is added when `add_special_tokens`, and the chat template adds
`CHAT_TEMPLATE_TOKENS` tokens, so prompt builders can be checked for exact lengths.

Run: python -m glm5_fp4.loadtest.fake_server --port 8000 --ttft-ms 100 --itl-ms 20
It binds 127.0.0.1 unless told otherwise and prints `listening on http://HOST:PORT` when ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import heapq
import math
import os
import select
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

BOS_ID = 1
CHAT_TEMPLATE_TOKENS = 3  # "<|user|>" ... "<|assistant|>" markers of the toy chat template
READY_PREFIX = "listening on "


@dataclass
class FakeServerConfig:
    model: str = "fake-model"
    ttft_ms: tuple[float, ...] = (50.0,)
    itl_ms: tuple[float, ...] = (20.0,)
    tokens_per_chunk: tuple[int, ...] = (1,)
    # Extra gap per concurrently active stream, so sweeps over concurrency give non-flat curves.
    itl_slope_ms: float = 0.0
    default_max_tokens: int = 16
    # Stop after this many tokens unless the request sets ignore_eos (0 = never stop early);
    # min_tokens is honoured, as vLLM does.
    eos_after: int = 0
    vocab_size: int = 32000
    max_model_len: int = 1 << 20
    fail_after_chunks: int = 2
    http_error_every: int = 0
    http_error_status: int = 500
    malformed_every: int = 0
    error_event_every: int = 0
    truncate_every: int = 0
    hang_every: int = 0
    die_after_chunks: int = 0
    die_after_s: float = 0.0
    record_sends: bool = False
    # "requested": usage as stream_options asks (continuous_usage_stats on every chunk, vLLM's extension);
    # "last": only with the last token chunk, as many OpenAI-compatible servers do; "none": never
    usage: str = "requested"
    prompt_tokens_zero: bool = False  # report usage.prompt_tokens 0 (servers that do not count prompts)
    # Wake this long before each deadline and yield-spin to it: event-loop timers are only
    # millisecond-accurate (and uvloop's clock is cached), which would add ~1 ms of jitter.
    spin_us: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "itl_ms", "tokens_per_chunk"):
            values = tuple(getattr(self, name))
            if not values or any(v < 0 for v in values):
                raise ValueError(f"fake server: {name} must be a non-empty list of values >= 0, got {values}")
            object.__setattr__(self, name, values)
        if any(int(k) < 1 for k in self.tokens_per_chunk):
            raise ValueError(f"fake server: tokens_per_chunk must be >= 1, got {self.tokens_per_chunk}")
        if self.usage not in ("requested", "last", "none"):
            raise ValueError(f"fake server: usage must be requested, last or none, got {self.usage!r}")


def _hit(n: int, every: int) -> bool:
    return every > 0 and n % every == every - 1


def toy_tokenize(text: str) -> list[int]:
    """Word-level toy tokenizer: "w<i>" -> i, any other word -> a stable hash bucket."""
    ids = []
    for word in text.split():
        if word.startswith("w") and word[1:].isdigit():
            ids.append(int(word[1:]))
        else:
            ids.append(zlib.crc32(word.encode()))
    return ids


class FakeServer:
    def __init__(self, config: FakeServerConfig, *, allow_exit: bool = False):
        if not allow_exit and (config.die_after_chunks or config.die_after_s):
            raise ValueError("fake server: die_after_* only works when the server runs as its own process")
        self.cfg = config
        self.arrivals = 0
        self.active = 0
        self.chunks_sent = 0
        self.tokens_sent = 0
        self.max_lag_s = 0.0
        self.send_log: dict[str, dict[str, Any]] = {}
        self._first_request_at: float | None = None
        self._created = int(time.time())
        self._heap: list[tuple[float, int, _Stream]] = []
        self._seq = 0
        self._pacer: asyncio.Task | None = None
        self._wake: asyncio.Future | None = None
        self._sleep_until = math.inf

    # ----------------------------------------------------------------- app
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/fake/stats", self._stats)
        app.router.add_get("/fake/send_log", self._send_log)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.cfg.model, "object": "model", "owned_by": "fake",
                                         "max_model_len": self.cfg.max_model_len}]}
        )

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"arrivals": self.arrivals, "active": self.active, "chunks_sent": self.chunks_sent,
             "tokens_sent": self.tokens_sent, "max_lag_ms": self.max_lag_s * 1e3}
        )

    async def _send_log(self, request: web.Request) -> web.Response:
        return web.json_response(self.send_log)

    # ----------------------------------------------------------- tokenizer
    def _prompt_tokens(self, body: dict[str, Any], chat: bool) -> int:
        if chat:
            msgs = body.get("messages") or []
            words = sum(len(toy_tokenize(m.get("content") or "")) for m in msgs if isinstance(m, dict))
            return words + CHAT_TEMPLATE_TOKENS + 1
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            return len(prompt)  # token ids: taken as given, no BOS added
        return len(toy_tokenize(str(prompt))) + 1

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "messages" in body:
            ids = [BOS_ID] + [0] * CHAT_TEMPLATE_TOKENS
            for m in body["messages"]:
                ids += toy_tokenize(m.get("content") or "")
        else:
            ids = toy_tokenize(str(body.get("prompt", "")))
            if body.get("add_special_tokens", True):
                ids = [BOS_ID] + ids
        ids = [i % self.cfg.vocab_size for i in ids]
        return web.json_response({"count": len(ids), "max_model_len": self.cfg.max_model_len, "tokens": ids,
                                  "token_strs": None})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt": " ".join(f"w{int(t)}" for t in body.get("tokens", []))})

    # ---------------------------------------------------------- generation
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _maybe_start_die_timer(self) -> None:
        if self._first_request_at is None:
            self._first_request_at = time.perf_counter()
            if self.cfg.die_after_s:
                asyncio.get_running_loop().call_later(self.cfg.die_after_s, os._exit, 17)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        t_arrival = time.perf_counter()
        n = self.arrivals
        self.arrivals += 1
        self._maybe_start_die_timer()
        cfg = self.cfg
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("body is not a JSON object")
        except Exception as exc:  # noqa: BLE001 - any bad body is the client's fault
            return web.json_response({"error": {"message": f"bad JSON body: {exc}", "code": 400}}, status=400)
        if _hit(n, cfg.http_error_every):
            return web.json_response(
                {"error": {"message": f"injected error for request {n}", "type": "InternalServerError",
                           "code": cfg.http_error_status}},
                status=cfg.http_error_status,
            )
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or cfg.default_max_tokens
        n_out = int(max_tokens)
        if cfg.eos_after and not body.get("ignore_eos"):
            n_out = min(n_out, max(cfg.eos_after, int(body.get("min_tokens") or 0)))
        prompt_tokens = self._prompt_tokens(body, chat)
        ttft = cfg.ttft_ms[n % len(cfg.ttft_ms)] / 1e3
        if not body.get("stream"):
            return await self._non_streaming(body, chat, n, n_out, prompt_tokens, ttft)

        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage")) and cfg.usage == "requested"
        if cfg.prompt_tokens_zero:
            prompt_tokens = 0
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)  # sends the headers now: chunks then go straight to the transport
        st = _Stream(self, n, chat, include_usage, include_usage and bool(opts.get("continuous_usage_stats")),
                     n_out, prompt_tokens, t_arrival, t_arrival + ttft, request.transport, cfg.usage == "last")
        self.active += 1
        try:
            self._schedule(st)
            outcome = await st.finished
        finally:
            self.active -= 1
            st.closed = True
        if outcome == "eof":
            with contextlib.suppress(ConnectionError):
                await resp.write_eof()
        elif outcome == "hang":
            await asyncio.sleep(3600)
        return resp

    # ------------------------------------------------------------- pacing
    # One task sends every chunk of every stream, in deadline order, from a heap. Compared with a
    # coroutine per stream this saves a timer, a task switch and an awaited write per chunk,
    # which is what lets one core feed 512 streams at tens of thousands of chunks/s.
    def _schedule(self, st: _Stream) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (st.due, self._seq, st))
        if self._pacer is None or self._pacer.done():
            self._pacer = asyncio.get_running_loop().create_task(self._pace())
        elif st.due < self._sleep_until and self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _pace(self) -> None:
        loop = asyncio.get_running_loop()
        heap = self._heap
        perf = time.perf_counter
        spin = max(self.cfg.spin_us * 1e-6, 2e-4)
        while heap:
            now = perf()
            delay = heap[0][0] - now
            if delay > spin:
                # Sleep to just before the next deadline; a new, earlier stream wakes us up.
                self._sleep_until = heap[0][0]
                self._wake = loop.create_future()
                handle = loop.call_later(delay - spin, _set_if_pending, self._wake)
                await self._wake
                handle.cancel()
                self._sleep_until = math.inf
                continue
            if delay > 0:
                await asyncio.sleep(0)  # yield-spin the last stretch: timers are only ~1 ms accurate
                continue
            # Send everything that is due, then let the loop do its I/O.
            while heap and heap[0][0] <= now:
                st = heapq.heappop(heap)[2]
                if st.closed:
                    continue
                if st.send_next(now):
                    self._seq += 1
                    heapq.heappush(heap, (st.due, self._seq, st))
                now = perf()
            await asyncio.sleep(0)

    async def _non_streaming(self, body: dict, chat: bool, n: int, n_out: int, prompt_tokens: int,
                             ttft: float) -> web.Response:
        cfg = self.cfg
        chunks = []
        done = j = 0
        while done < n_out:
            k = min(int(cfg.tokens_per_chunk[j % len(cfg.tokens_per_chunk)]), n_out - done)
            chunks.append(k)
            done += k
            j += 1
        total = ttft + sum(cfg.itl_ms[i % len(cfg.itl_ms)] / 1e3 for i in range(len(chunks) - 1))
        await asyncio.sleep(total)
        text = " tok" * n_out
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return web.json_response({
            "id": f"fake-{n}", "object": "chat.completion" if chat else "text_completion",
            "created": self._created, "model": cfg.model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n_out,
                      "total_tokens": prompt_tokens + n_out},
        })


def _set_if_pending(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class _Stream:
    """One streaming response: its schedule position and how to write its next chunk."""

    __slots__ = ("srv", "n", "chat", "include_usage", "continuous", "usage_last", "n_out", "prompt_tokens", "due",
                 "done", "j", "transport", "finished", "closed", "head", "log")

    def __init__(self, srv: FakeServer, n: int, chat: bool, include_usage: bool, continuous: bool, n_out: int,
                 prompt_tokens: int, t_arrival: float, due: float, transport: Any, usage_last: bool = False):
        self.srv, self.n, self.chat = srv, n, chat
        self.include_usage, self.continuous, self.usage_last = include_usage, continuous, usage_last
        self.n_out, self.prompt_tokens = n_out, prompt_tokens
        self.due, self.done, self.j = due, 0, 0
        self.transport = transport
        self.finished: asyncio.Future = asyncio.get_running_loop().create_future()
        self.closed = False
        rid = f"{'chatcmpl' if chat else 'cmpl'}-fake-{n}"
        self.head = (
            f'data: {{"id":"{rid}","object":"{"chat.completion.chunk" if chat else "text_completion"}",'
            f'"created":{srv._created},"model":"{srv.cfg.model}","choices":[{{"index":0,'
        ).encode()
        self.log = None
        if srv.cfg.record_sends:
            self.log = {"n": n, "arrival": t_arrival, "due": [], "sent": [], "tokens": []}
            srv.send_log[rid] = self.log

    def _usage(self) -> bytes:
        return (f',"usage":{{"prompt_tokens":{self.prompt_tokens},"completion_tokens":{self.done},'
                f'"total_tokens":{self.prompt_tokens + self.done}}}').encode()

    def _write(self, data: bytes) -> None:
        # HTTP/1.1 chunked framing by hand: aiohttp already sent the headers in prepare().
        self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    def _finish(self, outcome: str) -> None:
        if not self.finished.done():
            self.finished.set_result(outcome)

    def send_next(self, now: float) -> bool:
        """Write chunk j; True if another chunk follows (self.due is then its deadline)."""
        srv, cfg, n = self.srv, self.srv.cfg, self.n
        if self.transport is None or self.transport.is_closing():
            self._finish("gone")
            return False
        if self.j == cfg.fail_after_chunks:
            if _hit(n, cfg.malformed_every):
                self._write(b'data: {"choices": [{"text": "broken\n\n')
            if _hit(n, cfg.error_event_every):
                self._write(b'data: {"error": {"message": "injected engine error", '
                            b'"type": "InternalServerError", "code": 500}}\n\ndata: [DONE]\n\n')
                self._finish("eof")
                return False
            if _hit(n, cfg.truncate_every):
                self.transport.abort()
                self._finish("gone")
                return False
            if _hit(n, cfg.hang_every):
                self._finish("hang")
                return False
        tpc = cfg.tokens_per_chunk
        k = min(int(tpc[self.j % len(tpc)]), self.n_out - self.done)
        self.done += k
        last = self.done >= self.n_out
        text = " tok" * k
        finish = '"length"' if last else "null"
        if self.chat:
            if self.j == 0:
                self._write(self.head + b'"delta":{"role":"assistant","content":""},"logprobs":null,'
                            b'"finish_reason":null}]' + (b',"usage":{"prompt_tokens":%d,"completion_tokens":0,'
                                                         b'"total_tokens":%d}' % (self.prompt_tokens, self.prompt_tokens)
                                                         if self.continuous else b"") + b"}\n\n")
            payload = self.head + (f'"delta":{{"content":"{text}"}},"logprobs":null,'
                                   f'"finish_reason":{finish}}}]').encode()
        else:
            payload = self.head + (f'"text":"{text}","logprobs":null,"finish_reason":{finish},'
                                   f'"stop_reason":null}}]').encode()
        if self.continuous or (self.usage_last and last):
            payload += self._usage()
        payload += b"}\n\n"
        if last:
            if self.include_usage:
                payload += self.head[: self.head.index(b'"choices"')] + b'"choices":[]' + self._usage() + b"}\n\n"
            payload += b"data: [DONE]\n\n"
        self._write(payload)
        lag = now - self.due
        if lag > srv.max_lag_s:
            srv.max_lag_s = lag
        srv.chunks_sent += 1
        srv.tokens_sent += k
        if self.log is not None:
            self.log["due"].append(self.due)
            self.log["sent"].append(now)
            self.log["tokens"].append(k)
        if cfg.die_after_chunks and srv.chunks_sent >= cfg.die_after_chunks:
            os._exit(17)
        if last:
            self._finish("eof")
            return False
        self.due += cfg.itl_ms[self.j % len(cfg.itl_ms)] / 1e3 + cfg.itl_slope_ms * srv.active / 1e3
        self.j += 1
        return True


# ------------------------------------------------------------------ running it
def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = FakeServerConfig()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed when ready)")
    p.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    p.add_argument("--model", default=d.model)
    p.add_argument("--ttft-ms", type=_floats, default=d.ttft_ms, help="comma list, cycled by arrival number")
    p.add_argument("--itl-ms", type=_floats, default=d.itl_ms, help="comma list of chunk gaps, cycled per chunk")
    p.add_argument("--tokens-per-chunk", type=lambda s: tuple(int(x) for x in s.split(",")),
                   default=d.tokens_per_chunk, help="comma list, cycled per chunk (MTP-like streams)")
    p.add_argument("--itl-slope-ms", type=float, default=d.itl_slope_ms,
                   help="extra chunk gap per active stream")
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    p.add_argument("--eos-after", type=int, default=d.eos_after)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--fail-after-chunks", type=int, default=d.fail_after_chunks)
    p.add_argument("--http-error-every", type=int, default=0)
    p.add_argument("--http-error-status", type=int, default=500)
    p.add_argument("--malformed-every", type=int, default=0)
    p.add_argument("--error-event-every", type=int, default=0)
    p.add_argument("--truncate-every", type=int, default=0)
    p.add_argument("--hang-every", type=int, default=0)
    p.add_argument("--die-after-chunks", type=int, default=0)
    p.add_argument("--die-after-s", type=float, default=0.0)
    p.add_argument("--spin-us", type=float, default=d.spin_us,
                   help="yield-spin this long before each send deadline (timer accuracy; 0 = plain sleeps)")
    p.add_argument("--record-sends", action="store_true", help="keep per-chunk send times (GET /fake/send_log)")
    p.add_argument("--usage", choices=("requested", "last", "none"), default=d.usage,
                   help="usage in the stream: as requested (continuous_usage_stats), only with the last token, never")
    p.add_argument("--prompt-tokens-zero", action="store_true", help="report usage.prompt_tokens 0")


def config_from_args(args: argparse.Namespace) -> FakeServerConfig:
    names = {f.name for f in dataclasses.fields(FakeServerConfig)}
    return FakeServerConfig(**{k: v for k, v in vars(args).items() if k in names})


async def _serve(server: FakeServer, host: str, port: int) -> None:
    runner = web.AppRunner(server.make_app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    # The server's heap is small and cycle-free in steady state; a collection pause would be
    # mistaken for server-side ITL jitter.
    gc.collect()
    gc.freeze()
    gc.disable()
    print(f"{READY_PREFIX}http://{host}:{bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm5_fp4.loadtest.fake_server", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        server = FakeServer(config_from_args(args), allow_exit=True)
    except ValueError as exc:
        parser.error(str(exc))
    if args.loop in ("auto", "uvloop"):
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            if args.loop == "uvloop":
                print("uvloop is not installed", file=sys.stderr)
                return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(server, args.host, args.port))
    return 0


@dataclass
class SpawnedServer:
    url: str
    proc: subprocess.Popen
    args: list[str] = field(default_factory=list)

    def kill(self) -> None:
        """SIGKILL: the abrupt death a crashed engine gives its clients."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stats(self) -> dict:
        """The server's counters (``/fake/stats``): arrivals, active streams, chunks and tokens sent."""
        import json
        import urllib.request

        with urllib.request.urlopen(self.url + "/fake/stats", timeout=5) as r:
            return json.load(r)

    def wait_for(self, ready: Callable[[dict], bool], timeout_s: float = 60.0, what: str = "") -> dict:
        """Poll :meth:`stats` until ``ready(stats)``: tests act on what the server has done, not on a clock (a
        loaded CI machine starts a client seconds late). Raises TimeoutError naming ``what`` and the last stats."""
        deadline, last = time.monotonic() + timeout_s, {}
        while time.monotonic() < deadline:
            last = self.stats()
            if ready(last):
                return last
            time.sleep(0.01)
        raise TimeoutError(f"fake server: {what or 'condition'} not reached in {timeout_s:.0f} s (stats {last})")


@contextlib.contextmanager
def spawn_fake_server(*args: str, cpu: int | None = None, ready_timeout_s: float = 30.0,
                      python: str = sys.executable) -> Iterator[SpawnedServer]:
    """Run the fake server in its own process on a free port; optionally pin it to one CPU."""
    cmd = [python, "-m", "glm5_fp4.loadtest.fake_server", "--port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        if cpu is not None and hasattr(os, "sched_setaffinity"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(proc.pid, {cpu})
        deadline = time.monotonic() + ready_timeout_s
        line = ""
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.1)
            if ready:
                line = proc.stdout.readline()
                if line.startswith(READY_PREFIX) or not line:
                    break
            if proc.poll() is not None:
                break
        if not line.startswith(READY_PREFIX):
            raise RuntimeError(f"fake server did not start (exit code {proc.poll()}): {' '.join(cmd)}")
        yield SpawnedServer(line[len(READY_PREFIX):].strip(), proc, list(args))
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


if __name__ == "__main__":
    sys.exit(main())
