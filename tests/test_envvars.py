"""The package's environment switches (glm5_fp4.envvars): one parser for every flag and number, which refuses what it
cannot read instead of guessing. Found 2026-12-07: GLM5_FP4_NATIVE_FP4=false switched the native FP4 path ON (any
value but "0" was true), GLM5_FP4_WARMUP=false left the warm-up on, GLM5_FP4_LAYER_TIMERS=2 was silently off, and
GLM5_FP4_SLOW_CALL_MS=abc / nan fell back to 50 / switched the watch off without a word."""

from __future__ import annotations

import pytest

from glm5_fp4 import envvars as V
from glm5_fp4.errors import Glm5Fp4Error


@pytest.mark.parametrize("raw, want", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                       ("0", False), ("false", False), ("No", False), ("off", False)])
@pytest.mark.parametrize("name", ["GLM5_FP4_NATIVE_FP4", "GLM5_FP4_WARMUP", "GLM5_FP4_MOE_NO_ASM",
                                  "GLM5_FP4_LAYER_TIMERS"])
def test_flags_read_the_usual_spellings(name, raw, want):
    assert V.flag(name, {name: raw}) is want


@pytest.mark.parametrize("name, default", [("GLM5_FP4_NATIVE_FP4", False), ("GLM5_FP4_WARMUP", True),
                                           ("GLM5_FP4_MOE_NO_ASM", False), ("GLM5_FP4_LAYER_TIMERS", False)])
def test_an_unset_or_empty_flag_is_its_default(name, default):
    assert V.flag(name, {}) is default and V.flag(name, {name: ""}) is default and V.flag(name, {name: "  "}) is default


@pytest.mark.parametrize("raw", ["2", "enable", "ture", "-1"])
def test_a_flag_it_cannot_read_is_refused_by_name(raw):
    with pytest.raises(Glm5Fp4Error, match=r"GLM5_FP4_NATIVE_FP4=.*1/0, true/false"):
        V.flag("GLM5_FP4_NATIVE_FP4", {"GLM5_FP4_NATIVE_FP4": raw})


def test_numbers_are_finite_and_in_range():
    assert V.number("GLM5_FP4_SLOW_CALL_MS", {}) == 50.0
    assert V.number("GLM5_FP4_SLOW_CALL_MS", {"GLM5_FP4_SLOW_CALL_MS": "0"}) == 0.0  # 0 switches the watch off
    assert V.number("GLM5_FP4_HOST_SAMPLE_MS", {"GLM5_FP4_HOST_SAMPLE_MS": "5"}) == 5.0
    for name, raw in (("GLM5_FP4_SLOW_CALL_MS", "abc"), ("GLM5_FP4_SLOW_CALL_MS", "nan"),
                      ("GLM5_FP4_SLOW_CALL_MS", "-1"), ("GLM5_FP4_HOST_SAMPLE_MS", "0.1"),
                      ("GLM5_FP4_HOST_SAMPLE_MS", "inf")):
        with pytest.raises(Glm5Fp4Error, match=name):
            V.number(name, {name: raw})


def test_check_names_every_bad_variable_at_once_and_the_readers_use_the_one_parser(monkeypatch):
    env = {"GLM5_FP4_NATIVE_FP4": "false", "GLM5_FP4_WARMUP": "nope", "GLM5_FP4_SLOW_CALL_MS": "abc",
           "GLM5_FP4_BACKEND": "tritn", "GLM5_FP4_MODE": "w4a8"}
    with pytest.raises(Glm5Fp4Error) as e:
        V.check(env)
    msg = str(e.value)
    assert all(n in msg for n in ("GLM5_FP4_WARMUP", "GLM5_FP4_SLOW_CALL_MS", "GLM5_FP4_BACKEND", "GLM5_FP4_MODE"))
    assert "GLM5_FP4_NATIVE_FP4" not in msg  # "false" is a fine value
    V.check({"GLM5_FP4_NATIVE_FP4": "0", "GLM5_FP4_GIT_SHA": "abc"})  # nothing to say

    from glm5_fp4.kernels import capability, slow_calls, warmup
    from glm5_fp4.profiling import layer_timers

    monkeypatch.setenv("GLM5_FP4_NATIVE_FP4", "false")
    monkeypatch.setenv("GLM5_FP4_WARMUP", "off")
    monkeypatch.setenv("GLM5_FP4_LAYER_TIMERS", "on")
    assert capability.native_fp4_requested() is False and warmup.enabled() is False
    assert layer_timers.enabled_by_env() is True
    monkeypatch.setenv("GLM5_FP4_SLOW_CALL_MS", "nan")
    with pytest.raises(Glm5Fp4Error, match="GLM5_FP4_SLOW_CALL_MS"):
        slow_calls.threshold_ms()


def test_a_misspelt_variable_is_named_with_its_likely_meaning():
    assert V.unknown({"GLM5_FP4_BACKNED": "triton", "GLM5_FP4_WARMUP": "1", "PATH": "/bin"}) == [
        "GLM5_FP4_BACKNED (did you mean GLM5_FP4_BACKEND?)"]


def test_the_readme_lists_every_variable():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("### Environment variables", 1)[1].split("\n### ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("| `"))
    listed = set(__import__("re").findall(r"`(GLM5_FP4_[A-Z0-9_]+)`", table))
    listed |= {f"GLM5_FP4_LAYER_TIMERS{s}" for s in ("_OUT",)} if "`GLM5_FP4_LAYER_TIMERS` / `_OUT`" in section else set()
    assert listed == set(V.VARS), (sorted(set(V.VARS) - listed), sorted(listed - set(V.VARS)))
