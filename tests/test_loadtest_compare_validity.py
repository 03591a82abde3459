"""`compare` refuses verdicts that would mislead: runs whose request bodies or arrival schedules differ, runs whose
outputs came out shorter than the fixed length they asked for, and throughput intervals that Little's law does not
give in an open loop.

Every input is built here, in tmp_path, in the shapes `glm5-fp4 loadtest` writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from glm5_fp4.cli import main as cli_main
from glm5_fp4.loadtest.compare import compare_files
from loadtest_rows import make_rows

META = {"endpoint": "completions", "input_len": 16, "output_len": 10, "range_ratio": 0.0, "prompt_format": "ids",
        "ignore_eos": True, "min_tokens": True, "extra_body": None}

def _write_run(folder: Path, name: str, rows: list[dict] | None, *, meta: dict | None = None, **summary) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    res = {"date": name, "label": name, "model_id": "m", "num_prompts": 40, "request_rate": "inf", "burstiness": 1.0,
           "max_concurrency": 4, "completed": 40, "failed": 0, "short_outputs": 0, "metadata": {**META, **(meta or {})}}
    if rows:
        e2el = float(np.mean([r["e2el_ms"] for r in rows]))
        res.update(completed=len(rows), requests_file=f"{name}.requests.jsonl",
                   mean_ttft_ms=float(np.mean([r["ttft_ms"] for r in rows])),
                   mean_tpot_ms=float(np.mean([r["tpot_ms"] for r in rows])), mean_e2el_ms=e2el,
                   output_throughput=4 * 10 / e2el * 1e3, request_throughput=4 / e2el * 1e3)
        (folder / f"{name}.requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res.update(summary)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(res))
    return str(path)

def _by_key(rows):
    return {r.key: r for r in rows}

# --- settings that change what is sent, or when ------------------------------------------------------------

@pytest.mark.parametrize("meta,summary,needle", [
    (dict(ignore_eos=False), {}, "ignore_eos: True vs False"),
    (dict(min_tokens=False), {}, "min_tokens: True vs False"),
    (dict(ignore_eos=False, min_tokens=False), {}, "ignore_eos: True vs False"),
    (dict(extra_body={"temperature": 0.7}), {}, "extra_body"),
    ({}, dict(request_rate=20.0, burstiness=0.1), "burstiness: 1.0 vs 0.1"),
])
def test_request_settings_and_burstiness_make_runs_not_comparable(tmp_path, capsys, meta, summary, needle) -> None:
    """Before: CONFIG_KEYS / CONFIG_META left these out, and such pairs got verdicts ('+391% better'), exit 0."""
    rate = summary.get("request_rate", "inf")
    a = _write_run(tmp_path, "a", None, request_rate=rate, output_throughput=100.0, mean_tpot_ms=20.0)
    b = _write_run(tmp_path, "b", None, meta=meta, **{"output_throughput": 50.0, "mean_tpot_ms": 40.0, **summary})
    _, tables, md = compare_files([a, b])
    assert {r.verdict for r in tables[0]} == {"not comparable"}
    assert needle in md and "Not comparable" in md
    assert cli_main(["compare", a, b]) == 1
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err

def test_a_different_burstiness_in_a_closed_loop_changes_nothing(tmp_path) -> None:
    """Burstiness shapes the gaps between arrivals; a closed loop has none, so it is no difference there."""
    a = _write_run(tmp_path, "a", None, output_throughput=100.0)
    b = _write_run(tmp_path, "b", None, output_throughput=90.0, burstiness=0.1)
    _, tables, md = compare_files([a, b])
    assert "Not comparable" not in md and _by_key(tables[0])["output_throughput"].verdict != "not comparable"

def test_results_without_the_new_fields_compare_as_before(tmp_path) -> None:
    """Files written before extra_body was recorded have no such key; they sent none unless told, like a run today
    without --extra-body, which records null. Missing on both sides is no difference, as for every config key."""
    old_meta = {k: v for k, v in META.items() if k != "extra_body"}
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"model_id": "m", "num_prompts": 40, "request_rate": "inf", "burstiness": 1.0,
                               "max_concurrency": 4, "completed": 40, "failed": 0, "output_throughput": 100.0,
                               "metadata": old_meta}))
    new = _write_run(tmp_path, "new", None, output_throughput=90.0)
    _, _, md = compare_files([str(old), new])
    assert "Not comparable" not in md
    vllm = tmp_path / "vllm.json"  # `vllm bench serve` writes none of the metadata
    vllm.write_text(json.dumps({"model_id": "m", "num_prompts": 40, "request_rate": "inf", "burstiness": 1.0,
                                "max_concurrency": 4, "completed": 40, "failed": 0, "output_throughput": 100.0}))
    vllm2 = tmp_path / "vllm2.json"
    vllm2.write_text(json.dumps({**json.loads(vllm.read_text()), "output_throughput": 95.0}))
    _, _, md = compare_files([str(vllm), str(vllm2)])
    assert "Not comparable" not in md

# --- outputs shorter than the fixed length asked for -------------------------------------------------------

def test_short_outputs_under_ignore_eos_make_a_run_not_comparable(tmp_path, capsys) -> None:
    """A server that stops at 4 of 10 tokens despite ignore_eos ran another workload: it was called +681% better."""
    a = _write_run(tmp_path, "good", None, output_throughput=100.0, mean_tpot_ms=20.0)
    b = _write_run(tmp_path, "eosbug", None, output_throughput=780.0, mean_tpot_ms=5.0, short_outputs=40)
    _, tables, md = compare_files([a, b])
    assert {r.verdict for r in tables[0]} == {"not comparable"}
    assert "eosbug.json has 40 of 40 completed requests shorter than asked" in md, md
    assert cli_main(["compare", a, b]) == 1
    assert "shorter than asked" in capsys.readouterr().err
    for meta in (dict(ignore_eos=True, min_tokens=False), dict(ignore_eos=False, min_tokens=True)):
        c = _write_run(tmp_path, "half", None, meta=meta, output_throughput=50.0, short_outputs=3)
        d = _write_run(tmp_path, "half2", None, meta=meta, output_throughput=60.0)
        assert "shorter than asked" in compare_files([d, c])[2]

def test_short_outputs_without_a_fixed_length_are_no_reason(tmp_path) -> None:
    """With --no-ignore-eos --no-min-tokens the model stops where it likes: short outputs are the workload."""
    free = dict(ignore_eos=False, min_tokens=False)
    a = _write_run(tmp_path, "a", None, meta=free, output_throughput=100.0, short_outputs=12)
    b = _write_run(tmp_path, "b", None, meta=free, output_throughput=90.0, short_outputs=30)
    _, _, md = compare_files([a, b])
    assert "Not comparable" not in md

def test_a_malformed_short_outputs_field_is_named(tmp_path, capsys) -> None:
    a = _write_run(tmp_path, "a", None, output_throughput=100.0)
    b = _write_run(tmp_path, "b", None, output_throughput=90.0, short_outputs="many")
    assert cli_main(["compare", a, b]) == 1
    err = capsys.readouterr().err
    assert "'short_outputs'" in err and "Traceback" not in err

# --- open loop: throughput follows the arrivals -----------------------------------------------------------

def test_open_loop_throughput_gets_no_littles_law_interval(tmp_path, capsys) -> None:
    """At a finite --request-rate throughput is set by the arrival schedule, not by E2EL: two seeds were called
    '+32.5% better'. Latencies keep their bootstrap verdicts; the output says why throughput has none."""
    a = _write_run(tmp_path / "a", "c", make_rows(40, 10.0, 0), request_rate=8.0)
    b = _write_run(tmp_path / "b", "c", make_rows(40, 15.0, 1), request_rate=8.0)
    _, tables, md = compare_files([a, b], n_boot=100)
    rows = _by_key(tables[0])
    for key in ("output_throughput", "request_throughput"):
        assert rows[key].ci is None and rows[key].verdict == "no noise estimate", rows[key]
    assert rows["mean_tpot_ms"].verdict == "worse"
    assert "open loop" in md and "arrival" in md
    assert cli_main(["compare", a, b, "--bootstrap", "100"]) == 0
    assert "open loop" in capsys.readouterr().out

def test_closed_loop_throughput_keeps_its_littles_law_interval(tmp_path) -> None:
    a = _write_run(tmp_path / "a", "c", make_rows(40, 10.0, 0))
    b = _write_run(tmp_path / "b", "c", make_rows(40, 15.0, 1))
    _, tables, md = compare_files([a, b], n_boot=100)
    rows = _by_key(tables[0])
    assert rows["output_throughput"].method == "bootstrap~" and rows["output_throughput"].verdict == "worse"
    assert "open loop" not in md
