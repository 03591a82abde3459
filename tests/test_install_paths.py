"""What a plain `pip install glm5-fp4` gives: every user-facing command must work from the installed package, run
from any folder, not only from the checkout (its launch profiles, the write-up template, its dependencies)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from glm5_fp4.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, timeout=600)
    return zipfile.ZipFile(next(out.glob("glm5_fp4-*.whl")))


def test_the_wheel_carries_the_launch_profiles_and_the_writeup_template(wheel):
    names = set(wheel.namelist())
    for profile in ("tp8", "tp4pp2", "tp8ep8", "dp8ep8", "cpu-demo", "tp8-sglang"):
        assert f"glm5_fp4/data/launch/{profile}.yaml" in names, profile
    assert "glm5_fp4/data/launch/README.md" in names
    assert "glm5_fp4/data/improvements/TEMPLATE.md" in names
    requires = next(n for n in names if n.endswith("METADATA"))
    meta = wheel.read(requires).decode()
    core = [ln for ln in meta.splitlines() if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    for package in ("aiohttp", "tokenizers", "transformers", "matplotlib", "nvidia-ml-py"):  # commands import them
        assert any(package in ln for ln in core), (package, core)


@pytest.mark.parametrize("name", ["launch/tp8.yaml", "tp8", "tp8.yaml"])
def test_a_packaged_profile_by_name_from_any_folder(tmp_path, monkeypatch, capsys, name):
    monkeypatch.chdir(tmp_path)
    assert main(["serve", "--profile", name, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--tensor-parallel-size 8" in out
    assert str(ROOT / "glm5_fp4" / "data" / "launch" / "tp8.yaml") in out  # which file it read, said


def test_a_local_file_wins_over_the_packaged_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "launch").mkdir()
    text = (ROOT / "glm5_fp4" / "data" / "launch" / "tp8.yaml").read_text().replace("tensor_parallel: 8",
                                                                                     "tensor_parallel: 4")
    (tmp_path / "launch" / "tp8.yaml").write_text(text)
    assert main(["serve", "--profile", "launch/tp8.yaml", "--dry-run"]) == 0
    assert "--tensor-parallel-size 4" in capsys.readouterr().out


def test_an_unknown_profile_lists_the_packaged_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--profile", "tp9"]) == 1
    err = capsys.readouterr().err
    assert "tp9: launch profile not found" in err and "tp8" in err and "tp4pp2" in err and "cpu-demo" in err, err


def test_checkout_launch_folder_is_the_packaged_one():
    assert (ROOT / "launch").resolve() == (ROOT / "glm5_fp4" / "data" / "launch").resolve()


@pytest.mark.parametrize("command,module", [(["compare", "a.json", "b.json"], "aiohttp"),
                                            (["make-checkpoint", "--out", "ck"], "tokenizers"),
                                            (["compile-matrix", "--arch", "sm120", "--defaults-only", "--out", "cm"],
                                             "triton")])
def test_a_missing_dependency_is_one_line(tmp_path, monkeypatch, capsys, command, module):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, module, None)  # import raises ModuleNotFoundError
    for name in [m for m in sys.modules if m.startswith(module + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    rc = main(command)
    err = capsys.readouterr().err
    if command[0] == "compare":  # reads two files: needs no HTTP client at all
        assert "aiohttp" not in err
        return
    assert rc == 1 and err.count("\n") == 1 and module in err and "pip install" in err, err
    assert not (tmp_path / command[-1]).exists()


def test_improvements_from_an_empty_folder(tmp_path, capsys):
    d = tmp_path / "imp"
    d.mkdir()
    assert main(["improvements", "new", "--title", "first try", "--dir", str(d)]) == 0
    assert (d / "01-first-try.md").is_file()
    readme = (d / "README.md").read_text()
    assert "first try" in readme and "index:begin" in readme
    fresh = tmp_path / "other"
    fresh.mkdir()
    assert main(["improvements", "index", "--dir", str(fresh)]) == 0
    assert "index:begin" in (fresh / "README.md").read_text()
    capsys.readouterr()
    assert main(["improvements", "index", "--dir", str(tmp_path / "missing")]) == 1
    assert "missing" in capsys.readouterr().err


def test_plan_of_a_small_model_leaves_out_default_layouts_it_cannot_split(tmp_path, capsys):
    ckpt = tmp_path / "tiny"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "hidden_size": 256, "num_hidden_layers": 4, "moe_intermediate_size": 64, "n_routed_experts": 16,
        "num_experts_per_tok": 4, "num_attention_heads": 2}))
    rc = main(["plan", "--profile", str(ROOT / "launch" / "cpu-demo.yaml"), "--config", str(ckpt / "config.json")])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "TP1" in out.out and "TP8" not in out.out.split("Assumptions:")[0]
    assert "tp8" in out.out.split("Assumptions:")[1] and "2 attention heads" in out.out, out.out
    # no layout left: one error naming the defaults and what to pass
    assert main(["plan", "--config", str(ckpt / "config.json")]) == 1
    err = capsys.readouterr().err
    assert "--layouts" in err and "tp8" in err and "tp4pp2" in err, err
    # asked for by name: still an error naming it
    assert main(["plan", "--config", str(ckpt / "config.json"), "--layouts", "tp8"]) == 1
    assert "--layouts" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_sha_of_an_install_inside_another_repo_is_none(tmp_path, monkeypatch):
    """A venv inside a user's project: `git rev-parse` from site-packages names the user's commit, not ours."""
    from glm5_fp4.bench import meta

    site = tmp_path / "project" / ".venv" / "site-packages"
    shutil.copytree(ROOT / "glm5_fp4", site / "glm5_fp4", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "init", "-q", str(tmp_path / "project")], check=True)
    subprocess.run(["git", "-C", str(tmp_path / "project"), "-c", "user.name=t", "-c", "user.email=t@t", "commit",
                    "-q", "--allow-empty", "-m", "theirs"], check=True)
    monkeypatch.delenv("GLM5_FP4_GIT_SHA", raising=False)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from glm5_fp4.bench import meta; print(meta.git_sha())")
    got = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout.strip()
    assert got == "None"
    assert meta.git_sha() is not None  # the checkout's own


def test_plan_blames_a_flag_not_the_layouts_for_what_no_layout_can_do(capsys):
    """--context past the model's longest was reported as every default layout 'left out', with --layouts tp1 as
    the advice; it is the flag's error whatever the layout."""
    assert main(["plan", "--context", "5000000"]) == 1
    err = capsys.readouterr().err
    assert "context 5000000" in err and "left out" not in err and "--layouts" not in err, err
    assert main(["plan", "--layouts", "tp8", "--context", "5000000"]) == 1
    assert "--layouts tp8" not in capsys.readouterr().err


def test_a_missing_submodule_of_an_installed_package_is_not_called_a_missing_package():
    """A vLLM submodule another version lacks read as 'vllm is not installed here: pip install vllm'; the
    traceback and the module's real name were lost."""
    from glm5_fp4.cli import _missing_dependency

    assert _missing_dependency(ModuleNotFoundError("x", name="json.no_such_submodule")) is None
    said = _missing_dependency(ModuleNotFoundError("x", name="surely_not_installed_pkg.sub"))
    assert "surely_not_installed_pkg" in said and "pip install" in said
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # the engines' pins live in pyproject's extras
        assert "glm5-fp4[vllm]" in _missing_dependency(ModuleNotFoundError("x", name="vllm"))
