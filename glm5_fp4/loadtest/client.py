"""Streaming HTTP client: one coroutine per in-flight request, aiohttp underneath.

What matters at 512 streams and tens of thousands of SSE chunks per second:
- the connector's limit (aiohttp defaults to 100, which silently caps concurrency) is set to the
  concurrency, and a large read buffer avoids back-pressure stalls on long streams;
- SSE is parsed inside aiohttp's stream feed, i.e. in the event loop's I/O phase right after the
  socket read (see _ParsingStreamReader): the chunk time is the read time, independent of how
  many other coroutines are queued, and no coroutine wakes up per chunk;
- the per-chunk path is one clock read per socket read, a bytes split and one JSON scan;
  everything else (ITL splitting, statistics) happens after the run, in metrics.py.

Token accounting: with `stream_options.continuous_usage_stats` every chunk carries the running
`usage.completion_tokens`, so a chunk's token count is the change in it (several tokens per chunk
under MTP / speculative decoding). Chunks that add no token (chat's role chunk, a bare
finish_reason chunk) are not token arrivals. The extension is vLLM's: many servers send usage only
with the last chunk, or never. Without usage a chunk with text is a token arrival, counted as one
token here (the live progress count) and recounted after the run from its text
(metrics.chunk_token_counts), so the text of every arrival is kept.
"""

from __future__ import annotations

import asyncio
import json
import json.scanner
import re
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import yarl

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.loopback import is_loopback

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
READ_BUFSIZE = 4 * 1024 * 1024


REDACTED = "***"
# scheme://user:PASSWORD@ - greedy up to the authority's last "@", as urlsplit splits it
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\s:]*:)[^/?#\s]*@")


def redact_url(text: str) -> str:
    """``text`` with the password of every user:password URL in it replaced (results get committed)."""
    return _URL_PASSWORD.sub(rf"\g<head>{REDACTED}@", text)


def check_loopback(url: str, allow_remote: bool) -> None:
    """Load tests only target this machine unless the user says otherwise (--allow-remote)."""
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises for a port that is no number or out of range
    except ValueError as exc:  # "http://[::1" (unclosed bracket), "http://h:port"
        raise Glm5Fp4Error(f"--url {shown!r} is not a valid URL ({exc}), e.g. http://127.0.0.1:8000") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Glm5Fp4Error(f"--url {shown!r} is not an http(s) URL with a host, e.g. http://127.0.0.1:8000")
    if allow_remote or is_loopback(parts.hostname):
        return
    raise Glm5Fp4Error(
        f"--url {shown!r} is not a loopback address; load tests target 127.0.0.1/::1/localhost by default. "
        "Pass --allow-remote to load a remote server you are allowed to load."
    )


def base_url(url: str) -> str:
    """Accept http://host:port, .../v1 or a full endpoint URL; return http://host:port, without user:password
    (they go to the session as basic auth: ``url_auth``), so no message or result built from it holds them."""
    parts = urlsplit(url.rstrip("/"))
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"


def url_auth(url: str) -> aiohttp.BasicAuth | None:
    """The basic auth of a user:password URL (what aiohttp would send for it), None without userinfo."""
    return aiohttp.BasicAuth.from_url(yarl.URL(url))


@dataclass(slots=True)
class RequestRecord:
    """Raw observations of one request; metrics.finalize_request turns it into the JSONL row."""

    index: int
    prompt_len: int
    requested_output_len: int
    status: str = "not_sent"  # not_sent | running | ok | failed
    error_kind: str | None = None
    error: str | None = None
    start: float = 0.0  # perf_counter when the request was sent
    end: float = 0.0  # perf_counter when the request finished (ok or not)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each token-carrying chunk
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each carried (usage delta, else 1)
    chunk_texts: list[str] = field(default_factory=list)  # the text each carried
    usage_chunks: int = 0  # how many of them carried a running usage.completion_tokens
    output_tokens: int | None = None  # the server's final usage.completion_tokens
    server_prompt_tokens: int | None = None
    running_usage: bool = False  # every token chunk carried usage (continuous_usage_stats honoured)
    got_done: bool = False
    response_id: str | None = None
    finish_reason: str | None = None

    def fail(self, kind: str, message: str) -> None:
        if self.status != "failed":  # keep the first cause
            self.status = "failed"
            self.error_kind = kind
            self.error = message[:500]


class _StreamError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def make_session(concurrency: int, *, request_timeout_s: float | None, read_timeout_s: float | None,
                 api_key: str | None = None, auth: aiohttp.BasicAuth | None = None) -> aiohttp.ClientSession:
    n = max(1, int(concurrency))
    connector = aiohttp.TCPConnector(limit=n, limit_per_host=n, keepalive_timeout=60, force_close=False,
                                     ttl_dns_cache=300)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream", "Accept-Encoding": "identity"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    elif auth is not None:
        headers["Authorization"] = auth.encode()
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=request_timeout_s, sock_read=read_timeout_s),
        read_bufsize=READ_BUFSIZE,
        auto_decompress=False,  # SSE is not compressed (we do not send Accept-Encoding for it)
        headers=headers,
        trust_env=False,  # never route a loopback test through a proxy
    )


