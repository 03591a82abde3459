"""SSE parsing edge cases: the client records or rejects each odd stream, and never crashes."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from glm5_fp4.loadtest.client import RequestRecord, make_session, stream_request


def _chunk(text: str | int, completion_tokens: float | None, **extra) -> bytes:
    obj = {"id": "x", "choices": [{"index": 0, "text": text, "finish_reason": None}], **extra}
    if completion_tokens is not None:
        obj["usage"] = {"prompt_tokens": 3, "completion_tokens": completion_tokens}
    return json.dumps(obj, ensure_ascii=False).encode()


def _delta(delta: dict) -> bytes:
    return json.dumps({"id": "x", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}).encode()


_E = _chunk("h\u00e9", 1)
_MID = _E.index("\u00e9".encode()) + 1  # inside the two bytes of the UTF-8 "é"


USAGE_END = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}\n\n'

STREAMS: dict[str, tuple[list[bytes], dict]] = {
    # CRLF line ends, a ping comment, a chunk split across writes, a multi-byte character split in two
    "crlf-ping-split": ([b": ping\r\n\r\n", b"data: " + _E[:_MID], _E[_MID:] + b"\r\n\r\n",
                         b"data: " + _chunk(" a", 3) + b"\n\n", USAGE_END, b"data: [DONE]\n\n"],
                        {"status": "ok", "chunk_tokens": [1, 2], "output_tokens": 4}),
    # plain LF framing, an event split in the middle of its JSON, then two events in one write
    "split-lf": ([b"data: " + _chunk("a", 1)[:9], _chunk("a", 1)[9:] + b"\n\ndata: " + _chunk("b", 2)[:30],
                  _chunk("b", 2)[30:] + b"\n\ndata: " + _chunk("c", 5) + b"\n\n", b"data: [DONE]\n\n"],
                 {"status": "ok", "chunk_tokens": [1, 1, 3]}),
    # "data:" without a space and a payload on two data lines (joined with a newline: still JSON)
    "multiline-data": ([b'data:{"id":"x","choices":[{"index":0,"text":"a",\ndata: "finish_reason":null}]}\n\n',
                        b"data: [DONE]\n\n"], {"status": "ok", "chunk_tokens": [1], "output_tokens": None}),
    # no usage at all: every chunk with choices is one token (vLLM's rule)
    "no-usage": ([b"data: " + _chunk("a", None) + b"\n\n"] * 3 + [b"data: [DONE]\n\n"],
                 {"status": "ok", "chunk_tokens": [1, 1, 1]}),
    # several events in one write, as a server under load sends them
    "coalesced": ([b"".join(b"data: " + _chunk("a", i) + b"\n\n" for i in (1, 2, 4)) + b"data: [DONE]\n\n"],
                  {"status": "ok", "chunk_tokens": [1, 1, 2]}),
    "no-done": ([b"data: " + _chunk("a", 1) + b"\n\n"], {"status": "failed", "error_kind": "no_done"}),
    "no-tokens": ([USAGE_END, b"data: [DONE]\n\n"], {"status": "failed", "error_kind": "no_tokens"}),
    "bad-json": ([b"data: " + _chunk("a", 1) + b"\n\n", b"data: {nope}\n\n", b"data: [DONE]\n\n"],
                 {"status": "failed", "error_kind": "malformed_sse", "chunk_tokens": [1]}),
    "not-an-object": ([b"data: [1, 2]\n\n", b"data: [DONE]\n\n"], {"status": "failed", "error_kind": "malformed_sse"}),
    "wrong-shape": ([b'data: {"choices": "abc"}\n\n', b"data: [DONE]\n\n"],
                    {"status": "failed", "error_kind": "malformed_sse"}),
    # chat: the role chunk adds no token; reasoning streams as delta.reasoning (newer vLLM, SGLang) or
    # delta.reasoning_content (older vLLM), then the answer as delta.content; usage only at the end
    "chat-reasoning": ([b"data: " + _delta({"role": "assistant", "content": ""}) + b"\n\n",
                        b"data: " + _delta({"reasoning": " think"}) + b"\n\n",
                        b"data: " + _delta({"reasoning_content": " hmm"}) + b"\n\n",
                        b"data: " + _delta({"content": " tok"}) + b"\n\n", USAGE_END, b"data: [DONE]\n\n"],
                       {"status": "ok", "chunk_tokens": [1, 1, 1], "chunk_texts": [" think", " hmm", " tok"],
                        "output_tokens": 4}),
    # a count must be an integer and a text a string: anything else is a malformed chunk of that request, not a
    # crash of the whole run after its measured phase
    "float-usage": ([b"data: " + _chunk("a", 1.0) + b"\n\n", b"data: [DONE]\n\n"],
                    {"status": "failed", "error_kind": "malformed_sse"}),
    "negative-usage": ([b"data: " + _chunk("a", -2) + b"\n\n", b"data: [DONE]\n\n"],
                       {"status": "failed", "error_kind": "malformed_sse"}),
    "float-usage-last": ([b"data: " + _chunk("a", None) + b"\n\n",
                          b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4.0}}\n\n',
                          b"data: [DONE]\n\n"], {"status": "failed", "error_kind": "malformed_sse"}),
    "string-prompt-tokens": ([b'data: {"id":"x","choices":[{"index":0,"text":"a"}],'
                              b'"usage":{"prompt_tokens":"3","completion_tokens":1}}\n\n', b"data: [DONE]\n\n"],
                             {"status": "failed", "error_kind": "malformed_sse"}),
    "number-text": ([b"data: " + _chunk("a", None) + b"\n\n", b"data: " + _chunk(7, None) + b"\n\n",
                     b"data: [DONE]\n\n"], {"status": "failed", "error_kind": "malformed_sse"}),
    "number-content": ([b"data: " + _delta({"content": 7}) + b"\n\n", b"data: [DONE]\n\n"],
                       {"status": "failed", "error_kind": "malformed_sse"}),
    "error-event": ([b"data: " + _chunk("a", 1) + b"\n\n", b'data: {"error": {"message": "engine died"}}\n\n'],
                    {"status": "failed", "error_kind": "server_error_event"}),
}


async def _serve_and_stream(name: str) -> RequestRecord:
    parts, _ = STREAMS[name]

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part in parts:
            if part == b"SLEEP":
                await asyncio.sleep(0.06)
                continue
            await resp.write(part)
            await asyncio.sleep(0.002)  # separate network reads
        await resp.write_eof()
        return resp

    async def http500(request: web.Request) -> web.Response:
        return web.json_response({"error": "nope"}, status=503)

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/err", http500)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    rec = RequestRecord(0, 3, 4)
    try:
        async with make_session(1, request_timeout_s=10, read_timeout_s=10) as session:
            path = "/err" if name == "http" else "/v1/completions"
            await stream_request(session, f"http://127.0.0.1:{port}{path}", b"{}", rec)
    finally:
        await runner.cleanup()
    return rec


@pytest.mark.parametrize("name", list(STREAMS))
def test_odd_streams(name: str) -> None:
    rec = asyncio.run(_serve_and_stream(name))
    want = STREAMS[name][1]
    assert rec.status == want["status"], (rec.error_kind, rec.error)
    if "error_kind" in want:
        assert rec.error_kind == want["error_kind"] and rec.error
    if "chunk_tokens" in want:
        assert rec.chunk_tokens == want["chunk_tokens"]
        assert len(rec.chunk_times) == len(rec.chunk_tokens)
        assert all(b >= a for a, b in zip(rec.chunk_times, rec.chunk_times[1:]))
    if "chunk_texts" in want:
        assert rec.chunk_texts == want["chunk_texts"]
    if "output_tokens" in want:
        assert rec.output_tokens == want["output_tokens"]


def test_http_error_status_is_recorded() -> None:
    STREAMS["http"] = ([], {})
    try:
        rec = asyncio.run(_serve_and_stream("http"))
    finally:
        del STREAMS["http"]
    assert rec.status == "failed" and rec.error_kind == "http_503" and "HTTP 503" in rec.error


def test_event_time_is_when_its_last_byte_arrived() -> None:
    # the second event is split over two writes 60 ms apart: it arrived with the second write
    STREAMS["timed"] = ([b"data: " + _chunk("a", 1) + b"\n\ndata: " + _chunk("b", 2)[:15], b"SLEEP",
                         _chunk("b", 2)[15:] + b"\n\n", b"data: [DONE]\n\n"], {})
    try:
        rec = asyncio.run(_serve_and_stream("timed"))
    finally:
        del STREAMS["timed"]
    assert rec.status == "ok" and rec.chunk_tokens == [1, 1]
    gap = rec.chunk_times[1] - rec.chunk_times[0]
    assert 0.055 < gap < 0.2, gap
