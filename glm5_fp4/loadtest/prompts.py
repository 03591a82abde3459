"""Prompts of an exact token length, built locally: no dataset download.

Same idea as vLLM's random dataset: draw random token ids (seeded numpy Generator, special ids
excluded), decode them to text, re-encode, then cut or top up and repeat until the re-encoded
length is the target (BPE merges across token boundaries change the count, so one pass is not
enough; unlike vLLM's loop, neighbouring cut points are tried so it converges instead of
oscillating - see fit_to_length). The target excludes what the server adds itself - BOS on /v1/completions, the chat
template on /v1/chat/completions - so the server's `usage.prompt_tokens` equals `--input-len`.

Tokenizer sources, in order: a local Hugging Face tokenizer directory (`--tokenizer DIR`, read
with local_files_only, never downloaded), else the server's own `/tokenize` + `/detokenize`
(vLLM and SGLang serve both). With the server's tokenizer the allowed ids are those of a fixed
seed text, since the server does not tell its vocabulary.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from glm5_fp4.errors import Glm5Fp4Error

MAX_RETRY = 10

_SEED_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there one all we their can has been if more when will would who so no time "
    "model server token decode prefill expert router layer cache memory kernel batch stream latency "
    "throughput request queue graph tensor weight scale block sparse dense attention head value key query "
    "river mountain window garden music number system history science water market paper light energy "
    "quickly slowly carefully between through under over after before during without within against "
    "alpha beta gamma delta epsilon zeta theta lambda sigma omega 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 "
    "red green blue yellow orange purple black white silver golden ancient modern simple complex"
).split()


@dataclass
class Prompt:
    prompt: str | list[int]
    prompt_len: int  # tokens the server should count, special tokens and chat template included
    output_len: int
    mismatch: int = 0  # re-encoded length - target, non-zero only if the retries ran out


class Tokenizer(Protocol):
    name: str

    async def encode(self, texts: list[str]) -> list[list[int]]: ...
    async def decode(self, ids: list[list[int]]) -> list[str]: ...
    async def overhead(self, endpoint: str) -> int: ...
    async def allowed_ids(self) -> np.ndarray: ...


class HfTokenizer:
    """A local Hugging Face tokenizer directory (tokenizer.json / tokenizer_config.json)."""

    def __init__(self, path: str, trust_remote_code: bool = False):
        p = Path(path)
        if not p.is_dir():
            raise Glm5Fp4Error(f"--tokenizer {path!r} is not a directory (expected a Hugging Face tokenizer dir)")
        try:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True,
                                                     trust_remote_code=trust_remote_code)
        except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad dir
            raise Glm5Fp4Error(f"--tokenizer {path!r}: cannot load a tokenizer from it ({exc})") from exc
        self.name = str(p)

    async def encode(self, texts: list[str]) -> list[list[int]]:
        return [list(x) for x in self.tok(texts, add_special_tokens=False)["input_ids"]]

    async def decode(self, ids: list[list[int]]) -> list[str]:
        return self.tok.batch_decode(ids)

    async def overhead(self, endpoint: str) -> int:
        bare = len(self.tok.encode("hello", add_special_tokens=False))
        if endpoint == "chat":
            if not getattr(self.tok, "chat_template", None):
                return 0  # no template: the server will refuse chat anyway, or add nothing
            ids = self.tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True,
                                               add_generation_prompt=True)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            return len(ids) - bare
        return len(self.tok.encode("hello", add_special_tokens=True)) - bare

    async def allowed_ids(self) -> np.ndarray:
        # Keep ids that survive decode -> encode on their own: byte fragments (half a UTF-8
        # character) and special tokens never re-encode to themselves and would keep a prompt
        # from settling on its length.
        special = set(self.tok.all_special_ids)
        ids = [i for i in range(len(self.tok)) if i not in special]
        texts = self.tok.batch_decode([[i] for i in ids])
        again = self.tok(texts, add_special_tokens=False)["input_ids"]
        return np.array([i for i, e in zip(ids, again) if list(e) == [i]], dtype=np.int64)


class ServerTokenizer:
    """The server's /tokenize and /detokenize endpoints (vLLM's request shapes)."""

    def __init__(self, session: Any, base: str, model: str, parallel: int = 16):
        self.session, self.base, self.model = session, base, model
        self.name = f"{base}/tokenize"
        self._sem = asyncio.Semaphore(parallel)

    async def _post(self, path: str, body: dict[str, Any], key: str, kinds: type | tuple[type, ...]) -> Any:
        """POST ``body`` to ``path`` and return the reply's field ``key`` (checked: the error names the field)."""
        import aiohttp

        from glm5_fp4.loadtest.client import json_reply, reply_field

        where = f"POST {self.base}{path}"
        async with self._sem:
            try:
                async with self.session.post(f"{self.base}{path}", json=body, allow_redirects=False) as r:
                    if r.status != 200:
                        raise Glm5Fp4Error(
                            f"{where} returned HTTP {r.status}; pass --tokenizer DIR "
                            "(the model's Hugging Face tokenizer directory) to build prompts locally")
                    reply = await json_reply(r, where)
            except aiohttp.ClientError as exc:
                raise Glm5Fp4Error(f"{where} failed ({exc}); is the server up? (--url) Or pass --tokenizer DIR to "
                                   "build prompts locally") from exc
        return reply_field(reply, key, where, kinds)

    async def encode(self, texts: list[str]) -> list[list[int]]:
        res = await asyncio.gather(*(self._post("/tokenize", {"model": self.model, "prompt": t,
                                                              "add_special_tokens": False}, "tokens", list)
                                     for t in texts))
        return [list(r) for r in res]

    async def decode(self, ids: list[list[int]]) -> list[str]:
        return list(await asyncio.gather(*(self._post("/detokenize", {"model": self.model,
                                                                      "tokens": list(map(int, x))}, "prompt", str)
                                           for x in ids)))

    async def overhead(self, endpoint: str) -> int:
        bare = await self._post("/tokenize", {"model": self.model, "prompt": "hello", "add_special_tokens": False},
                                "count", int)
        if endpoint == "chat":
            full = await self._post("/tokenize", {"model": self.model, "add_generation_prompt": True,
                                                  "messages": [{"role": "user", "content": "hello"}]}, "count", int)
        else:
            full = await self._post("/tokenize", {"model": self.model, "prompt": "hello",
                                                  "add_special_tokens": True}, "count", int)
        return full - bare

    async def allowed_ids(self) -> np.ndarray:
        rng = np.random.default_rng(12345)
        text = " ".join(rng.choice(_SEED_WORDS, size=4000))
        (ids,) = await self.encode([text])
        return np.unique(np.asarray(ids, dtype=np.int64))


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    """vLLM's range: uniform integers in [floor(L(1-r)), ceil(L(1+r))]; r=0 gives exactly L."""
    if not 0.0 <= range_ratio < 1.0:
        raise Glm5Fp4Error(f"--range-ratio {range_ratio} must be in [0, 1)")
    lo = max(1, math.floor(length * (1 - range_ratio)))
    hi = max(lo, math.ceil(length * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n)


_CUT_OFFSETS = (0, -1, 1, -2, 2, -3, 3, -4, 4, -6, 6)


async def fit_to_length(tok: Tokenizer, targets: list[int], allowed: np.ndarray,
                        rng: np.random.Generator) -> tuple[list[str], list[int]]:
    """Random ids -> text whose re-encoding has exactly `targets[i]` tokens.

    Decode -> re-encode gives a canonical id sequence; cutting it at `target` usually re-encodes
    to `target` tokens, but a cut inside a word can merge differently, so neighbouring cut points
    are tried too. Sequences that come out short are topped up with random ids and re-canonicalised.
    Batched per round so a remote tokenizer sees few round trips.
    """
    n = len(targets)
    slack = [max(4, t // 16) for t in targets]
    canon: list[list[int] | None] = [None] * n
    raw: list[list[int]] = [rng.choice(allowed, size=t + s).tolist() for t, s in zip(targets, slack)]
    tries = [0] * n
    texts = [""] * n
    best = [10**9] * n  # smallest |mismatch| seen, with its text, in case nothing fits exactly
    pending = set(range(n))
    for _round in range(MAX_RETRY * 3):
        if not pending:
            break
        order = sorted(pending)
        to_canon = [i for i in order if canon[i] is None]
        if to_canon:
            encoded = await tok.encode(await tok.decode([raw[i] for i in to_canon]))
            for i, ids in zip(to_canon, encoded):
                if len(ids) < targets[i]:  # came out short: top up and canonicalise again
                    raw[i] = ids + rng.choice(allowed, size=targets[i] - len(ids) + slack[i]).tolist()
                else:
                    canon[i] = ids
        ready = [i for i in order if canon[i] is not None]
        if not ready:
            continue
        cuts = []
        for i in ready:
            cuts.append(targets[i] + _CUT_OFFSETS[tries[i]])
        decoded = await tok.decode([canon[i][: max(1, c)] for i, c in zip(ready, cuts)])  # type: ignore[index]
        encoded = await tok.encode(decoded)
        for i, text, ids in zip(ready, decoded, encoded):
            miss = len(ids) - targets[i]
            if abs(miss) < abs(best[i]):
                best[i], texts[i] = miss, text
            if miss == 0:
                pending.discard(i)
                continue
            tries[i] += 1
            if tries[i] == len(_CUT_OFFSETS):  # no cut point works: start this prompt afresh
                tries[i] = 0
                canon[i] = None
                raw[i] = rng.choice(allowed, size=targets[i] + slack[i]).tolist()
    return texts, [0 if i not in pending else best[i] for i in range(n)]


async def build_prompts(tok: Tokenizer, n: int, input_len: int, output_len: int, *, endpoint: str = "completions",
                        range_ratio: float = 0.0, seed: int = 0, token_ids: bool = False) -> list[Prompt]:
    """`n` prompts whose server-side length is `input_len` (+- range_ratio), deterministic in `seed`."""
    if n < 1:
        raise Glm5Fp4Error(f"--num-prompts {n} must be >= 1")
    if input_len < 1 or output_len < 1:
        raise Glm5Fp4Error(f"--input-len {input_len} and --output-len {output_len} must be >= 1")
    if token_ids and endpoint == "chat":
        raise Glm5Fp4Error("--prompt-format ids works only with --endpoint completions")
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, n, input_len, range_ratio)
    out_lens = sample_lengths(rng, n, output_len, range_ratio)
    allowed = await tok.allowed_ids()
    if allowed.size == 0:
        raise Glm5Fp4Error(f"tokenizer {tok.name}: no usable (non-special) token ids")
    if token_ids:  # the server counts token-id prompts as given: no BOS, no re-encoding drift
        return [Prompt(rng.choice(allowed, size=int(L)).tolist(), int(L), int(o)) for L, o in zip(in_lens, out_lens)]
    overhead = await tok.overhead(endpoint)
    targets = [int(L) - overhead for L in in_lens]
    if min(targets) < 1:
        raise Glm5Fp4Error(f"--input-len {input_len} leaves no room for a prompt after the {overhead} tokens "
                           f"the server adds on {endpoint}")
    texts, mismatch = await fit_to_length(tok, targets, allowed, rng)
    return [Prompt(text, t + overhead + m, int(o), m) for text, t, m, o in zip(texts, targets, mismatch, out_lens)]
