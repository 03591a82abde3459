"""The layer-timer report over the dumps real runs leave: empty stage files, appended runs, graph replays without
token counts, SGLang phases, torn last lines (review of 2026-12-07)."""

import json

import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.profiling.layer_timers import read_dumps, report_from_files


def _write(path, records, end="\n"):
    path.write_text("".join(json.dumps(r) + "\n" for r in records)[:-1] + end if records else "")
    return path


def _steps(layers, per_layer_us, n, start=1, **extra):
    out = []
    for s in range(n):
        regions = {f"layer{i:02d}": per_layer_us for i in layers}
        regions["all layers"] = per_layer_us * len(layers)
        out.append({"step": start + s, **extra, "regions_us": regions})
    return out


def _report(tmp_path, files):
    paths = report_from_files(files, tmp_path / "rep")
    return json.loads(paths["json"].read_text()), paths["markdown"].read_text()


def test_empty_dumps_of_earlier_pipeline_stages_are_skipped_with_a_note(tmp_path):
    """vLLM PP3: stages 0 and 1 compute no logits and leave 0-byte rank<r>.jsonl files, which hashed equal and were
    refused as duplicates; the report of the last stage failed."""
    files = [_write(tmp_path / "rank0.jsonl", []), _write(tmp_path / "rank1.jsonl", []),
             _write(tmp_path / "rank2.jsonl", _steps([4, 5], 300.0, 3, tokens=3))]
    doc, md = _report(tmp_path, files)
    assert [d["file"] for d in doc["dumps"]] == ["rank2.jsonl"]
    for name in ("rank0.jsonl", "rank1.jsonl"):
        note = next(n for n in doc["notes"] if name in n)
        assert "pipeline stage" in note and "died" in note
        assert name in md
    # duplicates among files with records are still refused
    dup = _write(tmp_path / "copy.jsonl", _steps([4, 5], 300.0, 3, tokens=3))
    with pytest.raises(Glm5Fp4Error, match="same content"):
        read_dumps(files + [dup])


def test_batch_sizes_count_steps_per_dump_and_keep_stage_totals_apart(tmp_path):
    """PP2 (stages of 300 and 700 us per step) showed one row `8 | 8 steps | 500 us` for 4 steps of ~1,000 us."""
    files = [_write(tmp_path / f"rank{r}.jsonl", _steps(layers, us, 4, tokens=8) + _steps(layers, us * 10, 2, 5, tokens=512))
             for r, layers, us in ((0, [0, 1], 150.0), (1, [2, 3], 350.0))]
    doc, md = _report(tmp_path, files)
    groups = {g["value"]: g for g in doc["groups"]}
    assert groups[8]["steps"] == 4 and groups[512]["steps"] == 2
    assert groups[8]["steps_per_dump"] == {"rank0.jsonl": 4, "rank1.jsonl": 4}
    assert "| 500.0 |" not in md and "| 8 | 8 |" not in md, md
    assert "| 8 | rank0.jsonl | 4 | 300.0 |" in md and "| 8 | rank1.jsonl | 4 | 700.0 |" in md, md
    assert "## 8 tokens per step (4 step(s) in each of 2 dumps)" in md, md


def test_batch_sizes_of_tensor_parallel_ranks_count_steps_once(tmp_path):
    files = [_write(tmp_path / f"rank{r}.jsonl", _steps([0, 1], 150.0 + r, 4, tokens=8)
                    + _steps([0, 1], 1500.0 + r, 2, 5, tokens=512)) for r in (0, 1)]
    doc, md = _report(tmp_path, files)
    assert {g["value"]: g["steps"] for g in doc["groups"]} == {8: 4, 512: 2}
    assert "| 8 | 4 | 301.0 |" in md and "steps per dump" in md, md


def test_a_second_run_appended_to_a_dump_is_refused(tmp_path):
    f = _write(tmp_path / "rank0.jsonl", _steps([0], 100.0, 3) + _steps([0], 900.0, 3))
    with pytest.raises(Glm5Fp4Error, match=r"rank0.jsonl:4: .*second run.*GLM5_FP4_LAYER_TIMERS_OUT"):
        read_dumps([f])


