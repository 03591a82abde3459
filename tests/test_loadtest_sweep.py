"""A concurrency sweep through the CLI: one result per level, a table, and two PNG curves."""

from __future__ import annotations

import json

from glm5_fp4.cli import main as cli_main
from glm5_fp4.loadtest.fake_server import spawn_fake_server


def test_sweep_writes_results_and_plots(tmp_path) -> None:
    levels = [1, 2, 4]
    # 3 ms of extra gap per active stream: TPOT must grow with concurrency
    with spawn_fake_server("--ttft-ms", "10", "--itl-ms", "4", "--itl-slope-ms", "3") as srv:
        rc = cli_main(["loadtest", "--url", srv.url, "--concurrency", ",".join(map(str, levels)),
                       "--num-prompts", "8", "--input-len", "16", "--output-len", "6", "--num-warmups", "1",
                       "--prompt-format", "ids", "--result-dir", str(tmp_path), "--no-progress", "--no-telemetry",
                       "--num-gpus", "2"])
    assert rc == 0
    for c in levels:
        summary = json.loads((tmp_path / f"c{c}.json").read_text())
        assert summary["max_concurrency"] == c and summary["completed"] == 8
        assert len((tmp_path / f"c{c}.requests.jsonl").read_text().splitlines()) == 8
        assert (tmp_path / f"c{c}.md").read_text().startswith("### Load test")
        assert summary["output_throughput_per_gpu"] == summary["output_throughput"] / 2
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [s["max_concurrency"] for s in sweep] == levels
    tpot = [s["mean_tpot_ms"] for s in sweep]
    assert tpot[0] < tpot[1] < tpot[2], tpot
    table = (tmp_path / "sweep.md").read_text().splitlines()
    assert table[0].startswith("| concurrency |") and len(table) == 2 + len(levels)
    for png in ("sweep_throughput_tpot.png", "sweep_pareto.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png


def _sweep(url: str, out, levels, *extra: str) -> int:
    return cli_main(["loadtest", "--url", url, "--model", "fake-model", "--concurrency", ",".join(map(str, levels)),
                     "--num-prompts", "4", "--input-len", "8", "--output-len", "6", "--num-warmups", "1",
                     "--prompt-format", "ids", "--result-dir", str(out), "--no-progress", "--no-telemetry",
                     "--timeout", "30", *extra])


def test_a_level_that_cannot_run_ends_the_sweep_with_its_files_written(tmp_path, capsys) -> None:
    """The server dies during the second level (the usual way a sweep finds its limit): the levels that ran keep
    their files, the sweep's table, JSON and plots are written from them, the level that could not run is named
    with its reason, and the exit code says the sweep failed."""
    # each level sends ~50 chunks (a warm-up and 4 requests of 6 tokens, with the role and usage chunks): the server
    # exits after 80, inside level 2, and level 4 finds nothing to connect to
    with spawn_fake_server("--ttft-ms", "5", "--itl-ms", "5", "--die-after-chunks", "80") as srv:
        rc = _sweep(srv.url, tmp_path, [1, 2, 4])
    err = capsys.readouterr().err
    assert rc == 1
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [s["max_concurrency"] for s in sweep] == [1, 2, 4]
    assert sweep[0]["completed"] == 4 and not sweep[0].get("run_failed")
    assert sweep[1]["run_failed"] and 0 < sweep[1]["completed"] < 4, sweep[1]  # the server died inside it
    assert sweep[2]["run_failed"] and sweep[2]["failure_reason"].startswith("the level could not run"), sweep[2]
    assert "run failed at concurrency 2" in err and "run failed at concurrency 4" in err, err
    md = (tmp_path / "sweep.md").read_text()
    assert len([ln for ln in md.splitlines() if ln.startswith("| ") and ln[2].isdigit()]) == 3, md
    assert "- concurrency 4: the level could not run" in md, md
    for png in ("sweep_throughput_tpot.png", "sweep_pareto.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_a_sweep_without_tpot_still_plots(tmp_path) -> None:
    """--percentile-metrics without tpot: no TPOT statistics in the results, the TPOT curve is left out, the rest
    is drawn (the plot used to raise KeyError after every level had run)."""
    with spawn_fake_server("--ttft-ms", "5", "--itl-ms", "5") as srv:
        rc = _sweep(srv.url, tmp_path, [1, 2], "--percentile-metrics", "ttft,e2el")
    assert rc == 0
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert all("mean_tpot_ms" not in s for s in sweep) and all(s["completed"] == 4 for s in sweep)
    for png in ("sweep_throughput_tpot.png", "sweep_pareto.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_levels_without_tpot_samples_are_left_off_the_curves(tmp_path) -> None:
    """One-token outputs: TPOT and tokens/s per user are undefined (None), so the plots draw what exists and do not
    put a point at 0."""
    from glm5_fp4.loadtest.sweep import plot_sweep, sweep_markdown

    rows = [dict(max_concurrency=c, completed=4, failed=0, output_throughput=100.0 * c, mean_tpot_ms=None,
                 p99_tpot_ms=None, output_throughput_per_user=None) for c in (1, 2)]
    files = plot_sweep(rows, tmp_path)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in files.values())
    assert "| 1 | 4 | 0 |" in sweep_markdown(rows)


def test_an_interrupt_between_measured_phases_keeps_the_levels_that_ran(tmp_path, monkeypatch) -> None:
    """Ctrl-C (or SIGTERM) in a later level's warm-up left c1.json but no sweep.json / sweep.md: the sweep's own
    files are written from the levels that ran, that level and the rest named as not run, and the command still
    ends as interrupted (130)."""
    from glm5_fp4.loadtest import runner

    real, calls = runner.run_loadtest, []

    def interrupted_second(cfg):
        calls.append(cfg.concurrency)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(cfg)

    monkeypatch.setattr(runner, "run_loadtest", interrupted_second)
    with spawn_fake_server("--ttft-ms", "1", "--itl-ms", "1") as srv:
        rc = _sweep(srv.url, tmp_path, [1, 2, 4])
    assert rc == 130 and calls == [1, 2]
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [s["max_concurrency"] for s in sweep] == [1]
    assert "Levels not run (the sweep stopped): 2, 4" in (tmp_path / "sweep.md").read_text()
