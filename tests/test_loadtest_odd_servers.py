"""Whole runs against servers that stream what the fake server does not: reasoning as `delta.reasoning`, counts
that are not integers, texts that are not strings, outputs that stop before the fixed length.

Each server is a small aiohttp app in a thread of this process (the fake server's /v1/models and /tokenize, and
a streaming handler per test); the load test runs in the main thread as usual."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from aiohttp import web

from glm5_fp4.cli import main as cli_main
from glm5_fp4.loadtest.fake_server import FakeServer, FakeServerConfig
from glm5_fp4.loadtest.runner import LoadTestConfig, run_loadtest_detailed

# (arrival number, request body) -> SSE events, each sent GAP_S after the one before
Stream = Callable[[int, dict], list[bytes]]
GAP_S = 0.01


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _text(text, completion_tokens=None, finish=None) -> bytes:
    obj = {"id": "x", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if completion_tokens is not None:
        obj["usage"] = {"prompt_tokens": 16, "completion_tokens": completion_tokens}
    return _event(obj)


def _delta(delta: dict, finish=None) -> bytes:
    return _event({"id": "x", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def _usage(n: int) -> bytes:
    return _event({"id": "x", "choices": [], "usage": {"prompt_tokens": 16, "completion_tokens": n}})


DONE = b"data: [DONE]\n\n"


@contextlib.contextmanager
def odd_server(stream: Stream) -> Iterator[str]:
    fake = FakeServer(FakeServerConfig())
    arrivals = [0]

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = arrivals[0]
        arrivals[0] += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for ev in stream(n, body):
            await asyncio.sleep(GAP_S)
            await resp.write(ev)
        await resp.write_eof()
        return resp

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/v1/models", fake._models)
    app.router.add_post("/tokenize", fake._tokenize)
    app.router.add_post("/detokenize", fake._detokenize)
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _run(url: str, tmp_path: Path | None = None, **cfg):
    fields = dict(url=url, model="fake-model", concurrency=2, num_prompts=4, input_len=16, output_len=10,
                  num_warmups=0, progress=False, telemetry=False, timeout_s=30,
                  result_dir=str(tmp_path) if tmp_path else None)
    fields.update(cfg)
    return run_loadtest_detailed(LoadTestConfig(**fields))


# --- reasoning streamed as delta.reasoning ---------------------------------------------------------------

def _reasoning_then_answer(n: int, body: dict) -> list[bytes]:
    k = body["max_tokens"] // 2
    return ([_delta({"role": "assistant", "content": ""})] + [_delta({"reasoning": " think"})] * k
            + [_delta({"content": " tok"})] * (body["max_tokens"] - k) + [_usage(body["max_tokens"]), DONE])


def test_reasoning_in_delta_reasoning_is_token_arrivals():
    """Newer vLLM and SGLang stream reasoning as delta.reasoning: those chunks were not counted, so TTFT waited for
    the answer (126 ms instead of ~20) and TPOT halved, with no warning."""
    out = 16
    with odd_server(_reasoning_then_answer) as url:
        res, rows = _run(url, endpoint="chat", output_len=out)
    assert res["completed"] == 4 and res["failed"] == 0, res["first_errors"]
    for r in rows:
        assert r["num_chunks"] == out and r["output_tokens"] == out and len(r["itl_ms"]) == out - 1, r
        assert r["token_count_source"] == "tokenizer"
        # the first token is the first reasoning chunk, half a stream before the answer's
        assert r["ttft_ms"] < r["e2el_ms"] / 2, r


# --- counts and texts of the wrong type -------------------------------------------------------------------

def _every_other(bad: Callable[[int], bytes]) -> Stream:
    def stream(n: int, body: dict) -> list[bytes]:
        m = body["max_tokens"]
        if n % 2:
            return [*(bad(i) for i in range(m)), DONE]
        return [*(_text(" tok", i + 1, "length" if i == m - 1 else None) for i in range(m)), DONE]
    return stream


BAD = {
    "float-usage": lambda i: _text(" tok", float(i + 1)),  # 1.0, 2.0, ...: crashed the ITL split (TypeError)
    "number-text": lambda i: _text(7 if i == 1 else " tok"),  # no usage: crashed sorting the texts to count them
}


def test_counts_and_texts_of_the_wrong_type_fail_their_requests_not_the_run(tmp_path, capsys):
    """A float usage count or a number as text crashed the run after its measured phase, with a traceback and no
    results. Now each such request fails as malformed_sse and the run is written and reported."""
    for name, bad in BAD.items():
        d = tmp_path / name
        d.mkdir()
        with odd_server(_every_other(bad)) as url:
            rc = cli_main(["loadtest", "--url", url, "--model", "fake-model", "--concurrency", "2", "--num-prompts",
                           "4", "--input-len", "16", "--output-len", "10", "--num-warmups", "0", "--no-progress",
                           "--no-telemetry", "--timeout", "30", "--result-dir", str(d)])
        err = capsys.readouterr().err
        assert rc == 1 and "Traceback" not in err, (name, err)
        (summary,) = [json.loads(p.read_text()) for p in d.glob("*.json")]
        assert summary["completed"] == 2 and summary["errors_by_kind"] == {"malformed_sse": 2}, (name, summary)
        assert summary["total_output_tokens"] == 20 and summary["run_failed"] is True
        rows = [json.loads(x) for x in (d / summary["requests_file"]).read_text().splitlines()]
        assert [r["status"] for r in sorted(rows, key=lambda r: r["index"])].count("failed") == 2


# --- outputs shorter than asked ---------------------------------------------------------------------------

def _stops_at_4(n: int, body: dict) -> list[bytes]:
    """A server that does not honour ignore_eos / min_tokens: every request ends after 4 tokens."""
    return [*(_text(" tok", i + 1, "stop" if i == 3 else None) for i in range(4)), DONE]


def _fixed_length(n: int, body: dict) -> list[bytes]:
    m = body["max_tokens"]
    return [*(_text(" tok", i + 1, "length" if i == m - 1 else None) for i in range(m)), DONE]


def test_short_outputs_are_shown_and_make_compare_refuse(tmp_path, capsys):
    """short_outputs was computed but shown nowhere: a server stopping at 4 of 10 tokens passed silently and
    compare called it +681% better."""
    with odd_server(_stops_at_4) as url:
        res, _ = _run(url, tmp_path / "short", print_summary=True)
    assert res["short_outputs"] == 4 and res["completed"] == 4
    out = capsys.readouterr().out
    assert "Short outputs" in out and "4 of 4" in out and "ignore_eos" in out, out
    md = Path(res["result_file"]).with_suffix(".md").read_text()
    assert "Short outputs" in md and "4 of 4 (100%)" in md, md
    with odd_server(_fixed_length) as url:
        good, _ = _run(url, tmp_path / "good")
    assert good["short_outputs"] == 0
    assert "Short outputs" not in Path(good["result_file"]).with_suffix(".md").read_text()
    assert cli_main(["compare", good["result_file"], res["result_file"]]) == 1
    assert "shorter than asked" in capsys.readouterr().err


def test_extra_body_is_recorded_and_compared(tmp_path, capsys):
    """extra_body was only in argv: runs with and without it were compared with verdicts."""
    with odd_server(_fixed_length) as url:
        plain, _ = _run(url, tmp_path / "plain")
        extra, _ = _run(url, tmp_path / "extra", extra_body={"temperature": 0.5})
    assert json.loads(Path(extra["result_file"]).read_text())["metadata"]["extra_body"] == {"temperature": 0.5}
    assert json.loads(Path(plain["result_file"]).read_text())["metadata"]["extra_body"] is None
    assert cli_main(["compare", plain["result_file"], extra["result_file"]]) == 1
    assert "extra_body" in capsys.readouterr().err