def test_steps_without_token_count_are_not_pooled_with_counted_ones(tmp_path):
    """vLLM full-graph mode: decode replays skip the hook that counts tokens, prefill steps do not; all steps fell
    into one group and the 3,000 us prefills and 40 us decodes were reported as one median, without a word."""
    recs = _steps([0], 3000.0, 2, rows=1, tokens=4096) + _steps([0], 40.0, 6, 3, rows=1)
    doc, md = _report(tmp_path, [_write(tmp_path / "rank0.jsonl", recs)])
    assert doc["group_by"] == "tokens"
    groups = {g["value"]: g["steps"] for g in doc["groups"]}
    assert groups == {4096: 2, None: 6}
    assert any("no token count" in n and "CUDA graph" in n for n in doc["notes"]), doc["notes"]
    assert "## no token count (6 steps)" in md and "## 4096 tokens per step (2 steps)" in md, md


def test_phases_are_grouped_apart(tmp_path):
    """SGLang: a DECODE step of 512 streams and an EXTEND chunk of 512 tokens have the same token count."""
    recs = _steps([0], 2800.0, 3, tokens=512, phase="DECODE") + _steps([0], 7000.0, 2, 4, tokens=512, phase="EXTEND")
    doc, md = _report(tmp_path, [_write(tmp_path / "rank0.jsonl", recs)])
    groups = {(g["phase"], g["value"]): g for g in doc["groups"]}
    assert set(groups) == {("DECODE", 512), ("EXTEND", 512)}
    med = {k: next(r["median_us"] for r in g["regions"] if r["region"] == "layer00") for k, g in groups.items()}
    assert med == {("DECODE", 512): 2800.0, ("EXTEND", 512): 7000.0}
    assert "## DECODE, 512 tokens per step (3 steps)" in md and "## EXTEND, 512 tokens per step (2 steps)" in md, md


def test_torn_last_line_is_dropped_with_a_note(tmp_path):
    f = _write(tmp_path / "rank0.jsonl", _steps([0], 100.0, 3), end="")
    f.write_text(f.read_text() + '\n{"step": 4, "regions_us": {"layer0')
    doc, _ = _report(tmp_path, [f])
    assert doc["steps"] == 3
    assert any("rank0.jsonl" in n and "unterminated" in n for n in doc["notes"]), doc["notes"]
    # a bad line that is terminated is still an error
    f.write_text(f.read_text() + "\n")
    with pytest.raises(Glm5Fp4Error, match="rank0.jsonl:4"):
        read_dumps([f])


def test_huge_integer_duration_is_one_clear_error(tmp_path):
    f = tmp_path / "big.jsonl"
    f.write_text('{"step": 1, "regions_us": {"a": 1' + "0" * 400 + "}}\n")
    with pytest.raises(Glm5Fp4Error, match=r"big.jsonl:1: region 'a'"):
        read_dumps([f])


