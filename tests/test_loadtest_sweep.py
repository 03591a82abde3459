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
