"""Per-request rows as the load tester writes them, for compare's tests: n closed-loop requests of 10 output tokens
with a given TPOT (normal, 10 % spread) and a 20-30 ms TTFT, seeded."""

from __future__ import annotations

import numpy as np


def make_rows(n: int, tpot: float, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        ttft = float(rng.uniform(20, 30))
        itl = [float(x) for x in rng.normal(tpot, tpot / 10, 9)]
        rows.append({"index": i, "status": "ok", "error_kind": None, "error": None, "prompt_len": 16,
                     "requested_output_len": 10, "start_s": i * 0.01, "output_tokens": 10, "streamed_tokens": 10,
                     "num_chunks": 10, "ttft_ms": ttft, "e2el_ms": ttft + sum(itl), "tpot_ms": sum(itl) / 9,
                     "itl_ms": itl})
    return rows