# -- review of 2026-12-07, second round --------------------------------------------------------------------------------
def test_the_console_says_every_note(tmp_path, capsys):
    """The notes (skipped dumps, torn lines, uncounted steps) went only into the files; `timers` printed paths."""
    from glm5_fp4.cli import main

    empty = _write(tmp_path / "rank0.jsonl", [])
    full = _write(tmp_path / "rank1.jsonl", _steps([0, 1], 100.0, 3))
    assert main(["profile", "timers", str(empty), str(full), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "note: " in out and "rank0.jsonl: no records, skipped" in out


def test_the_png_counts_steps_per_dump_and_leaves_out_mixed_stage_totals(tmp_path, monkeypatch):
    """PP2: the PNG drew a pooled `all layers` (800 us, no stage's) and titled 10 steps where each dump had 5."""
    from glm5_fp4.profiling import layer_timers as LT

    drawn = {}

    def plot(self, path, title="", skip=(), steps=None):
        drawn.update(regions=[r["region"] for r in self.summary() if r["region"] not in skip], steps=steps,
                     title=title)
        return path

    monkeypatch.setattr(LT.TimerStats, "plot", plot)
    files = [_write(tmp_path / f"rank{r}.jsonl", _steps(layers, us, 5)) for r, layers, us in
             ((0, [0, 1], 200.0), (1, [2, 3], 600.0))]
    read_dumps(files).write(tmp_path / "o")
    assert "all layers" not in drawn["regions"] and drawn["steps"] == 5
    tp = [_write(tmp_path / f"tp{r}.jsonl", _steps([0, 1], 100.0 + r, 5)) for r in range(2)]
    read_dumps(tp).write(tmp_path / "o2")
    assert "all layers" in drawn["regions"] and drawn["steps"] == 5


def test_two_runs_dumps_of_one_rank_are_refused(tmp_path):
    """run1/rank0.jsonl and run2/rank0.jsonl were averaged as two ranks: a median of neither run."""
    a, b = tmp_path / "run1", tmp_path / "run2"
    a.mkdir(), b.mkdir()
    files = [_write(a / "rank0.jsonl", _steps([0], 100.0, 5)), _write(b / "rank0.jsonl", _steps([0], 900.0, 5))]
    with pytest.raises(Glm5Fp4Error, match=r"run1/rank0.jsonl and .*run2/rank0.jsonl.*one rank's dump of two runs"):
        read_dumps(files)


def test_a_layer_missing_from_one_dump_is_named_not_called_a_stage(tmp_path):
    files = [_write(tmp_path / "rank0.jsonl", _steps([0, 1, 2], 200.0, 5)),
             _write(tmp_path / "rank1.jsonl", _steps([0, 2], 200.0, 5))]
    doc, md = _report(tmp_path, files)
    assert "pipeline stages" not in md
    note = next(n for n in doc["notes"] if "layer01" in n)
    assert "rank1.jsonl" in note and "lacks" in note
    assert {d["file"]: d["layers"] for d in doc["dumps"]} == {"rank0.jsonl": "layer00-layer02",
                                                              "rank1.jsonl": "layer00, layer02"}


def test_records_that_timed_nothing_are_left_out_with_a_note(tmp_path):
    ok = _write(tmp_path / "rank0.jsonl", _steps([0, 1], 100.0, 5))
    empty = _write(tmp_path / "rank1.jsonl", [{"step": 1, "rows": 8, "regions_us": {}},
                                              {"step": 2, "rows": 8, "regions_us": {}}])
    doc, md = _report(tmp_path, [ok, empty])
    assert "0 step" not in md and [d["file"] for d in doc["dumps"]] == ["rank0.jsonl"]
    assert any("rank1.jsonl" in n and "2 record(s) time no region" in n for n in doc["notes"])
    with pytest.raises(Glm5Fp4Error, match="time no region"):
        read_dumps([empty])


@pytest.mark.parametrize("field,value", [("tokens", -4), ("rows", -1), ("tokens", "8"), ("rows", 2.5)])
def test_a_batch_size_no_step_has_is_one_clear_error(tmp_path, field, value):
    f = _write(tmp_path / "rank0.jsonl", _steps([0], 5.0, 1) + _steps([0], 6.0, 1, 2, **{field: value}))
    with pytest.raises(Glm5Fp4Error, match=rf"rank0.jsonl:2: {field!r} is {value!r}, expected a whole number >= 0"):
        read_dumps([f])


def test_sglang_idle_steps_of_no_tokens_are_a_group_of_their_own(tmp_path):
    """SGLang's idle DP-attention ranks run the model on 0 tokens (forward_idle, phase IDLE): a whole dump of
    dp8ep8-sglang was refused once 0 was taken for a batch size no step has."""
    f = _write(tmp_path / "rank0.jsonl", _steps([0], 5.0, 2, tokens=8, rows=8, phase="DECODE")
               + _steps([0], 1.0, 1, 3, tokens=0, rows=0, phase="IDLE"))
    doc, _ = _report(tmp_path, [f])
    assert {(g["phase"], g["value"]) for g in doc["groups"]} == {("DECODE", 8), ("IDLE", 0)}
