"""One cost model of a decode step: `glm5-fp4 plan` and `glm5-fp4 profile analyze` give the same floors."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from glm5_fp4.cli import main

TRACES = Path(__file__).resolve().parent / "fixtures" / "profiling" / "traces" / "tp2" / "graph"


def _plan_json(*args: str) -> dict:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["plan", "--json", *args]) == 0
    return json.loads(out.getvalue())


def _ceilings(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "analysis"
    with redirect_stdout(io.StringIO()):
        assert main(["profile", "analyze", str(TRACES), "--out", str(out), "--no-png", "--jobs", "1", *args]) == 0
    return json.loads((out / "breakdown.json").read_text())["ceilings"]


@pytest.mark.parametrize("tp,batch,context,kv", [(8, 512, 2048, "fp8"), (8, 16, 8192, "bf16"), (4, 64, 1024, "fp8")])
def test_plan_and_profile_analyze_give_the_same_floors(tmp_path, tp, batch, context, kv):
    gpu = "rtx-pro-6000-ws"
    plan = _plan_json("--gpu", gpu, "--layouts", f"tp{tp}", "--concurrency", str(batch), "--context", str(context),
                      "--kv-cache-dtype", {"fp8": "fp8", "bf16": "bfloat16"}[kv])
    (layout,) = plan["layouts"].values()
    ceilings = _ceilings(tmp_path, "--gpu", gpu, "--batch", str(batch), "--context", str(context), "--tp", str(tp),
                         "--pp", "1", "--kv-dtype", kv)
    assert set(ceilings["categories"]) <= set(layout["step_ms"])
    for category, row in ceilings["categories"].items():
        assert layout["step_ms"][category] * 1e3 == pytest.approx(row["floor_us"], rel=1e-9), category
    assert layout["step_ms"]["total"] * 1e3 == pytest.approx(ceilings["step_floor_us"], rel=1e-9)
