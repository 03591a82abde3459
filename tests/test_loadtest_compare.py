"""`compare` on real result files (per-request noise) and on synthetic repeat runs (run-to-run noise)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from glm5_fp4.cli import main as cli_main
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.loadtest.compare import compare_files
from glm5_fp4.loadtest.fake_server import spawn_fake_server
from glm5_fp4.loadtest.runner import LoadTestConfig, run_loadtest


def _run(tmp_path, name: str, itl_ms: str) -> str:
    with spawn_fake_server("--ttft-ms", "20,30", "--itl-ms", itl_ms) as srv:
        res = run_loadtest(LoadTestConfig(
            url=srv.url, model="fake-model", concurrency=4, num_prompts=24, input_len=16, output_len=10,
            num_warmups=0, prompt_format="ids", progress=False, telemetry=False, result_dir=str(tmp_path),
            result_filename=f"{name}.json", label=name))
    return res["result_file"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("cmp")
    return {"fast": _run(d, "fast", "10"), "slow": _run(d, "slow", "15,13")}


def _by_key(rows):
    return {r.key: r for r in rows}


def test_slower_server_is_flagged_worse(runs, tmp_path) -> None:
    groups, tables, md = compare_files([runs["fast"], runs["slow"]], n_boot=200)
    rows = _by_key(tables[0])
    for key in ("mean_tpot_ms", "median_tpot_ms", "mean_e2el_ms", "mean_itl_ms"):
        assert rows[key].verdict == "worse", (key, rows[key])
        assert rows[key].ci[0] > 0  # interval strictly above 0
    for key in ("output_throughput", "request_throughput"):
        assert rows[key].verdict == "worse", (key, rows[key])
    # TTFT is the same schedule on both servers: the difference must be called noise, not a change
    assert rows["mean_ttft_ms"].verdict == "within noise", rows["mean_ttft_ms"]
    assert rows["mean_tpot_ms"].rel == pytest.approx(rows["mean_tpot_ms"].delta / rows["mean_tpot_ms"].base)
    assert "### slow vs fast" in md and "| mean_tpot_ms |" in md


def test_a_run_compared_with_itself_shows_no_change(runs) -> None:
    _, tables, _ = compare_files([runs["fast"], runs["fast"]], n_boot=100)
    for r in tables[0]:
        if r.delta is not None:
            assert r.delta == 0 and r.verdict in ("same", "within noise"), r


def test_compare_cli_writes_markdown(runs, tmp_path, capsys) -> None:
    out = tmp_path / "cmp.md"
    assert cli_main(["compare", runs["fast"], runs["slow"], "--out", str(out), "--bootstrap", "100"]) == 0
    text = out.read_text()
    assert text.startswith("### slow vs fast")
    assert "| Metric | fast | slow |" in text and "Significant:" in text
    assert "mean_tpot_ms" in capsys.readouterr().out
    # what `improvements new --from` accepts is what this writes
    from glm5_fp4.loadtest.compare import is_compare_block

    assert is_compare_block(text)


def _summary(path, **values):
    base = {"completed": 100, "failed": 0, "model_id": "m", "max_concurrency": 8, "request_rate": "inf",
            "num_prompts": 100, "metadata": {"endpoint": "completions", "input_len": 128, "output_len": 64}}
    base.update(values)
    path.write_text(json.dumps(base))
    return str(path)


def test_repeat_runs_use_run_to_run_spread(tmp_path) -> None:
    a = [_summary(tmp_path / f"a{i}.json", output_throughput=v, mean_tpot_ms=t)
         for i, (v, t) in enumerate([(100, 20.0), (102, 20.4), (98, 19.6)])]
    b = [_summary(tmp_path / f"b{i}.json", output_throughput=v, mean_tpot_ms=t)
         for i, (v, t) in enumerate([(110, 20.5), (112, 19.5), (108, 20.3)])]
    _, tables, md = compare_files([",".join(a), ",".join(b)])
    rows = _by_key(tables[0])
    thr = rows["output_throughput"]
    # Welch interval by hand: equal variances 4 and n=3 -> df=4, t=2.776
    se = math.sqrt(np.var([100, 102, 98], ddof=1) / 3 + np.var([110, 112, 108], ddof=1) / 3)
    assert thr.delta == pytest.approx(10.0)
    assert thr.ci == pytest.approx((10 - 2.776 * se, 10 + 2.776 * se), rel=1e-3)
    assert thr.verdict == "better" and thr.method == "repeats 3v3"
    assert rows["mean_tpot_ms"].verdict == "within noise"
    assert "repeats 3v3" in md


def test_single_runs_without_request_files_get_no_verdict(tmp_path) -> None:
    a = _summary(tmp_path / "a.json", output_throughput=100.0)
    b = _summary(tmp_path / "b.json", output_throughput=90.0)
    _, tables, md = compare_files([a, b])
    assert _by_key(tables[0])["output_throughput"].verdict == "no noise estimate"


@pytest.mark.parametrize("change,needle", [
    (dict(max_concurrency=16), "workloads differ: max_concurrency: 8 vs 16"),
    (dict(metadata={"endpoint": "completions", "input_len": 1024, "output_len": 64}), "input_len: 128 vs 1024"),
    (dict(failed=3, completed=97), "failed requests differ: 0 vs 3"),
    (dict(run_failed=True, failure_reason="the run stopped early (run timeout)", abort_reason="run timeout"),
     "stopped early (run timeout)"),
])
def test_runs_that_are_not_comparable_get_no_verdicts(tmp_path, capsys, change, needle) -> None:
    a = _summary(tmp_path / "a.json", output_throughput=100.0, mean_tpot_ms=20.0)
    b = _summary(tmp_path / "b.json", **{"output_throughput": 50.0, "mean_tpot_ms": 40.0, **change})
    _, tables, md = compare_files([a, b])
    assert {r.verdict for r in tables[0]} == {"not comparable"}  # every row, counts included
    assert _by_key(tables[0])["output_throughput"].delta == pytest.approx(-50.0)  # the numbers are still shown
    assert needle in md and "Not comparable" in md.splitlines()[2]
    assert "Significant:" not in md
    assert cli_main(["compare", a, b]) == 1
    out = capsys.readouterr()
    assert needle in out.err and "better" not in out.out and "worse" not in out.out


def test_column_labels_are_short_and_unique(tmp_path, capsys) -> None:
    stem = "c512-GLM-5-NVFP4-tp8-mtp-20261201"
    a = _summary(tmp_path / f"{stem}-101010.json", output_throughput=100.0)
    b = _summary(tmp_path / f"{stem}-101532.json", output_throughput=90.0)
    groups, _, md = compare_files([a, b])
    labels = [g.label for g in groups]
    assert labels == ["101010", "101532"]
    assert f"`{a}`" in md  # the legend names the files
    assert cli_main(["compare", a, b]) == 0
    out = capsys.readouterr().out
    assert "101010" in out and "101532" in out
    for d in ("x", "y"):
        (tmp_path / d).mkdir()
    same = compare_files([_summary(tmp_path / "x" / "run.json", output_throughput=1.0, label="demo"),
                          _summary(tmp_path / "y" / "run.json", output_throughput=2.0, label="demo")])[0]
    assert len({g.label for g in same}) == 2 and all(len(g.label) <= 20 for g in same)


def test_compare_input_errors(tmp_path) -> None:
    with pytest.raises(Glm5Fp4Error, match="at least two"):
        compare_files([str(tmp_path / "x.json")])
    with pytest.raises(Glm5Fp4Error, match="does not exist"):
        compare_files([str(tmp_path / "x.json"), str(tmp_path / "y.json")])
    (tmp_path / "bad.json").write_text('{"hello": 1}')
    good = _summary(tmp_path / "g.json", output_throughput=1.0)
    with pytest.raises(Glm5Fp4Error, match="not a load-test summary"):
        compare_files([good, str(tmp_path / "bad.json")])


def test_vllm_bench_results_with_detailed_arrays(tmp_path) -> None:
    """`vllm bench serve --save-detailed` files carry per-request arrays inline: they get bootstrap noise."""
    rng = np.random.default_rng(0)

    def vllm_result(path, tpot_s):
        n, out = 64, 20
        ttfts = rng.uniform(0.1, 0.2, n)
        itls = [list(rng.normal(tpot_s, tpot_s / 20, out - 1)) for _ in range(n)]
        lat = [t + sum(i) for t, i in zip(ttfts, itls)]
        tpots = [(la - t) / (out - 1) for la, t in zip(lat, ttfts)]
        res = {"completed": n, "failed": 0, "model_id": "m", "max_concurrency": 8, "request_rate": "inf",
               "num_prompts": n, "output_throughput": n * out / 10.0, "mean_ttft_ms": float(np.mean(ttfts) * 1e3),
               "mean_tpot_ms": float(np.mean(tpots) * 1e3), "p99_tpot_ms": float(np.percentile(tpots, 99) * 1e3),
               "ttfts": list(ttfts), "itls": itls, "latencies": lat, "output_lens": [out] * n, "errors": [""] * n}
        path.write_text(json.dumps(res))
        return str(path)

    a = vllm_result(tmp_path / "va.json", 0.020)
    b = vllm_result(tmp_path / "vb.json", 0.025)
    _, tables, _ = compare_files([a, b], n_boot=200)
    rows = _by_key(tables[0])
    assert rows["mean_tpot_ms"].method == "bootstrap" and rows["mean_tpot_ms"].verdict == "worse"
    assert rows["mean_ttft_ms"].verdict == "within noise"


def test_stalls_are_called_out_beside_the_verdicts(runs, tmp_path) -> None:
    base, other = runs["fast"], runs["slow"]
    data = json.loads(Path(other).read_text())
    data.update(stalls=3, stalled_s=4.5, longest_stall_ms=1800.0)
    stalled = tmp_path / "stalled.json"
    stalled.write_text(json.dumps(data))
    for suffix in (".requests.jsonl", ".requests.jsonl.gz"):  # keep its per-request file beside it
        src = Path(other).with_name(Path(other).stem + suffix)
        if src.exists():
            stalled.with_name("stalled" + suffix).write_bytes(src.read_bytes())
    _, _, md = compare_files([str(base), f"stalled={stalled}"])
    assert "**Stalls**" in md and "stalled 3 (4.50 s)" in md and "--num-warmups" in md
    _, _, md = compare_files([str(base), str(base)])
    assert "**Stalls**" not in md


def test_the_default_warm_up_is_one_full_wave() -> None:
    from glm5_fp4.loadtest.runner import LoadTestConfig

    assert LoadTestConfig(url="http://127.0.0.1:1", concurrency=512).num_warmups == 512
    assert LoadTestConfig(url="http://127.0.0.1:1", concurrency=4, num_warmups=0).num_warmups == 0


def test_fractional_welch_df_uses_a_t_quantile_no_smaller_than_the_true_one(tmp_path) -> None:
    """2 runs a side with unequal spreads: Welch df 1.02, true t95 ~12.1. The table lookup rounded df up to 2 (t 4.303)
    and called a +22.5 tok/s difference whose interval holds 0 "better". Fractional df are now interpolated in 1/df
    between listed ones (the quantile is convex in 1/df: the chord lies above it, an interval never too narrow)."""
    from glm5_fp4.loadtest.compare import _t95

    a = [_summary(tmp_path / f"a{i}.json", output_throughput=v) for i, v in enumerate([100.0, 110.0])]
    b = [_summary(tmp_path / f"b{i}.json", output_throughput=v) for i, v in enumerate([127.0, 128.0])]
    _, tables, _ = compare_files([",".join(a), ",".join(b)])
    thr = _by_key(tables[0])["output_throughput"]
    assert thr.ci[0] < 0 < thr.ci[1] and thr.verdict == "within noise", thr
    # true 97.5 % quantiles of Student's t at fractional df (numerical integration of its density): the lookup may
    # only be wider, by little (the table's three decimals aside)
    for df, true in [(1.02, 12.12), (1.5, 6.02), (2.5, 3.575), (11.0, 2.201), (45.0, 2.014), (200.0, 1.972)]:
        assert true - 0.002 <= _t95(df) <= true * 1.2, (df, _t95(df))
    dfs = np.linspace(1, 300, 2000)
    assert all(x >= y for x, y in zip(map(_t95, dfs), map(_t95, dfs[1:])))  # never rises with df


def test_a_metric_null_in_the_baseline_is_still_listed(tmp_path) -> None:
    """A statistic with no sample is null (None); a null in the baseline made the row vanish, hiding the candidate's
    stalls. Rows come from both sides; a null side is 'missing'."""
    a = _summary(tmp_path / "a.json", output_throughput=100.0, stalls=None, longest_stall_ms=None, mean_tpot_ms=None)
    b = _summary(tmp_path / "b.json", output_throughput=100.0, stalls=4, longest_stall_ms=900.0, mean_tpot_ms=20.0)
    for specs in ([a, b], [b, a]):
        _, tables, _ = compare_files(specs)
        rows = _by_key(tables[0])
        for key in ("stalls", "longest_stall_ms", "mean_tpot_ms"):
            assert rows[key].verdict == "missing", (specs, key)


def test_a_metric_no_run_measured_is_no_row() -> None:
    """request_goodput is null without --goodput on both sides: no row at all, not a 'missing' one in every table."""
    from glm5_fp4.loadtest.compare import metric_keys

    keys = metric_keys({"completed": 4, "request_goodput": None, "output_throughput": 1.0, "mean_tpot_ms": None},
                       {"completed": 4, "request_goodput": None, "output_throughput": 2.0, "mean_tpot_ms": None})
    assert "request_goodput" not in keys and "mean_tpot_ms" not in keys and "output_throughput" in keys


def test_goodput_gets_no_interval_from_littles_law(runs, tmp_path) -> None:
    """Goodput counts requests on either side of an SLO: its noise is not the mean E2EL's. Scaled by Little's law it
    got a +-0.1 % interval, and two runs of one server 26 % apart in goodput (pure noise) read 'better'."""
    import shutil

    src = Path(runs["fast"])
    summary = json.loads(src.read_text())
    reqs = src.parent / summary["requests_file"]
    for name, goodput in (("ga", 20.0), ("gb", 25.2)):
        shutil.copy(reqs, tmp_path / f"{name}.requests.jsonl")
        (tmp_path / f"{name}.json").write_text(json.dumps({
            **summary, "requests_file": f"{name}.requests.jsonl", "request_goodput": goodput,
            "metadata": {**summary["metadata"], "goodput_slo_ms": {"e2el": 126.0}}}))
    _, tables, _ = compare_files([str(tmp_path / "ga.json"), str(tmp_path / "gb.json")], n_boot=100)
    row = _by_key(tables[0])["request_goodput"]
    assert row.verdict not in ("better", "worse") and row.ci is None, row
    assert _by_key(tables[0])["request_throughput"].ci is not None  # the other throughputs keep theirs


@pytest.mark.parametrize("slo_b", [{"ttft": 51.3}, None])
def test_runs_with_different_goodput_slos_compare_all_but_goodput(tmp_path, slo_b) -> None:
    """The SLO defines goodput, not the workload: other goodput rows are not comparable, every other row is (a
    baseline without --goodput made every metric 'not comparable' against a candidate with one)."""
    meta = {"endpoint": "completions", "input_len": 128, "output_len": 64}
    a = _summary(tmp_path / "a.json", request_goodput=31.4, output_throughput=100.0,
                 metadata={**meta, "goodput_slo_ms": {"ttft": 1000.0}})
    b = _summary(tmp_path / "b.json", request_goodput=20.4, output_throughput=90.0,
                 metadata={**meta, "goodput_slo_ms": slo_b})
    _, tables, md = compare_files([a, b])
    rows = _by_key(tables[0])
    assert rows["request_goodput"].verdict == "not comparable" and "goodput SLOs differ" in md
    assert rows["output_throughput"].verdict != "not comparable"


def test_repeat_groups_with_different_failure_counts_are_not_comparable(tmp_path) -> None:
    """The failed counts were compared as sets: [0, 2, 2] and [0, 0, 2] passed as alike."""
    def group(name, fails):
        return ",".join(_summary(tmp_path / f"{name}{i}.json", failed=f, completed=100 - f, output_throughput=100.0 + i)
                        for i, f in enumerate(fails))

    _, tables, md = compare_files([group("a", [0, 2, 2]), group("b", [0, 0, 2])])
    assert {r.verdict for r in tables[0]} == {"not comparable"} and "failed requests differ" in md
    _, tables, _ = compare_files([group("c", [0, 0, 0]), group("d", [0, 0])])  # one failure count on both sides
    assert "not comparable" not in {r.verdict for r in tables[0]}