def build_payload(endpoint: str, model: str, prompt: str | list[int], output_len: int, *,
                  ignore_eos: bool, min_tokens: bool, extra_body: dict[str, Any] | None = None) -> bytes:
    """One request body, serialised once before the run starts."""
    body: dict[str, Any] = {"model": model, "stream": True, "max_tokens": output_len,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = output_len
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True
    if min_tokens:
        body["min_tokens"] = output_len
    if extra_body:
        body.update(extra_body)
    return json.dumps(body, separators=(",", ":")).encode()


class TokenCounter:
    """Live counters for the progress bar; bumped on the hot path, so plain attributes."""

    __slots__ = ("tokens", "chunks", "ok", "failed", "in_flight")

    def __init__(self) -> None:
        self.tokens = 0
        self.chunks = 0
        self.ok = 0
        self.failed = 0
        self.in_flight = 0


def _event_data(event: bytes) -> bytes | None:
    """The `data:` payload of one SSE event (multi-line data joined with \\n), None for comments."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]
    data = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(data) if data else None


def _make_json_parser() -> Any:
    """str -> object, strict (trailing garbage is an error), as cheap per call as possible.

    json.loads spends more time in its Python wrappers (encoding detection, whitespace checks)
    than in the C scanner for a 250-byte chunk, so call the scanner directly; orjson, when
    installed, is faster still.
    """
    try:
        import orjson

        return orjson.loads
    except ImportError:
        pass
    scan = json.scanner.make_scanner(json.JSONDecoder())

    def parse(text: str) -> Any:
        try:
            obj, end = scan(text, 0)
        except StopIteration:
            raise ValueError("not JSON") from None
        if end != len(text) and text[end:].strip():
            raise ValueError("trailing data after the JSON value")
        return obj

    return parse


_parse_json = _make_json_parser()


def _not_count(v: Any) -> bool:
    return v is not None and (type(v) is not int or v < 0)  # type(): no bool, no 1.0


class _SSEState:
    """Parses one response's SSE bytes as they arrive and records token-carrying chunks."""

    __slots__ = ("rec", "counter", "buf", "exact", "prev_tokens", "error")

    def __init__(self, rec: RequestRecord, counter: TokenCounter | None):
        self.rec, self.counter = rec, counter
        self.buf = b""
        self.exact = True
        self.prev_tokens = 0
        self.error: BaseException | None = None

    def feed(self, data: bytes, t: float) -> None:
        """Every event completed by `data` arrived at `t` (the read that delivered its last byte)."""
        if self.buf:
            data = self.buf + data
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        pos = 0
        while (k := data.find(b"\n\n", pos)) != -1:
            event = data[pos:k]
            pos = k + 2
            payload = _event_data(event)
            if payload is not None:  # None: empty event or ":" comment (keep-alive ping)
                self._event(payload, t)
        self.buf = data[pos:]

    def _event(self, payload: bytes, t: float) -> None:
        rec = self.rec
        if payload == b"[DONE]":
            rec.got_done = True
            return
        raw = payload.decode("utf-8", "replace")
        try:
            obj = _parse_json(raw)
        except ValueError:
            raise _StreamError("malformed_sse", f"malformed SSE data: {raw[:120]!r}") from None
        if not isinstance(obj, dict):
            raise _StreamError("malformed_sse", f"SSE data is not a JSON object: {raw[:120]!r}")
        choices = obj.get("choices")
        usage = obj.get("usage")
        ct = usage.get("completion_tokens") if usage else None
        # Checked here, so that a float count fails its request rather than the run's statistics after it.
        if usage and (_not_count(ct) or _not_count(usage.get("prompt_tokens"))):
            raise _StreamError("malformed_sse", f"usage counts are not integers >= 0: {raw[:120]!r}")
        if choices:
            first = choices[0]
            text = first.get("text")
            if text is None:  # chat: the delta's content (a reasoning model streams its reasoning first)
                delta = first.get("delta") or {}
                # reasoning_content: vLLM before 0.10; reasoning: later vLLM and SGLang. Some servers send both
                # with the same text in one delta: the first present is the chunk's text, never their sum.
                text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
            if type(text) is not str:
                raise _StreamError("malformed_sse", f"the chunk's text is not a string: {raw[:120]!r}")
            if ct is not None:
                n = ct - self.prev_tokens
                self.prev_tokens = ct
            else:
                n = 1 if text else 0
                self.prev_tokens += n
            if n > 0:
                rec.chunk_times.append(t)
                rec.chunk_tokens.append(n)
                rec.chunk_texts.append(text)
                if ct is not None:
                    rec.usage_chunks += 1
                if self.counter is not None:
                    self.counter.tokens += n
                    self.counter.chunks += 1
            fr = first.get("finish_reason")
            if fr:
                rec.finish_reason = fr
        elif "error" in obj:
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise _StreamError("server_error_event", f"server sent an error event: {msg}")
        if usage:
            rec.server_prompt_tokens = usage.get("prompt_tokens", rec.server_prompt_tokens)
            # the latest count is the total so far: the usage-only chunk, or usage sent with the last token
            rec.output_tokens = usage.get("completion_tokens", rec.output_tokens)
        if rec.response_id is None:
            rec.response_id = obj.get("id")

    def finish(self) -> None:
        tail = self.buf.strip()
        if tail and _event_data(tail) == b"[DONE]":  # a last event without its blank line
            self.rec.got_done = True
        if not self.rec.got_done:
            raise _StreamError("no_done", "stream ended without data: [DONE] (connection closed early)")
        if not self.rec.chunk_times:
            raise _StreamError("no_tokens", "stream finished without a single token")


_SSE_STATES: dict[int, _SSEState] = {}


class _ParsingStreamReader(aiohttp.StreamReader):
    """aiohttp's response stream, parsing SSE right where the socket data arrives.

    aiohttp feeds a response's StreamReader from the connection's data_received, in the event
    loop's I/O phase. Parsing there, instead of in a coroutine reading the stream, means:
    - the time of a chunk is taken when its bytes are read from the socket, not after every other
      stream's coroutine has run (at 512 streams ticking together that queue is milliseconds long
      and its order varies, which would show up as ITL jitter);
    - no coroutine wake-up per chunk (the reading coroutine only wakes at the end of the stream),
      which is most of the per-chunk CPU cost.
    Nothing is buffered, so the coroutine's readany() returns only at EOF or on an error.
    """

    __slots__ = ()

    def feed_data(self, data: bytes, *args: Any) -> Any:
        st = _SSE_STATES.get(id(self))
        if st is None:
            return super().feed_data(data, *args)
        if st.error is None and data:
            try:
                st.feed(data, time.perf_counter())
            except _StreamError as exc:
                st.error = exc
            except (AttributeError, TypeError, KeyError, IndexError) as exc:  # JSON of an unexpected shape
                st.error = _StreamError("malformed_sse", f"unexpected SSE data shape ({type(exc).__name__}: {exc})")
            if st.error is not None:
                self.set_exception(st.error)
        return False


def _parse_in_place(content: Any, st: _SSEState) -> bool:
    """Make `content` parse into `st` as data arrives; False if aiohttp's class cannot be extended."""
    if type(content) is aiohttp.StreamReader:
        try:
            content.__class__ = _ParsingStreamReader
        except TypeError:
            return False
    elif not isinstance(content, _ParsingStreamReader):
        return False
    _SSE_STATES[id(content)] = st
    return True


async def stream_request(session: aiohttp.ClientSession, url: str, body: bytes, rec: RequestRecord,
                         counter: TokenCounter | None = None) -> None:
    """Send one streaming request and record what arrives. Never raises except on cancellation."""
    perf = time.perf_counter
    rec.status = "running"
    content = None
    rec.start = perf()
    try:
        async with session.post(url, data=body, allow_redirects=False) as resp:
            if resp.status != 200:
                text = await resp.text(errors="replace")
                raise _StreamError(f"http_{resp.status}", f"HTTP {resp.status} {resp.reason}: {text.strip()[:300]}")
            content = resp.content
            st = _SSEState(rec, counter)
            early = content.read_nowait() if content.total_bytes else b""  # arrived with the headers
            if early:
                st.feed(early, perf())
            if _parse_in_place(content, st):
                await content.readany()  # returns at EOF; raises what feed_data or the connection set
            else:
                while raw := await content.readany():
                    st.feed(raw, perf())
            st.finish()
        rec.status = "ok"
    except _StreamError as exc:
        rec.fail(exc.kind, str(exc))
    except (AttributeError, TypeError, KeyError, IndexError) as exc:  # JSON of an unexpected shape
        rec.fail("malformed_sse", f"unexpected SSE data shape ({type(exc).__name__}: {exc})")
    except asyncio.CancelledError:
        rec.fail("cancelled", "cancelled before the stream finished (run timeout or interrupt)")
        rec.end = perf()
        raise
    except asyncio.TimeoutError:
        rec.fail("timeout", "request timed out (no data within --read-timeout, or over --request-timeout)")
    except aiohttp.ClientConnectorError as exc:
        rec.fail("connect_error", f"cannot connect: {exc}")
    except aiohttp.ServerDisconnectedError as exc:
        rec.fail("disconnected", f"server disconnected: {exc}")
    except aiohttp.ClientPayloadError as exc:
        rec.fail("disconnected", f"response payload broken (connection lost mid-stream): {exc}")
    except aiohttp.ClientOSError as exc:  # reset/broken pipe on an open connection
        rec.fail("disconnected", f"connection lost: {exc}")
    except aiohttp.ClientError as exc:
        rec.fail("client_error", f"{type(exc).__name__}: {exc}")
    except OSError as exc:
        rec.fail("os_error", f"{type(exc).__name__}: {exc}")
    finally:
        if content is not None:
            _SSE_STATES.pop(id(content), None)
        rec.running_usage = bool(rec.chunk_times) and rec.usage_chunks == len(rec.chunk_times)
    rec.end = perf()
    if counter is not None:
        if rec.status == "ok":
            counter.ok += 1
        else:
            counter.failed += 1


async def server_gone(session: aiohttp.ClientSession, base: str, timeout_s: float = 5.0) -> str | None:
    """Why the server at ``base`` no longer answers at all (None: it answered GET /v1/models, whatever the
    status). Asked after requests failed, to tell a crashed server from a failing one."""
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(f"{base}/v1/models", allow_redirects=False) as resp:
                await resp.read()
        return None
    except TimeoutError:
        return f"GET {base}/v1/models: no answer within {timeout_s:g} s (hung or crashed)"
    except aiohttp.ClientError as exc:
        return f"GET {base}/v1/models: {exc}"


async def json_reply(resp: aiohttp.ClientResponse, where: str) -> Any:
    """The body of a reply the load test reads fields from, as JSON; one error naming ``where`` if it is not (an
    HTML page from another service on that port, say)."""
    text = await resp.text(errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        raise Glm5Fp4Error(f"{where}: the reply is not JSON ({text[:60]!r}); is --url an OpenAI-compatible "
                           "server?") from None


def reply_field(reply: Any, key: str, where: str, kinds: type | tuple[type, ...]) -> Any:
    """``reply[key]``, checked to be an object's field of one of ``kinds``; one error naming ``where`` and the field."""
    if not isinstance(reply, dict):
        raise Glm5Fp4Error(f"{where}: the reply is a {type(reply).__name__ if reply is not None else 'null'}, "
                           "not an object")
    if key not in reply:
        raise Glm5Fp4Error(f"{where}: the reply has no field {key!r}")
    value = reply[key]
    if isinstance(value, bool) or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))
        raise Glm5Fp4Error(f"{where}: the reply's field {key!r} is {json.dumps(value)[:40]}, not {names}")
    return value


async def get_first_model(session: aiohttp.ClientSession, base: str) -> str:
    where = f"GET {base}/v1/models"
    try:
        async with session.get(f"{base}/v1/models", allow_redirects=False) as resp:
            if resp.status != 200:
                raise Glm5Fp4Error(f"{where} returned HTTP {resp.status}; pass --model NAME")
            data = await json_reply(resp, where)
    except aiohttp.ClientError as exc:
        raise Glm5Fp4Error(f"cannot reach {base}/v1/models ({exc}); is the server up? (--url)") from exc
    try:
        models = reply_field(data, "data", where, list)
    except Glm5Fp4Error as exc:
        raise Glm5Fp4Error(f"{exc}; pass --model NAME") from None
    if not models:
        raise Glm5Fp4Error(f"{base}/v1/models lists no model; pass --model NAME")
    if not isinstance(models[0], dict) or not isinstance(models[0].get("id"), str):
        raise Glm5Fp4Error(f"{where}: model entry 0 has no string field 'id' ({json.dumps(models[0])[:60]}); "
                           "pass --model NAME")
    return models[0]["id"]
