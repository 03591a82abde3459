"""Greedy continuations and teacher-forced logprobs from vLLM servers, and their comparison.

``collect(url, model, prompts, n)``: each server's own greedy continuation of every prompt (token ids), and the
logprobs it gives a *reference* continuation when that is fed back as prompt (``prompt_logprobs``): the same
tokens scored by every server, so two servers compare position by position whatever they would have
generated. ``compare(ref, other)`` reduces that to |Δ logprob| (mean, max), top-1 agreement at decisive
positions, and where the greedy continuations first part. Bounds: ``glm5_fp4.tolerances``.

Standard library only on the client side (urllib): works before the openai package is installed.
"""

from __future__ import annotations

import json
import math
import urllib.request
from dataclasses import asdict, dataclass

from glm5_fp4.tolerances import SERVED_DECISIVE_MARGIN, served_logprob_bound

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


def collect(url: str, prompts: list[list[int]], n: int, reference: list[list[int]] | None = None) -> dict:
    """Greedy continuations; teacher-forced scores of ``reference`` (or of its own continuations if None)."""
    model = model_name(url)
    own = [greedy(url, model, p, n) for p in prompts]
    ref = reference if reference is not None else own
    return {"greedy": own, "forced": [forced(url, model, p, c) for p, c in zip(prompts, ref)]}


@dataclass
class Comparison:
    positions: int
    mean_abs_dlogprob: float
    max_abs_dlogprob: float
    decisive_positions: int
    decisive_disagreements: int  # decisive positions where the other's top-1 is not the reference's token
    top1_agreement: float  # over all positions
    greedy_equal_prefix: list[int]  # per prompt: tokens equal before the first difference
    greedy_divergences_at_decisive: int  # first differences at positions the reference was sure of
    bound: dict
    ok: bool
    why: list[str]

    def to_dict(self) -> dict:
        return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def compare(ref: dict, other: dict, stock: dict | None = None) -> Comparison:
    """``other`` against ``ref`` (both from :func:`collect` with ``ref``'s greedy continuations forced)."""
    diffs, decisive, disagree, agree, positions = [], 0, 0, 0, 0
    margins: list[list[float]] = []
    for ref_seq, oth_seq in zip(ref["forced"], other["forced"]):
        row = []
        for r, o in zip(ref_seq, oth_seq):
            if r["token"] != o["token"]:
                raise ValueError("the two collections did not score the same tokens (pass reference= to collect)")
            positions += 1
            diffs.append(abs(r["logprob"] - o["logprob"]))
            margin = r["top"][0][1] - r["top"][1][1] if len(r["top"]) > 1 else math.inf
            row.append(margin)
            other_top1 = o["top"][0][0]
            agree += other_top1 == r["token"]
            if margin > SERVED_DECISIVE_MARGIN:
                decisive += 1
                disagree += other_top1 != r["token"]
        margins.append(row)
    prefixes, at_decisive = [], 0
    for i, (a, b) in enumerate(zip(ref["greedy"], other["greedy"])):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(k)
        if k < min(len(a), len(b)) and k < len(margins[i]) and margins[i][k] > SERVED_DECISIVE_MARGIN:
            at_decisive += 1
    bound = served_logprob_bound(stock)
    mean = sum(diffs) / len(diffs) if diffs else math.nan
    worst = max(diffs) if diffs else math.nan
    why = []
    if not diffs:
        why.append("no positions compared")
    if mean > bound["mean"]:
        why.append(f"mean |Δ logprob| {mean:.4f} > {bound['mean']:.4f}")
    if worst > bound["max"]:
        why.append(f"max |Δ logprob| {worst:.4f} > {bound['max']:.4f}")
    if disagree:
        why.append(f"top-1 differs at {disagree} of {decisive} decisive positions")
    if at_decisive:
        why.append(f"{at_decisive} greedy continuation(s) part where the reference was decisive")
    return Comparison(positions, mean, worst, decisive, disagree, agree / positions if positions else math.nan,
                      prefixes, at_decisive, bound, not why, why)


def self_consistency(ref: dict) -> list[str]:
    """The reference's forced top-1 must be its own greedy token (prompt_logprobs read correctly)."""
    bad = []
    for i, seq in enumerate(ref["forced"]):
        for j, pos in enumerate(seq):
            if pos["top"][0][0] != pos["token"] and pos["top"][0][1] - pos["logprob"] > 1e-3:
                bad.append(f"prompt {i} position {j}: forced top-1 {pos['top'][0][0]} != greedy {pos['token']}")
    return bad
