"""`serve` refuses, before anything starts: a bind address other than loopback without --allow-remote, and a
--model that is not a checkpoint directory (or a Hugging Face id)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from glm5_fp4.server_process import check_model_dir
from glm5_fp4.checkpoint.make import make_checkpoint
from glm5_fp4.cli import main as cli_main
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.loopback import is_loopback

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", arch="glm4moe", sizes={"num_hidden_layers": 2})


@pytest.mark.parametrize("host,ok", [("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("::1", True),
                                     ("[::1]", True), ("0.0.0.0", False), ("::", False), ("192.168.1.7", False),
                                     ("example.com", False)])
def test_loopback_rule(host, ok):
    assert is_loopback(host) is ok


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_a_non_loopback_host_needs_allow_remote(ckpt, capsys, host):
    assert cli_main(["serve", "--model", str(ckpt), "--host", host, "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert f"--host {host}" in err and "--allow-remote" in err and "--api-key" in err
    assert len(err.strip().splitlines()) == 1
    assert cli_main(["serve", "--model", str(ckpt), "--host", host, "--allow-remote", "--dry-run"]) == 0
    out = capsys.readouterr()
    assert f"--host {host}" in out.out and "without an API key" in out.err
    assert cli_main(["serve", "--model", str(ckpt), "--host", host, "--allow-remote", "--dry-run", "--",
                     "--api-key", "k"]) == 0
    assert "without an API key" not in capsys.readouterr().err


def test_host_after_the_double_dash_cannot_dodge_the_check(ckpt, capsys):
    assert cli_main(["serve", "--model", str(ckpt), "--dry-run", "--", "--host", "0.0.0.0"]) == 1
    assert "not after --" in capsys.readouterr().err


@pytest.mark.parametrize("via", ["profile", "flag"])
def test_a_profile_host_needs_allow_remote_too(tmp_path, capsys, via):
    profile = yaml.safe_load((ROOT / "launch" / "tp8.yaml").read_text())
    if via == "profile":
        profile["host"] = "0.0.0.0"
    path = tmp_path / "open.yaml"
    path.write_text(yaml.safe_dump(profile))
    extra = ["--host", "0.0.0.0"] if via == "flag" else []
    assert cli_main(["serve", "--profile", str(path), *extra, "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "--allow-remote" in err and (str(path) in err if via == "profile" else "--host 0.0.0.0" in err)
    assert cli_main(["serve", "--profile", str(path), *extra, "--allow-remote", "--dry-run"]) == 0


def test_a_missing_model_directory_fails_before_launch(tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "ckpt"
    t = time.monotonic()
    rc = cli_main(["serve", "--model", str(missing), "--log-file", str(tmp_path / "s.log"), "--timeout", "60"])
    assert rc == 1 and time.monotonic() - t < 5  # no engine was started to find out
    err = capsys.readouterr().err
    assert str(missing) in err and "no such directory" in err and "Repo id" not in err
    assert not (tmp_path / "s.log").exists()


@pytest.mark.parametrize("make,needle", [
    (lambda d: d.mkdir(), "no config.json"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text("{}")), "no weights"),
    (lambda d: d.write_text("x"), "is a file"),
])
def test_a_directory_that_is_not_a_checkpoint_fails_before_launch(tmp_path, capsys, make, needle):
    d = tmp_path / "model"
    make(d)
    for quantization in ("glm5_nvfp4", "none"):
        rc = cli_main(["serve", "--model", str(d), "--quantization", quantization, "--stock" if quantization == "none"
                       else "--backend=auto", "--log-file", str(tmp_path / "s.log")])
        assert rc == 1
        assert needle in capsys.readouterr().err
    assert not (tmp_path / "s.log").exists()


def test_a_profile_model_that_does_not_exist_fails_before_launch(tmp_path, capsys):
    profile = yaml.safe_load((ROOT / "launch" / "cpu-demo.yaml").read_text())
    profile["model"] = str(tmp_path / "gone")
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(profile))
    assert cli_main(["serve", "--profile", str(path), "--log-file", str(tmp_path / "s.log")]) == 1
    err = capsys.readouterr().err
    assert f"model in {path}" in err and "no such directory" in err
    assert not (tmp_path / "s.log").exists()


def test_model_check_accepts_checkpoints_and_hub_ids(ckpt, tmp_path, monkeypatch):
    # Relative paths resolve against the working directory: an empty one, since `make demo` (the README's first
    # command) leaves out/demo/tiny-glm5-nvfp4 in the checkout.
    monkeypatch.chdir(tmp_path)
    assert check_model_dir(ckpt) == ckpt
    assert check_model_dir("nvidia/GLM-5-NVFP4") is None  # left to the engine
    for bad in ("out/demo/tiny-glm5-nvfp4", "./ckpt", "ckpt"):
        with pytest.raises(Glm5Fp4Error, match="no such directory"):
            check_model_dir(bad)


@pytest.mark.parametrize("extra,msg", [(["--backend", "triton"], "--backend/--mode choose the glm5_fp4 MoE backend"),
                                       (["--mode", "w4a16"], "which --stock does not load"),
                                       ([], "add --quantization modelopt_fp4")])
def test_stock_names_what_the_user_passed(tmp_path, capsys, extra, msg):
    """--stock with our backend's options, or with the plugin's quantization left at its default: the error names
    the user's flags (before: '--quantization glm5_nvfp4 needs the plugin', a flag the user did not pass)."""
    rc = cli_main(["serve", "--model", str(tmp_path), "--stock", "--dry-run", *extra])
    err = capsys.readouterr().err
    assert rc == 1 and msg in err, err


