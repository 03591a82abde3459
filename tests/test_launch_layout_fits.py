"""A profile's layout against the model and the GPUs it will run on, checked before any engine starts.

vLLM refuses a tensor-parallel size that does not divide the attention heads only once its workers are up (minutes
into a GLM-5 start), and a layout wider than the visible GPUs hangs in placement; `serve` (its dry run included) and
`plan` say so at once, naming the profile and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glm5_fp4.cli import main

LAUNCH = Path(__file__).resolve().parents[1] / "launch"


def _profile(tmp_path: Path, name: str = "p.yaml", **fields) -> Path:
    text = (LAUNCH / "tp8.yaml").read_text()
    for key, value in fields.items():
        lines = [ln for ln in text.splitlines() if not ln.startswith(f"{key}:")]
        text = "\n".join(lines + [f"{key}: {value}"]) + "\n"
    path = tmp_path / name
    path.write_text(text)
    return path


def _checkpoint(tmp_path: Path, heads: int, layers: int = 4) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 256,
        "num_hidden_layers": layers, "moe_intermediate_size": 64, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "num_attention_heads": heads}))
    (ckpt / "model.safetensors").write_bytes(b"")
    return ckpt


@pytest.mark.parametrize("command", [["serve", "--dry-run"], ["plan"]])
def test_tensor_parallel_that_does_not_divide_the_heads_is_refused(tmp_path, capsys, command):
    profile = _profile(tmp_path, tensor_parallel=7)
    rc = main([command[0], "--profile", str(profile), *command[1:]])
    err = capsys.readouterr().err
    assert rc == 1
    assert str(profile) in err and "'tensor_parallel'" in err and "64 attention heads" in err, err
    assert "built-in" in err  # the hub id is not here: GLM-5's own dimensions were used, and it says so


def test_a_local_checkpoint_is_checked_with_its_own_heads(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path, heads=4)
    bad = _profile(tmp_path, "bad.yaml", model=str(ckpt), tensor_parallel=8)
    assert main(["serve", "--profile", str(bad), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "'tensor_parallel'" in err and "4 attention heads" in err and str(ckpt / "config.json") in err, err
    good = _profile(tmp_path, "good.yaml", model=str(ckpt), tensor_parallel=4)
    assert main(["serve", "--profile", str(good), "--dry-run"]) == 0


def test_more_pipeline_stages_than_layers_is_refused(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path, heads=8, layers=2)
    profile = _profile(tmp_path, model=str(ckpt), tensor_parallel=1, pipeline_parallel=4)
    assert main(["serve", "--profile", str(profile), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "'pipeline_parallel'" in err and "2 layers" in err and str(profile) in err, err


def test_a_model_override_is_blamed_on_the_flag(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path, heads=4)
    assert main(["serve", "--profile", str(LAUNCH / "tp8.yaml"), "--model", str(ckpt), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "--model" in err and "'tensor_parallel'" in err and "4 attention heads" in err, err


def test_a_layout_wider_than_the_visible_gpus(tmp_path, capsys, monkeypatch):
    import glm5_fp4.launch.serve as serve

    monkeypatch.setattr(serve, "visible_gpu_count", lambda: 2)
    started = []
    monkeypatch.setattr(serve, "start", lambda *a, **k: started.append(a))
    profile = _profile(tmp_path)  # TP8
    assert main(["serve", "--profile", str(profile)]) == 1
    err = capsys.readouterr().err
    assert "8 GPUs" in err and "2" in err and str(profile) in err and not started, err
    # a dry run only prints the command (it may be meant for another machine): a warning, not a refusal
    assert main(["serve", "--profile", str(profile), "--dry-run"]) == 0
    assert "warning" in capsys.readouterr().err


def test_gpu_count_unknown_or_enough_starts(tmp_path, monkeypatch, capsys):
    import glm5_fp4.launch.serve as serve

    for count in (None, 8, 16):
        monkeypatch.setattr(serve, "visible_gpu_count", lambda c=count: c)
        assert main(["serve", "--profile", str(_profile(tmp_path)), "--dry-run"]) == 0
        assert "warning" not in capsys.readouterr().err


def test_visible_gpu_count_follows_cuda_visible_devices(monkeypatch):
    from glm5_fp4.telemetry.fake_nvml import FakeNvml
    from glm5_fp4.telemetry.nvml_reader import visible_gpu_count

    nvml = FakeNvml(n_gpus=4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpu_count(nvml) == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert visible_gpu_count(nvml) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,7,0")  # CUDA stops at the first unknown entry
    assert visible_gpu_count(nvml) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "9")
    assert visible_gpu_count(nvml) == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-0f1e")  # MIG instances: not countable here
    assert visible_gpu_count(nvml) is None


def test_visible_gpu_count_without_nvml_is_unknown():
    from glm5_fp4.telemetry.nvml_reader import visible_gpu_count

    from glm5_fp4.telemetry.fake_nvml import FakeNvml

    assert visible_gpu_count(FakeNvml(init_error="Driver Not Loaded")) is None


ADDITIONAL = '{"glm5_fp4": {"backend": "dequant"}}'


def test_our_options_in_a_profiles_additional_config_are_refused_as_such(tmp_path, capsys):
    """The backend options have one home in a profile, its glm5_fp4 field (both engines get it); an
    --additional-config carrying them was blamed on --backend, a flag the user never gave."""
    profile = _profile(tmp_path, extra_args=json.dumps(["--additional-config", ADDITIONAL]))
    assert main(["serve", "--profile", str(profile), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert f"{profile}: extra_args" in err and "glm5_fp4" in err and "but --backend is" not in err, err
    assert main(["serve", "--profile", str(LAUNCH / "tp8.yaml"), "--dry-run", "--", f"--additional-config={ADDITIONAL}"]) == 1
    err = capsys.readouterr().err
    assert "after --" in err and str(LAUNCH / "tp8.yaml") + ": extra_args" not in err, err
    # other keys of --additional-config pass, merged with ours
    other = _profile(tmp_path, "other.yaml", extra_args=json.dumps(["--additional-config", '{"other": 1}']))
    assert main(["serve", "--profile", str(other), "--dry-run"]) == 0
    assert '"other":1' in capsys.readouterr().out


@pytest.mark.parametrize("engine,extra", [("vllm", ["--nnodes", "2"]), ("vllm", ["-n2"]),
                                          ("vllm", ["--distributed-executor-backend", "ray"]),
                                          ("vllm", ["--data-parallel-size-local", "4"]),
                                          ("sglang", ["--nnodes", "2"]), ("sglang", ["--dist-init-addr", "h:5000"])])
def test_a_layout_spread_over_nodes_is_not_counted_against_this_one(tmp_path, monkeypatch, engine, extra):
    """The GPUs of other nodes (vLLM --nnodes / Ray, SGLang --nnodes) are not visible here: no refusal."""
    import glm5_fp4.launch.serve as serve

    monkeypatch.setattr(serve, "visible_gpu_count", lambda: 8)
    monkeypatch.setattr(serve, "install_stop_signals", lambda: None)
    monkeypatch.setattr(serve, "start", lambda *a, **k: (_ for _ in ()).throw(SystemExit(7)))
    profile = _profile(tmp_path, engine=engine, pipeline_parallel=2)  # 16 GPUs
    with pytest.raises(SystemExit) as stopped:  # got as far as starting the engine
        main(["serve", "--profile", str(profile), "--", *extra])
    assert stopped.value.code == 7


def test_a_gpu_nvml_cannot_name_is_no_count(monkeypatch):
    """A UUID lookup that failed read as 'no such GPU': CUDA_VISIBLE_DEVICES of 4 UUIDs counted 1, and serve
    refused a launch that would have run."""
    from glm5_fp4.telemetry.fake_nvml import FakeNvml, FakeNvmlError
    from glm5_fp4.telemetry.nvml_reader import visible_gpu_count

    class Flaky(FakeNvml):
        def nvmlDeviceGetUUID(self, h):
            if h == 1:
                raise FakeNvmlError(999, "Unknown Error")
            return super().nvmlDeviceGetUUID(h)

    nvml = Flaky(n_gpus=4)
    uuids = [FakeNvml(n_gpus=4).nvmlDeviceGetUUID(i) for i in range(4)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(uuids))
    assert visible_gpu_count(nvml) is None


def test_a_single_node_executor_backend_still_counts_the_gpus(tmp_path, monkeypatch, capsys):
    import glm5_fp4.launch.serve as serve

    monkeypatch.setattr(serve, "visible_gpu_count", lambda: 2)
    profile = _profile(tmp_path)
    assert main(["serve", "--profile", str(profile), "--", "--distributed-executor-backend", "mp"]) == 1
    assert "8 GPUs" in capsys.readouterr().err


def test_dotted_additional_config_of_our_options_is_told_the_profile_way(capsys):
    assert main(["serve", "--profile", str(LAUNCH / "tp8.yaml"), "--dry-run", "--",
                 "--additional-config.glm5_fp4.backend=triton"]) == 1
    err = capsys.readouterr().err
    assert "after --" in err and "glm5_fp4 field" in err and "one JSON object" not in err, err
