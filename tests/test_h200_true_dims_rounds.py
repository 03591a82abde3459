"""The true-dimension harness's sweep schedule (benchmarks/h200/true_dims.py): prewarm before measurement,
--prewarm-only for the cold machine's call, and each sweep's time limit."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks" / "h200")]

import true_dims  # noqa: E402


def _args(*argv):
    ap = argparse.ArgumentParser()
    true_dims.add_arguments(ap)
    return true_dims.parse_arguments(ap, list(argv))


def test_every_prewarm_comes_before_any_measured_sweep():
    rounds = true_dims.sweep_rounds(["ours", "marlin"], _args())
    assert rounds == [("prewarm", "ours"), ("prewarm", "marlin"), ("loadtest", "ours"), ("loadtest", "marlin")]
    assert true_dims.sweep_rounds(["ours", "marlin"], _args("--no-prewarm")) == [("loadtest", "ours"),
                                                                                 ("loadtest", "marlin")]


def test_prewarm_only_measures_nothing_and_gives_the_prewarms_the_time():
    """The cold machine's call (2026-12-02: a 327 s start left each prewarm 60 s of a 555 s call and no measurement)."""
    args = _args("--prewarm-only")
    rounds = true_dims.sweep_rounds(["ours", "marlin"], args)
    assert rounds == [("prewarm", "ours"), ("prewarm", "marlin")]
    # 220 s left: no profile reserve, two rounds share it (not four, not minus 2 x 90 s of profiles)
    assert true_dims.round_timeout(220.0, 2, 2, args) == pytest.approx(95.0)
    assert true_dims.round_timeout(220.0, 4, 2, _args()) == 60.0  # four rounds + profiles: the floor


def test_round_timeout_reserves_the_profiles_unless_that_starves_the_sweeps():
    args = _args()
    assert true_dims.round_timeout(1000.0, 2, 2, args) == pytest.approx(300.0)  # capped
    assert true_dims.round_timeout(600.0, 2, 2, args) == pytest.approx((570 - 180) / 2)  # 195 >= SWEEP_MIN_S
    assert true_dims.round_timeout(400.0, 2, 2, args) == pytest.approx(370 / 2)  # 95 < SWEEP_MIN_S: sweeps first
    assert true_dims.round_timeout(400.0, 2, 2, _args("--no-profile")) == pytest.approx(185.0)


def test_prewarm_only_with_no_prewarm_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        _args("--prewarm-only", "--no-prewarm")
    assert exc.value.code == 2 and "would run no sweep" in capsys.readouterr().err


@pytest.mark.parametrize("argv,culprit", [(("--servers", "ours,nope"), "--servers"), (("--levels", "1,x"), "--levels"),
                                          (("--levels", "8,8"), "--levels"), (("--start-together", "0"), "--start-together")])
def test_the_harness_refuses_bad_values_before_any_device_time(capsys, argv, culprit):
    """--servers was checked after the checkpoint was made (up to 240 s), --levels only after every load test ran,
    --start-together 0 was silently 1."""
    with pytest.raises(SystemExit) as e:
        _args(*argv)
    assert e.value.code == 2 and culprit in capsys.readouterr().err
