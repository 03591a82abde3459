"""Result files are written whole or not at all, and an output path that cannot be written is refused before the
work that would fill it (glm5_fp4.outputs: the one home of these rules)."""

from __future__ import annotations

import errno
import os

import pytest

from glm5_fp4 import outputs
from glm5_fp4.errors import Glm5Fp4Error


def test_atomic_write_leaves_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    """A write that fails half-way (a full disk: EFBIG / ENOSPC) raises one error naming the file, and the file keeps
    its former content; no temporary file is left beside it."""
    target = tmp_path / "README.md"
    target.write_text("old index\n")
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:8])
            raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(outputs.os, "fdopen", lambda fd, *a, **k: Full(real_fdopen(fd, *a, **k)))
    with pytest.raises(Glm5Fp4Error, match="README.md: cannot write \\(File too large\\)"):
        outputs.write_text_atomic(target, "new index, much longer than eight bytes\n")
    assert target.read_text() == "old index\n"
    assert [p.name for p in tmp_path.iterdir()] == ["README.md"]


def test_atomic_write_into_a_missing_or_unwritable_directory_is_one_error(tmp_path):
    """The temporary file's creation fails too when the directory is not there (or is a file): one error, not a
    FileNotFoundError traceback from mkstemp."""
    (tmp_path / "f").write_text("x")
    for path in (tmp_path / "missing" / "a.json", tmp_path / "f" / "a.json"):
        with pytest.raises(Glm5Fp4Error, match="a.json: cannot write"):
            outputs.write_text_atomic(path, "{}")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_output_dir_check_tries_the_directory_it_would_write():
    """create=False tries a scratch directory in the nearest existing parent: /proc (where root's permission bits
    say yes) is refused up front, so a command does not run for minutes and then fail to write its result."""
    with pytest.raises(Glm5Fp4Error, match="--result-dir /proc/x \\(in /proc\\): cannot write there"):
        outputs.output_dir("/proc/x", "--result-dir", create=False)


def test_output_dir_check_leaves_nothing_behind(tmp_path):
    out = outputs.output_dir(tmp_path / "a" / "b", create=False)
    assert out == tmp_path / "a" / "b" and list(tmp_path.iterdir()) == []


def test_improvements_index_keeps_the_readme_when_its_write_fails(tmp_path, monkeypatch):
    """`improvements index` rewrites README.md through the atomic writer: a failed write leaves the former README
    (before: truncated at the size limit)."""
    from glm5_fp4.improvements import writeups

    d = tmp_path / "imp"
    d.mkdir()
    (d / "README.md").write_text(f"# Improvements\n\n{writeups.INDEX_BEGIN}\n{writeups.INDEX_END}\n")
    (d / "01-a.md").write_text("---\nnumber: 1\ntitle: a\nstatus: proposed\nheadline: h\n---\n# a\n")
    before = (d / "README.md").read_text()

    def fail(path, text):
        raise Glm5Fp4Error(f"{path}: cannot write (File too large)")

    monkeypatch.setattr(writeups, "write_text_atomic", fail)
    with pytest.raises(Glm5Fp4Error, match="cannot write"):
        writeups.regenerate_index(d)
    assert (d / "README.md").read_text() == before


def test_loadtest_refuses_a_result_dir_it_cannot_write_before_sending_anything(tmp_path):
    from glm5_fp4.loadtest.runner import LoadTestConfig

    (tmp_path / "file").write_text("x")
    with pytest.raises(Glm5Fp4Error, match="--result-dir .*file.*not a directory"):
        LoadTestConfig(result_dir=str(tmp_path / "file" / "sub"))
    with pytest.raises(Glm5Fp4Error, match="--result-filename '../escape.json': a file name"):
        LoadTestConfig(result_dir=str(tmp_path), result_filename="../escape.json")


@pytest.mark.parametrize("field,value,msg", [
    ("num_gpus", -1, "--num-gpus -1 must be >= 1"), ("num_gpus", 0, "--num-gpus 0 must be >= 1"),
    ("num_warmups", -1, "--num-warmups -1 must be >= 0"), ("warmup_output_len", -1, "--warmup-output-len -1"),
    ("read_timeout_s", -1.0, "--read-timeout -1.0 must be"), ("request_timeout_s", float("nan"), "--request-timeout"),
    ("timeout_s", float("nan"), "--timeout nan"), ("input_len", 99999999999, "--input-len 99999999999: more than")])
