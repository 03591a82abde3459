"""One config check shared by make-checkpoint (before writing) and inspect (on what it reads): a checkpoint no
engine can build is refused by both, with one error naming the field; inspect also refuses ambiguous shards."""

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm5_fp4.checkpoint.make import make_checkpoint
from glm5_fp4.cli import main

SMALL = {"n_routed_experts": 4, "num_hidden_layers": 2, "hidden_size": 128, "vocab_size": 512}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("valid") / "ck", "glm5", seed=1, sizes=SMALL)


def _copy(made, tmp_path):
    return Path(shutil.copytree(made, tmp_path / "ck"))


@pytest.mark.parametrize(
    "size, culprit",
    [
        ("num_experts_per_tok=64", "num_experts_per_tok 64 is more than n_routed_experts 16"),
        ("first_k_dense_replace=10", "first_k_dense_replace 10 leaves no MoE layer"),
        ("vocab_size=1", "vocab_size 1 is smaller than the tokenizer's"),
        ("hidden_size=0", "'hidden_size' is 0"),
        ("num_hidden_layers=0", "'num_hidden_layers' is 0"),
    ],
)
def test_make_checkpoint_refuses_unservable_sizes_before_writing(tmp_path, capsys, size, culprit):
    out = tmp_path / "new" / "ck"
    assert main(["make-checkpoint", "--out", str(out), "--size", size]) == 1
    err = capsys.readouterr().err
    assert culprit in err and "Traceback" not in err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "edit, culprit",
    [
        ({"num_experts_per_tok": 64}, "num_experts_per_tok 64 is more than n_routed_experts 4"),
        ({"first_k_dense_replace": 10}, "first_k_dense_replace 10"),
        ({"num_hidden_layers": "2"}, "'num_hidden_layers' is '2', expected an integer"),
        ({"vocab_size": 100}, "vocab_size 100 is smaller than the tokenizer's 512 ids"),
        # fields inspect reads besides the shapes (review of 2026-12-07: tracebacks, or "false" read as true)
        ({"num_nextn_predict_layers": "abc"}, "'num_nextn_predict_layers' is 'abc', expected an integer"),
        ({"num_nextn_predict_layers": [1]}, "'num_nextn_predict_layers' is [1], expected an integer"),
        ({"num_nextn_predict_layers": -2}, "'num_nextn_predict_layers' is -2, expected an integer >= 0"),
        ({"tie_word_embeddings": "false"}, "'tie_word_embeddings' is 'false', expected true or false"),
    ],
)
def test_inspect_refuses_an_inconsistent_config(made, tmp_path, capsys, edit, culprit):
    ck = _copy(made, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    cfg.update(edit)
    (ck / "config.json").write_text(json.dumps(cfg))
    assert main(["inspect", str(ck)]) == 1
    err = capsys.readouterr().err
    assert culprit in err and "config.json" in err and "Traceback" not in err


def test_inspect_refuses_a_shard_repeating_tensors(made, tmp_path, capsys):
    ck = _copy(made, tmp_path)
    tensors = load_file(str(ck / "model.safetensors"))
    name = "model.norm.weight"
    save_file({name: tensors[name][:8].clone()}, str(ck / "a.safetensors"))  # a stale copy, wrong shape
    assert main(["inspect", str(ck)]) == 1
    err = capsys.readouterr().err
    assert name in err and "a.safetensors" in err and "model.safetensors" in err


def test_inspect_a_directory_named_like_a_shard_is_a_clear_error(made, tmp_path, capsys):
    ck = _copy(made, tmp_path)
    (ck / "model.safetensors").unlink()
    (ck / "model.safetensors").mkdir()
    assert main(["inspect", str(ck)]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "not a regular file" in err and "Traceback" not in err


def test_weights_get_the_same_mode_as_the_other_files(made):
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in made.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes
    umask = os.umask(0)
    os.umask(umask)
    assert modes["model.safetensors"] == 0o666 & ~umask


def test_scratch_left_by_a_killed_run_does_not_block_the_next(tmp_path):
    """A run killed by SIGKILL (or SIGTERM before it was handled) leaves its hidden scratch folder: the directory
    looks empty to `ls` but was refused as "not empty". Our own scratch is no one's data: it is removed and the run
    goes on; anything else still needs --overwrite."""
    out = tmp_path / "mk"
    (out / ".make-checkpoint-abc123").mkdir(parents=True)
    (out / ".make-checkpoint-abc123" / "model-00001.safetensors").write_bytes(b"partial")
    make_checkpoint(out, arch="glm4moe", sizes={"num_hidden_layers": 2})
    assert not list(out.glob(".make-checkpoint-*")) and (out / "config.json").is_file()
    other = tmp_path / "other"
    (other / ".hidden").mkdir(parents=True)
    with pytest.raises(Exception, match="not empty"):
        make_checkpoint(other, arch="glm4moe", sizes={"num_hidden_layers": 2})


def test_sigterm_leaves_nothing_behind(tmp_path):
    """`timeout` or a CI cancel sends SIGTERM: the directory the run created is removed, as for Ctrl-C."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "new" / "mk"
    proc = subprocess.Popen([sys.executable, "-m", "glm5_fp4.cli", "make-checkpoint", "--out", str(out), "--arch",
                             "glm4moe", "--size", "num_hidden_layers=40", "--size", "n_routed_experts=64"],
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(out.glob(".make-checkpoint-*/*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)  # until it is writing
    assert proc.poll() is None, "the checkpoint was written before the signal: make it bigger"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    # a shell's status for a run ended by SIGTERM, as `loadtest` gives: 143, not Ctrl-C's 130
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, (proc.returncode, err)
    assert "SIGTERM" in err, err
    assert not (tmp_path / "new").exists()


def test_scalar_scales_stored_as_one_element_vectors_pass_inspect(made, tmp_path, capsys):
    """ModelOpt writes global scales as 0-d tensors or as [1]; the plugin's loader takes both, so the pre-launch
    check must too (it refused [1] as "expected F32 []"). Any other shape is still refused."""
    ck = _copy(made, tmp_path)
    tensors = load_file(str(ck / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("mlp.experts.0.down_proj.weight_scale_2"))
    assert tensors[name].shape == ()
    tensors[name] = tensors[name].reshape(1)
    save_file(tensors, str(ck / "model.safetensors"))
    assert main(["inspect", str(ck)]) == 0, capsys.readouterr().err
    tensors[name] = tensors[name].repeat(2)
    save_file(tensors, str(ck / "model.safetensors"))
    assert main(["inspect", str(ck)]) == 1
    assert f"tensor {name} is F32 [2], expected F32 []" in capsys.readouterr().err


def test_under_nohup_a_hangup_does_not_stop_it(tmp_path):
    """`nohup glm5-fp4 make-checkpoint ... &` then logging out: SIGHUP was inherited as ignored and stays so."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "mk"
    proc = subprocess.Popen([sys.executable, "-m", "glm5_fp4.cli", "make-checkpoint", "--out", str(out), "--arch",
                             "glm4moe", "--size", "num_hidden_layers=40", "--size", "n_routed_experts=64"],
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    deadline = time.monotonic() + 120
    while not list(out.glob(".make-checkpoint-*/*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert (out / "config.json").is_file()


def _rewrite_header(path: Path, edit) -> None:
    """Rewrite a safetensors file's JSON header in place with ``edit(header)``; the data bytes stay."""
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


@pytest.mark.parametrize("damage, words", [
    ("appended", "bytes past its last tensor"),   # a botched resumed download: the loader refuses the file
    ("short_range", "holds 2 bytes"),             # offsets that disagree with shape x dtype
    ("unknown_dtype", "dtype 'F4'"),
])
def test_a_header_the_loader_would_refuse_is_refused(made, tmp_path, capsys, damage, words):
    """inspect checked only that each tensor ends inside the file; safetensors (and so the engine) also wants every
    byte accounted for, offsets that match shape x dtype, and dtypes it knows."""
    ck = _copy(made, tmp_path)
    f = ck / "model.safetensors"
    if damage == "appended":
        f.write_bytes(f.read_bytes() + b"\0" * 64)
    else:
        def edit(h):
            name = next(n for n in h if n.endswith("self_attn.o_proj.weight"))
            if damage == "short_range":
                h[name]["data_offsets"][1] = h[name]["data_offsets"][0] + 2
            else:
                h[name]["dtype"] = "F4"
        _rewrite_header(f, edit)
    assert main(["inspect", str(ck)]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors" in err and words in err and "Traceback" not in err, err


@pytest.mark.parametrize("value", [5, {"x": 1}, "GlmMoeDsaForCausalLM", [], [3]])
def test_architectures_must_be_a_list_of_names(made, tmp_path, capsys, value):
    ck = _copy(made, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["architectures"] = value
    (ck / "config.json").write_text(json.dumps(cfg))
    assert main(["inspect", str(ck)]) == 1
    err = capsys.readouterr().err
    assert "architectures" in err and "Traceback" not in err, err


@pytest.mark.parametrize("size", ["hidden_size=--32", "hidden_size=²", "hidden_size=3x"])
def test_a_size_that_is_not_an_integer_is_one_error(tmp_path, capsys, size):
    assert main(["make-checkpoint", "--out", str(tmp_path / "ck"), "--size", size]) == 1
    err = capsys.readouterr().err
    assert "--size" in err and "Traceback" not in err and not (tmp_path / "ck").exists(), err


@pytest.mark.parametrize("field, value", [("quant_algo", "FP8"), ("group_size", 32), ("ignore", ["lm_head"])])
def test_the_two_quantization_configs_must_agree(made, tmp_path, capsys, field, value):
    """inspect read hf_quant_config.json alone when it existed; vLLM reads config.json's quantization_config first.
    A config.json saying FP8 (or group 32, or another exclude list) beside an NVFP4 hf_quant_config.json passed
    --require-nvfp4. Both are read now, and one error names both files where they disagree."""
    ck = _copy(made, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"][field] = value
    (ck / "config.json").write_text(json.dumps(cfg))
    assert main(["inspect", str(ck), "--require-nvfp4"]) == 1
    err = capsys.readouterr().err
    assert "hf_quant_config.json" in err and "config.json" in err and "disagree" in err, err
    assert field.replace("ignore", "exclude") in err


def test_config_json_alone_is_the_quantization_config(made, tmp_path, capsys):
    ck = _copy(made, tmp_path)
    (ck / "hf_quant_config.json").unlink()
    assert main(["inspect", str(ck), "--require-nvfp4"]) == 0
    assert "NVFP4" in capsys.readouterr().out


@pytest.mark.parametrize("field, value, words", [
    ("moe_layer_freq", 2, "moe_layer_freq"),
    ("mlp_layer_types", ["dense", "dense"], "mlp_layer_types"),
])
def test_fields_the_engines_build_layers_from_must_agree_with_first_k_dense_replace(made, tmp_path, capsys, field,
                                                                                     value, words):
    """vLLM builds a layer's MLP from moe_layer_freq (layer_idx % freq), transformers' GlmMoeDsa from
    mlp_layer_types; inspect counted MoE layers from first_k_dense_replace alone and passed configs whose engines
    then built dense layers where the checkpoint has experts."""
    ck = _copy(made, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    cfg[field] = value
    (ck / "config.json").write_text(json.dumps(cfg))
    assert main(["inspect", str(ck)]) == 1
    err = capsys.readouterr().err
    assert words in err and "first_k_dense_replace" in err and "Traceback" not in err, err


def test_tensors_the_config_does_not_account_for_are_named(made, tmp_path, capsys):
    """A tensor no layer of the config has (a stale layer after num_hidden_layers was cut, a stray name) was
    counted into the summary without a word; vLLM's loader fails on it after loading has begun. MTP layers (past
    num_hidden_layers, within num_nextn_predict_layers) and activation / KV scales are the checkpoint's to carry."""
    ck = _copy(made, tmp_path)
    f = ck / "model.safetensors"
    t = load_file(str(f))
    t["model.layers.0.self_attn.bogus.weight"] = t["model.norm.weight"].clone()
    save_file(t, str(f), metadata={"format": "pt"})
    assert main(["inspect", str(ck)]) == 0
    out = capsys.readouterr().out
    assert "1 tensor(s) the config does not account for" in out and "self_attn.bogus.weight" in out, out


def test_input_scales_on_some_quantized_linears_only_are_refused(made, tmp_path, capsys):
    """W4A4 needs every NVFP4 linear's input_scale (the plugin refuses a partial set, but only after loading)."""
    ck = _copy(made, tmp_path)
    f = ck / "model.safetensors"
    t = load_file(str(f))
    gone = next(n for n in t if n.endswith("experts.1.down_proj.input_scale"))
    del t[gone]
    save_file(t, str(f), metadata={"format": "pt"})
    assert main(["inspect", str(ck)]) == 1
    err = capsys.readouterr().err
    assert "input_scale" in err and gone.removesuffix(".input_scale") in err, err


@pytest.mark.parametrize("suffix", ["down_proj.weight_scale_2", "gate_proj.input_scale"])
@pytest.mark.parametrize("value", [0.0, -0.5, float("nan"), float("inf")])
def test_a_global_or_input_scale_that_is_not_a_positive_number_is_refused(made, tmp_path, capsys, suffix, value):
    """Headers alone passed a checkpoint whose global scale was 0 (every weight of that expert reads as zero) or NaN
    (every output NaN): the engines load it without a word. The scalars are 4 bytes each, so inspect reads them."""
    ck = _copy(made, tmp_path)
    f = ck / "model.safetensors"
    t = load_file(str(f))
    name = next(n for n in t if n.endswith(f"experts.1.{suffix}"))
    t[name] = torch.full_like(t[name], value)
    save_file(t, str(f), metadata={"format": "pt"})
    assert main(["inspect", str(ck)]) == 1
    err = capsys.readouterr().err
    assert name in err and "model.safetensors" in err and "Traceback" not in err, err
    assert "positive" in err and str(value) in err, err


# -- review of 2026-12-07 ----------------------------------------------------------------------------------------------
def _sharded(made, tmp_path):
    """A copy of ``made`` in 5 shards with an index, written by the package's own writer."""
    from glm5_fp4.checkpoint.make import write_safetensors

    ck = _copy(made, tmp_path)
    tensors = load_file(str(ck / "model.safetensors"))
    (ck / "model.safetensors").unlink()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_safetensors(iter(tensors.items()), ck, total=len(tensors), shard_bytes=total // 5 + 1)
    assert len(list(ck.glob("*.safetensors"))) >= 3
    return ck


def test_an_unreadable_file_is_one_error_not_a_traceback(made, tmp_path, capsys, monkeypatch):
    """As a user who may not read tokenizer.json (or the folder): a PermissionError traceback."""
    import glm5_fp4.checkpoint.inspect as I

    ck = _copy(made, tmp_path)

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(I, "tokenizer_id_count", denied)
    assert main(["inspect", str(ck)]) == 1
    err = capsys.readouterr().err
    assert f"{ck / 'tokenizer.json'}: Permission denied" in err and "Traceback" not in err


def test_shard_tensors_the_index_does_not_list_are_seen(made, tmp_path, capsys):
    """vLLM loads every tensor of every indexed file: a second copy of a tensor in another shard, or a tensor the
    index does not list, passed inspect without a word (the same files without the index were refused)."""
    ck = _sharded(made, tmp_path)
    index = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]
    last = sorted(set(index.values()))[-1]
    elsewhere = next(n for n, f in index.items() if f != last)
    t = load_file(str(ck / last))
    extra = dict(t, **{"model.foo.bar": torch.zeros(3)})
    save_file(extra, str(ck / last), metadata={"format": "pt"})
    assert main(["inspect", str(ck)]) == 0
    out = capsys.readouterr().out
    assert "model.foo.bar" in out and "not listed in model.safetensors.index.json" in out
    save_file(dict(extra, **{elsewhere: torch.zeros(1)}), str(ck / last), metadata={"format": "pt"})
    assert main(["inspect", str(ck)]) == 1
    err = capsys.readouterr().err
    assert elsewhere in err and index[elsewhere] in err and last in err, err


@pytest.mark.parametrize("value", ["../other/model-00001-of-00001.safetensors", "/abs/model.safetensors",
                                   "sub/model.safetensors"])
def test_an_index_naming_files_outside_the_folder_is_refused(made, tmp_path, capsys, value):
    ck = _sharded(made, tmp_path)
    p = ck / "model.safetensors.index.json"
    doc = json.loads(p.read_text())
    name = next(iter(doc["weight_map"]))
    doc["weight_map"][name] = value
    p.write_text(json.dumps(doc))
    assert main(["inspect", str(ck)]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors.index.json" in err and repr(value) in err and "a file name in the folder" in err, err


@pytest.mark.parametrize("meta", [{"format": "pt", "step": 1000}, [1]])
def test_header_metadata_the_loader_refuses_is_refused(made, tmp_path, capsys, meta):
    ck = _copy(made, tmp_path)
    _rewrite_header(ck / "model.safetensors", lambda h: h.__setitem__("__metadata__", meta))
    assert main(["inspect", str(ck)]) == 1
    err = capsys.readouterr().err
    assert "__metadata__" in err and "string" in err and "Traceback" not in err, err


@pytest.mark.parametrize("method", ["fp8", 3, None])
def test_nvfp4_under_another_quant_method_is_refused(made, tmp_path, capsys, method):
    """vLLM reads ModelOpt NVFP4 only under a quant_method starting 'modelopt'; otherwise it takes quant_method as
    the method (fp8: Fp8 on NVFP4 bytes). inspect --require-nvfp4 passed it."""
    ck = _copy(made, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    if method is None:
        del cfg["quantization_config"]["quant_method"]
    else:
        cfg["quantization_config"]["quant_method"] = method
    (ck / "config.json").write_text(json.dumps(cfg))
    assert main(["inspect", str(ck), "--require-nvfp4"]) == 1
    err = capsys.readouterr().err
    assert "quantization_config.quant_method" in err and "modelopt" in err, err


def test_require_nvfp4_wants_an_nvfp4_linear(tmp_path, capsys):
    ck = make_checkpoint(tmp_path / "d", "glm5", seed=1, sizes=SMALL, dequantized=True)
    (ck / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["*"]}}))
    assert main(["inspect", str(ck), "--require-nvfp4"]) == 1
    assert "no NVFP4 linear" in capsys.readouterr().err


@pytest.mark.parametrize("argv, culprit", [
    (["--size", "vocab_size=1000000000"], "vocab_size 1000000000"),  # the tokenizer's fill aborted the process
    (["--size", "hidden_size=1099511627776"], "hidden_size"),         # a DefaultCPUAllocator traceback
    (["--size", "num_key_value_heads=1"], "num_key_value_heads applies to --arch glm4moe only"),
    (["--arch", "glm4moe", "--size", "index_topk=64"], "index_topk applies to --arch glm5 only"),
    (["--size", "qk_rope_head_dim=7"], "'qk_rope_head_dim' is 7, expected an even number"),
])
def test_sizes_no_machine_or_loader_takes_are_refused_before_writing(tmp_path, capsys, argv, culprit):
    """Review of 2026-12-07: a vocabulary of 1e9 aborted the process (and left a scratch folder), sizes of the other
    --arch were ignored without a word, an odd RoPE dimension made a checkpoint transformers refuses."""
    out = tmp_path / "new" / "ck"
    assert main(["make-checkpoint", "--out", str(out), *argv]) == 1
    err = capsys.readouterr().err
    assert culprit in err and "Traceback" not in err, err
    assert not (tmp_path / "new").exists()


def test_a_failed_overwrite_leaves_the_old_checkpoint_as_it_was(made, tmp_path, capsys, monkeypatch):
    """A file that could not be moved (immutable, another owner's in a sticky folder) left the old shards removed and
    half the new files in, and the error named no file: inspect then passed the mix."""
    import hashlib

    import glm5_fp4.checkpoint.make as M

    ck = _copy(made, tmp_path)

    def digest(d):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir() if p.is_file()}

    before = digest(ck)
    real = os.replace

    def replace(src, dst):
        if ck / "tokenizer_config.json" in (Path(src), Path(dst)):  # an immutable file: renamed neither way
            raise PermissionError(1, "Operation not permitted", str(src), None, str(dst))
        return real(src, dst)

    monkeypatch.setattr(M.os, "replace", replace)
    assert main(["make-checkpoint", "--out", str(ck), "--overwrite", "--dequantized", "--size",
                 "n_routed_experts=4", "--size", "num_hidden_layers=2", "--size", "hidden_size=128",
                 "--size", "vocab_size=512"]) == 1
    err = capsys.readouterr().err
    assert "tokenizer_config.json" in err and "as it was" in err, err
    assert digest(ck) == before
    assert sorted(p.name for p in ck.iterdir() if p.is_dir()) == []  # no scratch or backup left


def test_an_unlisted_tensor_in_two_shards_is_refused(made, tmp_path, capsys):
    """Review: a tensor the index does not list, held by two of its shards, took the later shard's copy silently."""
    ck = _sharded(made, tmp_path)
    files = sorted(set(json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"].values()))
    for f, n in ((files[0], 2), (files[-1], 3)):
        save_file(dict(load_file(str(ck / f)), **{"extra.weight": torch.zeros(n)}), str(ck / f),
                  metadata={"format": "pt"})
    assert main(["inspect", str(ck)]) == 1
    err = capsys.readouterr().err
    assert "extra.weight" in err and files[0] in err and files[-1] in err, err


def test_the_room_check_prices_the_checkpoint_as_written(monkeypatch, tmp_path):
    """Review: every tensor priced as BF16 refused GLM-5's true NVFP4 sizes (~411 GiB) on an 800 GiB disk."""
    import shutil as sh

    from glm5_fp4.checkpoint import make as M
    from glm5_fp4.checkpoint.configs import build_config
    from glm5_fp4.spec import Glm5Spec

    spec = Glm5Spec()
    sizes = {"hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers, "n_routed_experts": 256,
             "moe_intermediate_size": spec.moe_intermediate_size, "intermediate_size": 12288, "vocab_size": 154880}
    cfg = build_config("glm5", sizes)
    free = 800 * 1024**3
    monkeypatch.setattr(sh, "disk_usage", lambda p: sh._ntuple_diskusage(free * 2, free, free))
    monkeypatch.setattr(M.os, "sysconf", lambda k: {"SC_PHYS_PAGES": 1 << 30, "SC_PAGE_SIZE": 4096}[k])
    M._check_room(cfg, tmp_path, "cpu", dequantized=False, recipe="glm5")
    with pytest.raises(Exception, match="needs up to"):
        M._check_room(cfg, tmp_path, "cpu", dequantized=True, recipe="glm5")
