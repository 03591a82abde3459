"""The watch on eager MoE calls' host time (glm5_fp4.kernels.slow_calls): a slow call is reported once with what
held it (compiles since the last check, a full garbage collection, or neither), fast calls and the warm-up's are
not, and in vLLM the package's records reach the engine's log."""

from __future__ import annotations

import gc
import logging
import time

import pytest
import torch

from glm5_fp4.kernels import slow_calls as S

CUDA = torch.device("cuda")  # the watch only looks at the device type; nothing runs on it here


@pytest.fixture()
def watch(monkeypatch):
    counts = {"_gemm1": 3, "_gemm2": 2}
    monkeypatch.setattr(S, "compiled_kernels", lambda: dict(counts))
    monkeypatch.setenv(S.ENV, "20")
    # An automatic full collection of `make test`'s heap (torch and vLLM imported: ~0.3 s) inside a 30 ms call
    # would be reported, rightly, and fail the tests that expect none; the tests make their own collections.
    enabled = gc.isenabled()
    gc.disable()
    yield S.Watch(), counts
    if enabled:
        gc.enable()


def test_a_slow_call_names_the_kernels_compiled_during_it(watch, caplog):
    w, counts = watch
    w.warmed_up()
    with caplog.at_level(logging.WARNING, logger="glm5_fp4"):
        with w.call(4096, CUDA):
            counts["_gemm2"] += 2  # what Triton would add to its cache while compiling
            time.sleep(0.03)
    assert w.slow_count == 1 and w.slow[0].compiled == {"_gemm2": 2} and w.slow[0].tokens == 4096
    msg = caplog.records[-1].getMessage()
    assert "4096 tokens" in msg and "_gemm2 x2" in msg and "warm-up missed" in msg


def test_a_compile_before_any_warm_up_is_not_blamed_on_the_warm_up(watch):
    """H100, 2026-12-07: selftest (which runs no warm-up) logged its first call's compile as "a specialisation
    the load-time warm-up missed"; the blame belongs only where a warm-up ran in this process."""
    w, counts = watch
    with w.call(1, CUDA):
        counts["_gemm1"] += 1
        time.sleep(0.03)
    assert "warm-up missed" not in w.slow[0].cause()
    assert "no load-time warm-up has run" in w.slow[0].cause()
    w.warmed_up()
    with w.call(1, CUDA):
        counts["_gemm1"] += 1
        time.sleep(0.03)
    assert "warm-up missed" in w.slow[1].cause()


def test_a_full_collection_is_named(watch):
    w, _ = watch
    with w.call(8, CUDA):
        gc.collect()
        time.sleep(0.03)
    assert w.slow[0].full_gc >= 1 and "garbage collection" in w.slow[0].cause()


def test_neither_says_the_host_waited(watch):
    w, _ = watch
    with w.call(8, CUDA):
        time.sleep(0.03)
    assert not w.slow[0].compiled and not w.slow[0].full_gc
    assert "waited on the device" in w.slow[0].cause()


def test_fast_calls_cpu_calls_and_a_zero_threshold_are_not_reported(watch, monkeypatch):
    w, counts = watch
    with w.call(8, CUDA):
        counts["_gemm1"] += 1  # a compile inside a fast call is picked up by the next slow one, not lost
    with w.call(8, torch.device("cpu")):
        time.sleep(0.03)
    monkeypatch.setenv(S.ENV, "0")
    with w.call(8, CUDA):
        time.sleep(0.03)
    assert w.slow_count == 0 and w.calls == 1
    monkeypatch.setenv(S.ENV, "20")
    with w.call(8, CUDA):
        time.sleep(0.03)
    assert w.slow[0].compiled == {"_gemm1": 1}


def test_warm_up_calls_are_quiet_and_reset_the_snapshot(watch):
    w, counts = watch
    with w.quiet():
        with w.call(64, CUDA):
            counts["_gemm1"] += 5
            time.sleep(0.03)
    assert w.slow_count == 0
    with w.call(64, CUDA):
        time.sleep(0.03)
    assert w.slow[0].compiled == {}  # the warm-up's compiles are not charged to a later call


def test_a_threshold_it_cannot_read_is_refused_by_name(monkeypatch):
    """It fell back to the default without a word ("fast", and "nan" switched the watch off): glm5_fp4.envvars."""
    from glm5_fp4.errors import Glm5Fp4Error

    for raw in ("fast", "nan", "-5"):
        monkeypatch.setenv(S.ENV, raw)
        with pytest.raises(Glm5Fp4Error, match=S.ENV):
            S.threshold_ms()
    monkeypatch.setenv(S.ENV, "")
    assert S.threshold_ms() == S.DEFAULT_MS


def test_compiled_kernels_lists_the_moe_kernels():
    names = S.compiled_kernels()
    assert names and all(v >= 0 for v in names.values())
    assert any("gemm" in n for n in names), sorted(names)


def test_package_records_reach_the_engine_logger(monkeypatch):
    from glm5_fp4.engines import logs

    pkg = logging.getLogger(logs.PACKAGE)
    monkeypatch.setattr(pkg, "handlers", [h for h in pkg.handlers if not isinstance(h, logs._ToEngine)])
    monkeypatch.setattr(pkg, "level", logging.NOTSET)
    got = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    engine = logging.getLogger("fake_engine_for_test")
    engine.addHandler(Keep())
    root_got = []

    class KeepRoot(Keep):
        def emit(self, record):
            root_got.append(record.getMessage())

    root = logging.getLogger()
    at_root = KeepRoot()
    root.addHandler(at_root)
    try:
        logs.route_to("fake_engine_for_test.glm5_fp4")
        logs.route_to("fake_engine_for_test.glm5_fp4")  # idempotent: one route
        logging.getLogger("glm5_fp4.kernels").info("compiled the MoE kernels")
    finally:
        engine.handlers.clear()
        root.removeHandler(at_root)
    assert got == ["compiled the MoE kernels"]
    assert root_got == ["compiled the MoE kernels"]  # once, although the engine's logger propagates to the root


def _held_in_here(seconds):
    time.sleep(seconds)


def test_the_warning_shows_where_the_host_was_held(watch, caplog):
    w, _ = watch
    with caplog.at_level(logging.WARNING, logger="glm5_fp4"):
        with w.call(128, CUDA):
            _held_in_here(0.1)
    stack = "\n".join(w.slow[0].stack)
    assert "_held_in_here" in stack and "time.sleep" in stack, stack
    assert "_held_in_here" in caplog.records[-1].getMessage()


def test_eager_calls_are_counted_per_token_count_for_the_host_sampler(watch, monkeypatch):
    w, _ = watch
    monkeypatch.setenv(S.ENV, "0")  # counted even with the timing off
    for t in (8, 8, 512):
        with w.call(t, CUDA):
            pass
    with w.call(8, torch.device("cpu")):
        pass
    with w.quiet(), w.call(8, CUDA):  # the warm-up's calls are not the server's
        pass
    assert dict(w.tokens) == {8: 2, 512: 1}