@pytest.mark.parametrize("extra,flag,field", [(["--host", "0.0.0.0"], "--host", "host"),
                                              (["--max-num-seqs", "8"], "--max-num-seqs", "max_concurrency")])
def test_a_profile_flag_after_the_double_dash_is_blamed_on_the_command_line(tmp_path, capsys, extra, flag, field):
    """A flag the profile sets, given after `--`, came from the command line: the error says so and names what to use,
    instead of blaming the YAML file's extra_args."""
    assert cli_main(["serve", "--profile", str(ROOT / "launch" / "tp8.yaml"), "--dry-run", "--", *extra]) == 1
    err = capsys.readouterr().err
    assert f"{flag} after --" in err and f"field {field!r}" in err and "extra_args repeats" not in err, err


@pytest.mark.parametrize("value", ['"triton"', "3", "[1]"])
def test_our_additional_config_must_be_an_object(ckpt, capsys, value):
    rc = cli_main(["serve", "--model", str(ckpt), "--dry-run", "--", "--additional-config", f'{{"glm5_fp4": {value}}}'])
    err = capsys.readouterr().err
    assert rc == 1 and "'glm5_fp4' must be an object" in err and "Traceback" not in err, err


def test_our_backend_in_additional_config_is_not_silently_replaced(ckpt, capsys):
    """`serve -- --additional-config '{"glm5_fp4": {"backend": "triton"}}'` without --backend used to run --backend's
    default (auto) without a word; now no flag means the config's value runs, a flag that disagrees with it is
    refused, one that agrees is kept."""
    extra = ["--", "--additional-config", '{"glm5_fp4": {"backend": "dequant"}}']
    assert cli_main(["serve", "--model", str(ckpt), "--dry-run", *extra]) == 0
    assert '"backend":"dequant"' in capsys.readouterr().out
    assert cli_main(["serve", "--model", str(ckpt), "--backend", "triton", "--dry-run", *extra]) == 1
    err = capsys.readouterr().err
    assert "glm5_fp4.backend 'dequant'" in err and "--backend dequant" in err, err
    assert cli_main(["serve", "--model", str(ckpt), "--backend", "dequant", "--dry-run", *extra]) == 0
    assert '"backend":"dequant"' in capsys.readouterr().out


