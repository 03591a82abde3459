"""`profile timers` and `profile trim` on bad input: one clear error, and nothing written that a later step
would take for a valid result."""

from __future__ import annotations

import gzip
import json

import pytest

from glm5_fp4.cli import main


def _dump(path, regions_list):
    path.write_text("".join(json.dumps({"step": i + 1, "rows": 1, "regions_us": r}) + "\n"
                            for i, r in enumerate(regions_list)))
    return path


@pytest.mark.parametrize(
    "value, culprit",
    [
        (-12.5, "region 'layer00' is -12.5 µs"),
        (float("nan"), "region 'layer00' is nan µs"),
        ("x", "region 'layer00' is 'x', expected a number"),
        (1e308, "region 'layer00' is 1e+308 µs; a duration is finite, >= 0 and under a day"),
    ],
)
def test_timers_refuse_durations_no_timer_writes(tmp_path, capsys, value, culprit):
    f = _dump(tmp_path / "t.jsonl", [{"layer00": 10.0, "layer01": 5.0}, {"layer00": value, "layer01": 5.0}])
    out = tmp_path / "out"
    assert main(["profile", "timers", str(f), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{f}:2" in err and culprit in err and "Traceback" not in err
    assert not out.exists()


def test_timers_refuse_the_same_dump_twice(tmp_path, capsys):
    f = _dump(tmp_path / "t.jsonl", [{"layer00": 10.0}, {"layer00": 12.0}])
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(f.read_bytes())
    for args in ([str(f), str(f)], [str(f), str(copy)]):
        assert main(["profile", "timers", *args, "--out", str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err
        assert "counted once" in err
    assert main(["profile", "timers", str(f), "--out", str(tmp_path / "out")]) == 0
    doc = json.loads((tmp_path / "out" / "layer_timers.json").read_text())
    assert doc["steps"] == 2


def _trace(rank: int) -> dict:
    return {
        "deviceProperties": [{"id": 0, "name": "GPU"}],
        "distributedInfo": {"rank": rank, "world_size": 2},
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "k", "ts": 10.0, "dur": 5.0, "pid": 0, "tid": 7},
            {"ph": "X", "cat": "python_function", "name": "f", "ts": 1.0, "dur": 50.0, "pid": 1, "tid": 1},
        ],
    }


def test_trim_writes_nothing_when_one_rank_fails(tmp_path, capsys):
    src = tmp_path / "cap"
    src.mkdir()
    with gzip.open(src / "a_rank0.pt.trace.json.gz", "wb") as fh:
        fh.write(json.dumps(_trace(0)).encode())
    whole = gzip.compress(json.dumps(_trace(1)).encode())
    (src / "z_rank1.pt.trace.json.gz").write_bytes(whole[: len(whole) // 2])  # a truncated copy
    dst = tmp_path / "new" / "trimmed"
    assert main(["profile", "trim", str(src), str(dst)]) == 1
    err = capsys.readouterr().err
    assert "z_rank1" in err and "nothing written" in err
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cap"]  # no temporary directory left either

    (src / "z_rank1.pt.trace.json.gz").write_bytes(whole)
    assert main(["profile", "trim", str(src), str(dst)]) == 0
    assert sorted(p.name for p in dst.iterdir()) == ["a_rank0.pt.trace.json.gz", "z_rank1.pt.trace.json.gz"]
    kept = json.loads(gzip.decompress((dst / "a_rank0.pt.trace.json.gz").read_bytes()))["traceEvents"]
    assert [e["cat"] for e in kept] == ["kernel"]


def test_trim_refuses_to_write_over_its_source(tmp_path, capsys):
    """DST = SRC (or the directory the traces sit in) would replace every full trace by its trimmed copy: refused,
    the traces untouched (before: rc 0 and the originals gone)."""
    src = tmp_path / "cap"
    src.mkdir()
    body = gzip.compress(json.dumps(_trace(0)).encode())
    (src / "a_rank0.pt.trace.json.gz").write_bytes(body)
    for dst in (src, tmp_path / "cap" / "."):
        assert main(["profile", "trim", str(src), str(dst)]) == 1
        err = capsys.readouterr().err
        assert "holds the traces being trimmed" in err and "Traceback" not in err
        assert (src / "a_rank0.pt.trace.json.gz").read_bytes() == body
    assert sorted(p.name for p in src.iterdir()) == ["a_rank0.pt.trace.json.gz"]


@pytest.mark.parametrize("change,culprit", [
    (dict(dur=-5.0), "dur -5.0"), (dict(ts=None), "ts None"), ("no ts", "no 'ts'"), (dict(args="x"), "args str"),
    (dict(dur="x"), "dur 'x'")])
def test_analyze_refuses_gpu_records_it_cannot_place(tmp_path, capsys, change, culprit):
    """A kernel record without a usable time (missing, negative, not a number) or with non-object args: one error
    naming the file and the event, exit 1. Before: dropped or counted as idle with exit 0 (a trace whose kernels
    had negative durations came out as a step of 99.9 % idle GPU), or an AttributeError traceback."""
    tr = _trace(0)
    tr["traceEvents"].append({"ph": "X", "cat": "kernel", "name": "bad_kernel", "ts": 20.0, "dur": 1.0, "pid": 0,
                              "tid": 7})
    ev = tr["traceEvents"][-1]
    if change == "no ts":
        del ev["ts"]
    else:
        ev.update(change)
    tr["deviceProperties"][0]["name"] = 5  # a foreign GPU name: no traceback either (the GPU is left unnamed)
    src = tmp_path / "cap"
    src.mkdir()
    (src / "a_rank0.pt.trace.json").write_text(json.dumps(tr))
    assert main(["profile", "analyze", str(src), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "a_rank0.pt.trace.json" in err and "event 2" in err and "bad_kernel" in err and culprit in err, err
    assert "Traceback" not in err
