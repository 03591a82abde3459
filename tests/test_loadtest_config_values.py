"""Load-test values that looked valid and were not: each refused before any request, naming the flag (found by
feeding the tool odd but plausible values)."""

from __future__ import annotations

import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.loadtest import report
from glm5_fp4.loadtest.runner import LoadTestConfig

URL = "http://127.0.0.1:18000"


@pytest.mark.parametrize("field,value,flag", [
    ("burstiness", float("inf"), "--burstiness"),  # gamma(inf) gave NaN gaps: every request at t=0, rate ignored
    ("burstiness", float("nan"), "--burstiness"),
    ("stall_timeout_s", float("nan"), "--stall-timeout"),  # turned stall detection off, NaN in the JSON
    ("timeout_s", -5.0, "--timeout"),  # read as no deadline
    ("goodput", {"ttft": float("nan")}, "--goodput"),  # goodput 0
])
def test_values_that_mean_nothing_are_refused(field, value, flag):
    with pytest.raises(Glm5Fp4Error, match=flag):
        LoadTestConfig(url=URL, **{field: value})


@pytest.mark.parametrize("key", ["num_prompts", "model_id", "max_concurrency", "mean_tpot_ms", "metadata",
                                 "p99_ttft_ms", "run_failed"])
def test_metadata_may_not_overwrite_the_results_own_fields(key):
    """--metadata num_prompts=16 crashed the verdict after the whole run; model_id=foo relabelled the run."""
    with pytest.raises(Glm5Fp4Error, match=f"--metadata {key}"):
        LoadTestConfig(url=URL, metadata={key: "x"})
    LoadTestConfig(url=URL, metadata={"gpu_clock": "locked"})


def test_result_files_that_cannot_be_written_are_refused_before_the_run(tmp_path):
    """A folder named like the .md made the run fail after measuring, with the .json and .jsonl already written."""
    (tmp_path / "x.md").mkdir()
    with pytest.raises(Glm5Fp4Error, match="x.md"):
        LoadTestConfig(url=URL, result_dir=str(tmp_path), result_filename="x.json")


def test_a_failed_write_leaves_none_of_the_three_files(tmp_path, monkeypatch):
    import glm5_fp4.outputs as O

    real = O._stage

    def failing(path, data):
        if str(path).endswith(".md"):
            raise OSError(28, "disk full")
        return real(path, data)

    monkeypatch.setattr(O, "_stage", failing)
    with pytest.raises(Glm5Fp4Error, match="disk full"):
        report.write_results({"completed": 1}, [{"index": 0}], tmp_path / "y.json")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("levels,why", [("2,2", "twice"), ("1,,8", "empty")])
def test_sweep_levels_have_no_repeats_or_holes(capsys, levels, why):
    """--concurrency 2,2 wrote one c2.json while sweep.md listed two rows."""
    from glm5_fp4.cli import main

    with pytest.raises(SystemExit) as e:
        main(["loadtest", "--url", URL, "--concurrency", levels])
    assert e.value.code == 2 and why in capsys.readouterr().err


@pytest.mark.parametrize("key,flag", [("stream", "streams"), ("model", "--model"), ("max_tokens", "--output-len"),
                                      ("max_completion_tokens", "--output-len"), ("prompt", "--input-len"),
                                      ("messages", "--input-len"), ("stream_options", "usage"),
                                      ("ignore_eos", "--no-ignore-eos"), ("min_tokens", "--no-min-tokens")])
def test_extra_body_may_not_replace_what_the_tool_sends(key, flag):
    """{"stream": false} failed every request as 'connection closed early'; {"model": "other"} was recorded as the
    model /v1/models named."""
    with pytest.raises(Glm5Fp4Error, match=f"--extra-body.*{key}.*{flag}"):
        LoadTestConfig(url=URL, extra_body={key: 1})
    LoadTestConfig(url=URL, extra_body={"temperature": 0.5})


def test_a_concurrency_past_the_open_file_limit(monkeypatch):
    """At a soft limit of 128 descriptors, 200 streams finished the run and then lost it writing the results
    ('Too many open files', naming the results file). The soft limit is raised to what the streams need where the
    hard limit allows; else one error before any request."""
    import resource

    from glm5_fp4.loadtest import runner

    raised = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (128, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda which, lim: raised.append(lim))
    runner.ensure_file_room(200)
    assert raised and raised[0][0] >= 200 + runner.FD_MARGIN and raised[0][1] == 4096
    monkeypatch.setattr(resource, "getrlimit", lambda which: (128, 128))
    with pytest.raises(Glm5Fp4Error, match=r"--concurrency 200.*ulimit -n"):
        runner.ensure_file_room(200)
    raised.clear()
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 1024))
    runner.ensure_file_room(200)  # room enough: nothing changed
    assert not raised