def test_serve_refuses_a_bad_environment_before_launching(ckpt, capsys, monkeypatch):
    """A GLM5_FP4_* value the plugin cannot read (GLM5_FP4_NATIVE_FP4=false switched the native path on) is named
    before any server starts, with every bad one at once; a likely misspelling is named with what it may mean."""
    monkeypatch.setenv("GLM5_FP4_WARMUP", "nope")
    monkeypatch.setenv("GLM5_FP4_SLOW_CALL_MS", "fast")
    assert cli_main(["serve", "--model", str(ckpt), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "GLM5_FP4_WARMUP='nope'" in err and "GLM5_FP4_SLOW_CALL_MS='fast'" in err
    monkeypatch.delenv("GLM5_FP4_WARMUP")
    monkeypatch.delenv("GLM5_FP4_SLOW_CALL_MS")
    monkeypatch.setenv("GLM5_FP4_WARMPU", "0")
    assert cli_main(["serve", "--model", str(ckpt), "--dry-run"]) == 0
    assert "GLM5_FP4_WARMPU (did you mean GLM5_FP4_WARMUP?)" in capsys.readouterr().err


def test_the_vllm_plugin_resolves_the_environment_where_it_resolves_its_settings(monkeypatch):
    """vLLM reads the settings when it builds our MoE method (before loading): a bad flag stops it there too."""
    from glm5_fp4.engines.vllm import settings as vs
    from glm5_fp4.errors import Glm5Fp4Error

    monkeypatch.setenv("GLM5_FP4_LAYER_TIMERS", "2")
    with pytest.raises(Glm5Fp4Error, match="GLM5_FP4_LAYER_TIMERS='2'"):
        vs.current()
    monkeypatch.setenv("GLM5_FP4_LAYER_TIMERS", "1")
    assert vs.current().backend == "auto"


def test_serve_takes_the_backend_from_the_environment_when_no_flag_names_it(ckpt, capsys, monkeypatch):
    """`GLM5_FP4_BACKEND=reference glm5-fp4 serve` launched with --additional-config backend "auto" (the flag's
    default), which beats the environment in the plugin: the variable was dropped without a word. The flag, else the
    variable, now goes into --additional-config, so the printed command is what runs (and vLLM's compile hash sees
    it)."""
    monkeypatch.setenv("GLM5_FP4_BACKEND", "reference")
    monkeypatch.setenv("GLM5_FP4_MODE", "w4a16")
    assert cli_main(["serve", "--model", str(ckpt), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert '"backend":"reference"' in out and '"mode":"w4a16"' in out
    assert cli_main(["serve", "--model", str(ckpt), "--backend", "dequant", "--dry-run"]) == 0
    assert '"backend":"dequant"' in capsys.readouterr().out


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_profile_launch_says_which_backend_runs_on_both_engines(engine, capsys, monkeypatch):
    """The same profile and shell gave vLLM the profile's "auto" but let SGLang inherit the shell's
    GLM5_FP4_BACKEND (its command set the variable only for a non-auto value): an A/B of the engines ran two
    backends. The profile's options are now spelled out for both, and a shell value they override is named."""
    from pathlib import Path

    monkeypatch.setenv("GLM5_FP4_BACKEND", "reference")
    profile = Path(__file__).resolve().parents[1] / "launch" / "tp8.yaml"
    assert cli_main(["serve", "--profile", str(profile), "--engine", engine, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    if engine == "vllm":
        assert '"backend":"auto"' in out
    else:
        assert "GLM5_FP4_BACKEND=auto" in out
    assert "GLM5_FP4_BACKEND=reference" in err and "glm5_fp4.backend" in err


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_one_profile_runs_one_backend_on_both_engines(tmp_path, capsys, engine):
    """tp8.yaml + env {GLM5_FP4_BACKEND: reference, GLM5_FP4_MODE: w4a16} with --mode w4a4: vLLM ran auto/w4a4
    (--additional-config), SGLang reference/w4a16 (env over the generated variables), without a warning."""
    profile = yaml.safe_load((ROOT / "launch" / "tp8.yaml").read_text())
    profile["env"] = {"GLM5_FP4_BACKEND": "reference", "GLM5_FP4_MODE": "w4a16"}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(profile))
    rc = cli_main(["serve", "--profile", str(path), "--engine", engine, "--mode", "w4a4", "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 1 and str(path) in err and "GLM5_FP4_BACKEND" in err and "glm5_fp4: {backend: ...}" in err, err


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("flag,value", [("--backend", "auto"), ("--mode", "auto")])
def test_backend_and_mode_auto_override_the_profile(tmp_path, capsys, engine, flag, value):
    """`--backend auto` / `--mode auto` were dropped as if not given, so a profile's triton/w4a4 ran instead."""
    profile = yaml.safe_load((ROOT / "launch" / "tp8.yaml").read_text())
    profile["glm5_fp4"] = {"backend": "triton", "mode": "w4a4"}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(profile))
    assert cli_main(["serve", "--profile", str(path), "--engine", engine, flag, value, "--dry-run"]) == 0
    out = capsys.readouterr().out
    backend, mode = ("auto", "w4a4") if flag == "--backend" else ("triton", "auto")
    if engine == "vllm":
        assert f'"glm5_fp4":{{"backend":"{backend}","mode":"{mode}"}}' in out, out
    else:
        assert f"GLM5_FP4_BACKEND={backend} GLM5_FP4_MODE={mode}" in out, out


@pytest.mark.parametrize("via", ["flag", "profile-vllm", "profile-sglang"])
def test_a_model_path_too_long_for_the_os_is_named_not_a_traceback(tmp_path, capsys, via):
    """Path(model).is_dir() raised OSError (ENAMETOOLONG) for a 300-character name."""
    model = "/tmp/" + "m" * 300
    if via == "flag":
        argv = ["serve", "--model", model, "--dry-run"]
    else:
        path = tmp_path / "p.yaml"
        path.write_text(yaml.safe_dump({"model": model, "engine": via.split("-")[1]}))
        argv = ["serve", "--profile", str(path), "--dry-run"]
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    where = "--model" if via == "flag" else f"model in {tmp_path / 'p.yaml'}"
    assert where in err and "File name too long" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