def test_loadtest_refuses_counts_and_times_that_cannot_be(field, value, msg):
    """Before: accepted, a tok/s/GPU of -451 in the result (--num-gpus -1), or an error naming another flag."""
    from glm5_fp4.loadtest.runner import LoadTestConfig

    with pytest.raises(Glm5Fp4Error, match=msg.replace("(", "\\(").replace(".", "\\.")):
        LoadTestConfig(**{field: value})


@pytest.mark.parametrize("argv,msg", [
    (["compare", "a.json", "b.json", "--seed", "-1"], "argument --seed: '-1' must be >= 0"),
    (["compare", "a.json", "b.json", "--bootstrap", "100000000000"], "must be between 50 and 100000"),
    (["plan", "--reserve-gib", "1e300"], "argument --reserve-gib: '1e300' must be between 0 and 4096"),
    (["serve", "--model", "m", "--port", "99999", "--dry-run"], "argument --port: '99999' must be between 1 and 65535"),
    (["serve", "--model", "m", "--timeout", "nan", "--dry-run"], "argument --timeout: 'nan' is not a finite number"),
])
def test_numeric_options_are_checked_while_parsing(capsys, argv, msg):
    """Before: a traceback (a 29 TiB bootstrap array, an integer overflow in the planner, numpy's seed check) or a
    dry run that printed a command with port 99999."""
    from glm5_fp4.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_compare_labels_one_per_result(tmp_path, capsys):
    from glm5_fp4.cli import main

    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--labels", "a"]) == 1
    assert "--labels 'a': 1 label(s) for 2 RESULT(s)" in capsys.readouterr().err


def test_profile_yaml_that_is_not_utf8(tmp_path):
    from glm5_fp4.launch.profile import load_profile

    p = tmp_path / "p.yaml"
    p.write_bytes(b'model: x\ndescription: "\xff\xfe"\n')
    with pytest.raises(Glm5Fp4Error, match="p.yaml: not UTF-8 text"):
        load_profile(p)


def test_server_log_that_cannot_be_written_is_refused_before_the_server_starts(tmp_path, monkeypatch):
    """--log-file under a file, or a directory: one error, and no process started (before: a FileExistsError traceback
    from mkdir after the launch command was printed)."""
    from glm5_fp4 import server_process

    started = []
    monkeypatch.setattr(server_process.subprocess, "Popen", lambda *a, **k: started.append(a))
    (tmp_path / "f").write_text("x")
    for log, msg in ((tmp_path / "f" / "server.log", "not a directory"), (tmp_path, "is a directory")):
        with pytest.raises(Glm5Fp4Error, match=msg):
            server_process.spawn(["true"], {}, log, "header")
    assert started == []


def test_demo_out_under_a_file(tmp_path, capsys):
    from glm5_fp4.cli import main

    (tmp_path / "f").write_text("x")
    assert main(["demo", "--skip-serve", "--out", str(tmp_path / "f" / "demo")]) == 1
    err = capsys.readouterr().err
    assert "--out" in err and "not a directory" in err and "Traceback" not in err


def test_files_written_together_are_all_new_or_all_old(tmp_path, monkeypatch):
    """A load test's summary, requests and table: when the second could not be written, the first was already
    replaced, and an earlier run's summary sat beside the new run's requests."""
    import glm5_fp4.outputs as O
    from glm5_fp4.errors import Glm5Fp4Error

    paths = [tmp_path / n for n in ("r.requests.jsonl", "r.json", "r.md")]
    for p in paths:
        p.write_text("old")
    real = O._stage
    calls = []

    def failing(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(O, "_stage", failing)
    with pytest.raises(Glm5Fp4Error, match="No space left"):
        O.write_texts_together({p: "new" for p in paths})
    assert [p.read_text() for p in paths] == ["old"] * 3
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted(p.name for p in paths)  # no scratch left
    monkeypatch.setattr(O, "_stage", real)
    O.write_texts_together({p: "new" for p in paths})
    assert [p.read_text() for p in paths] == ["new"] * 3
