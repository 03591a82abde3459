"""The result-metadata block every committed benchmark result carries (git SHA, date, machine, versions)."""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess

import pytest

from glm5_fp4.bench import meta

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_git_sha_names_the_commit_and_marks_a_dirty_tree(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "f.txt").write_text("a\n")
    _git(tmp_path, "add", "f.txt")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = _git(tmp_path, "log", "-1", "--format=%H")
    assert meta.git_sha(tmp_path) == head
    (tmp_path / "untracked.txt").write_text("x\n")  # untracked files do not make the result irreproducible
    assert meta.git_sha(tmp_path) == head
    (tmp_path / "f.txt").write_text("b\n")
    assert meta.git_sha(tmp_path) == head + "-dirty"
    outside = tmp_path.parent / f"{tmp_path.name}-not-a-repo"
    outside.mkdir()
    assert meta.git_sha(outside) is None


def test_result_metadata_records_the_run_and_the_callers_fields():
    m = meta.result_metadata(packages=("pytest",), benchmark="x", context=2048)
    assert m["benchmark"] == "x" and m["context"] == 2048
    assert m["versions"]["pytest"] == pytest.__version__ and "python" in m["versions"]
    assert dt.datetime.fromisoformat(m["date"]).tzinfo is not None
    assert m["git_sha"] is None or len(m["git_sha"].removesuffix("-dirty")) == 40
    assert m["cpus"] >= 1 and m["host"]
    assert m["gpu"] == (m["gpus"][0]["name"] if m["gpus"] else None)


def test_write_result_writes_both_files(tmp_path):
    import json
    from pathlib import Path

    js, md = meta.write_result(tmp_path / "new" / "dir", "run", {"path": Path("/x"), "n": 1}, "# run\n")
    assert json.loads(js.read_text()) == {"path": "/x", "n": 1} and md.read_text() == "# run\n"
    assert (js.name, md.name) == ("run.json", "run.md")


def test_plan_label_names_the_launch_forms():
    """Bench rows say which forms ran: the split-K reduce fused into GEMM1, programmatic dependent launch, the slot
    GEMM2 split by slots, the warp-specialised Gluon GEMM1."""
    import dataclasses

    from glm5_fp4.bench.moe import plan_label
    from glm5_fp4.kernels import configs as C

    def row(p):
        return dict(schedule=p.schedule, gemm1=p.gemm1.__dict__, gemm2=p.gemm2.__dict__, gemm2_n_split=p.gemm2_n_split,
                    gemm1_split_k=p.gemm1_split_k, prep_x=p.prep_x, parallel_align=p.parallel_align,
                    slot_dedup=p.slot_dedup, gemm1_fused_reduce=p.gemm1_fused_reduce, pdl=p.pdl,
                    gemm2_split_slots=p.gemm2_split_slots, dedup_fused_finalize=p.dedup_fused_finalize)

    one = C.plan("sm90", 1, 256, 8, 6144, 256, sm_count=132)
    assert plan_label(row(one)).endswith("splitK12 fused pdl slots")
    assert plan_label(row(C.plan("sm90", 1, 256, 8, 6144, 256, sm_count=132, form="one_program_gemm2"))).endswith(
        "splitK8 fused")
    four = C.plan("sm90", 4, 256, 8, 6144, 256, sm_count=132)
    assert plan_label(row(four)).endswith("splitK4 dedup pdl")
    arrive = C.plan("sm90", 4, 256, 8, 6144, 256, sm_count=132, form="dedup_by_arrival")
    assert plan_label(row(arrive)).endswith("splitK3 dedup-arrive fused pdl")
    assert "pdl" not in plan_label(row(dataclasses.replace(four, pdl=False)))
    ws = C.plan("sm90", 512, 256, 8, 6144, 256, sm_count=132, form="gemm1_ws64")
    assert plan_label(row(ws)).startswith("64x32x64mw4s8r80guws / ")
    assert "ws" not in plan_label(row(C.plan("sm90", 512, 256, 8, 6144, 256, sm_count=132))).split(" / ")[0]


def _repo(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "f.txt").write_text("a\n")
    _git(tmp_path, "add", "f.txt")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return _git(tmp_path, "log", "-1", "--format=%H")


@pytest.mark.parametrize("value", ["abc", "HEAD", "1d61d1b", "g" * 40, "a" * 41, "a" * 40 + "-dirtyish",
                                   " " + "a" * 39])
def test_an_override_that_names_no_commit_is_refused(tmp_path, monkeypatch, value):
    """The override was trusted over a readable checkout: 'abc' went into results as their commit."""
    from glm5_fp4.errors import Glm5Fp4Error

    _repo(tmp_path)
    monkeypatch.setenv("GLM5_FP4_GIT_SHA", value)
    with pytest.raises(Glm5Fp4Error) as e:
        meta.git_sha(tmp_path)
    assert "GLM5_FP4_GIT_SHA" in str(e.value) and repr(value) in str(e.value)
    outside = tmp_path.parent / f"{tmp_path.name}-not-a-repo"
    outside.mkdir()
    with pytest.raises(Glm5Fp4Error):
        meta.git_sha(outside)


def test_an_override_is_a_full_sha_or_one_the_checkout_knows(tmp_path, monkeypatch):
    """The device copy's .git is stale and does not know the commit sent: a full 40-hex SHA stands as given there; a
    short one is expanded by a checkout that knows it."""
    head = _repo(tmp_path)
    sent = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("GLM5_FP4_GIT_SHA", sent)
    assert meta.git_sha(tmp_path) == sent
    monkeypatch.setenv("GLM5_FP4_GIT_SHA", sent.upper() + "-dirty")
    assert meta.git_sha(tmp_path) == sent + "-dirty"
    monkeypatch.setenv("GLM5_FP4_GIT_SHA", head[:9])
    assert meta.git_sha(tmp_path) == head
    (tmp_path / "f.txt").write_text("b\n")  # the override names the commit sent; the local tree's state is not it
    assert meta.git_sha(tmp_path) == head
    monkeypatch.delenv("GLM5_FP4_GIT_SHA")
    assert meta.git_sha(tmp_path) == head + "-dirty"
