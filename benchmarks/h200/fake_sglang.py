"""A fake SGLang server for rehearsing the H200 SGLang scripts on a CPU machine (SGLang cannot serve on a CPU).

It answers what the scripts ask of SGLang, in SGLang's shapes: ``/health``, ``/get_server_info`` (what
``profile capture --engine auto`` detects SGLang by), ``/v1/models``, OpenAI streaming ``/v1/completions`` (the
load tester's and the profile capture's load: glm5_fp4.loadtest.fake_server), native ``/generate`` (greedy
``output_ids``; ``return_logprob`` with ``logprob_start_len`` / ``top_logprobs_num``: ``meta_info`` with
``input_token_logprobs`` and ``input_top_logprobs``, None at position 0), and ``/start_profile`` /
``/stop_profile`` (writes one synthetic decode trace, SGLang's file naming, into the request's ``output_dir``).

The "model" is a deterministic function of the context: 64 candidate tokens per position (from a hash of the
last tokens) with normal logits; ``--perturb`` adds per-server noise of that many nats (the size of a kernel
difference), so two fakes of one checkpoint agree as closely as real servers should and the comparisons have
something to judge. Test double: the real server's numbers come from the H200.

    python benchmarks/h200/fake_sglang.py --port P --model-path DIR [--perturb 0.004] [--seed 1] [--trace-dir D]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
import zlib
from pathlib import Path

from aiohttp import web

from glm5_fp4.loadtest.fake_server import READY_PREFIX, FakeServer, FakeServerConfig

ROOT = Path(__file__).resolve().parents[2]
CANDIDATES = 64


class PseudoModel:
    def __init__(self, vocab: int, perturb: float, seed: int):
        self.vocab, self.perturb, self.seed = vocab, perturb, seed

    def logprobs(self, context: list[int]) -> dict[int, float]:
        """Log-softmax over this position's candidates (every other token: far below them)."""
        key = zlib.crc32(json.dumps(context[-3:] + [len(context) % 7]).encode())
        rng = random.Random(key)
        cands = rng.sample(range(16, self.vocab), min(CANDIDATES, self.vocab - 16))
        noise = random.Random(key ^ (self.seed * 7919))
        logits = {t: rng.gauss(0.0, 2.0) + (noise.gauss(0.0, self.perturb) if self.perturb else 0.0) for t in cands}
        top = max(logits.values())
        lse = top + math.log(sum(math.exp(v - top) for v in logits.values()))
        return {t: v - lse for t, v in logits.items()}

    def floor(self, lps: dict[int, float]) -> float:
        return min(lps.values()) - 20.0  # what a token outside the candidates gets

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ctx, out = list(prompt), []
        for _ in range(n):
            lps = self.logprobs(ctx)
            tok = max(lps, key=lambda t: (lps[t], -t))
            out.append(tok)
            ctx.append(tok)
        return out


class FakeSglang(FakeServer):
    def __init__(self, config: FakeServerConfig, model: PseudoModel, model_path: str, trace_dir: Path | None):
        super().__init__(config)
        self.model = model
        self.model_path = model_path
        self.trace_dir = trace_dir
        self.profiles = 0

    def make_app(self) -> web.Application:
        app = super().make_app()
        app.router.add_get("/get_server_info", self._server_info)
        app.router.add_post("/generate", self._sglang_generate)
        app.router.add_route("*", "/start_profile", self._start_profile)
        app.router.add_route("*", "/stop_profile", self._stop_profile)
        return app

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.15 (fake)", "model_path": self.model_path})

    async def _sglang_generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        ids = [int(t) for t in body["input_ids"]]
        params = body.get("sampling_params") or {}
        n = int(params.get("max_new_tokens", 16))
        out = self.model.greedy(ids, n)
        meta = {"prompt_tokens": len(ids), "completion_tokens": len(out), "finish_reason": {"type": "length"}}
        if body.get("return_logprob"):
            start = int(body.get("logprob_start_len") or 0)
            k = int(body.get("top_logprobs_num") or 0)
            tokens, tops = [], []
            for j in range(start, len(ids)):
                if j == 0:
                    tokens.append([None, ids[0], None])
                    tops.append(None)
                    continue
                lps = self.model.logprobs(ids[:j])
                tokens.append([lps.get(ids[j], self.model.floor(lps)), ids[j], None])
                tops.append([[v, t, None] for t, v in sorted(lps.items(), key=lambda kv: -kv[1])[:k]])
            meta["input_token_logprobs"], meta["input_top_logprobs"] = tokens, tops
        return web.json_response({"text": " ".join(f"w{t}" for t in out), "output_ids": out, "meta_info": meta})

    async def _start_profile(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        out = Path(body.get("output_dir") or self.trace_dir or "/tmp")
        asyncio.get_running_loop().call_later(0.3, self._write_trace, out, int(body.get("num_steps") or 5))
        return web.Response(text="Start profiling.\n")

    async def _stop_profile(self, request: web.Request) -> web.Response:
        return web.Response(text="Stop profiling. This will take some time.\n")

    def _write_trace(self, out: Path, steps: int) -> None:
        """One synthetic decode trace of this 'model' (tests/profiling_synthetic, SGLang's file naming)."""
        sys.path.insert(0, str(ROOT / "tests"))
        from profiling_synthetic import make_decode_traces

        import gzip

        self.profiles += 1
        files, _ = make_decode_traces(n_ranks=1, n_steps=max(steps, 4), layers=2, graph="full", naming="sglang",
                                      seed=self.profiles)
        out.mkdir(parents=True, exist_ok=True)
        for name, trace in files:
            name = name.replace("1764000000.123", f"{time.time():.3f}")
            with gzip.open(out / name, "wt") as f:
                json.dump(trace, f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--perturb", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace-dir", type=Path, default=None)
    ap.add_argument("--itl-ms", type=float, default=4.0)
    ap.add_argument("--fail-at-start", action="store_true", help="exit as a server that cannot start would")
    args = ap.parse_args(argv)
    if args.fail_at_start:
        print("Traceback (most recent call last):\nRuntimeError: fake SGLang: this server was told to fail at start",
              flush=True)
        return 1
    cfg_path = Path(args.model_path) / "config.json"
    vocab = json.loads(cfg_path.read_text()).get("vocab_size", 2048) if cfg_path.is_file() else 2048
    config = FakeServerConfig(model=args.model_path, ttft_ms=(20.0,), itl_ms=(args.itl_ms,), vocab_size=vocab)
    server = FakeSglang(config, PseudoModel(vocab, args.perturb, args.seed), args.model_path, args.trace_dir)

    async def serve() -> None:
        runner = web.AppRunner(server.make_app(), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port, reuse_address=True)
        await site.start()
        print(f"{READY_PREFIX}http://{args.host}:{args.port}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
