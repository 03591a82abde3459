"""Tiny checkpoints: layout of nvidia/GLM-5-NVFP4, round trip, determinism, transformers compatibility, inspect."""

import json
import re
import struct

import pytest
import torch
from safetensors.torch import load_file

from glm5_fp4 import nvfp4
from glm5_fp4.checkpoint.configs import build_config
from glm5_fp4.checkpoint.inspect import inspect_checkpoint
from glm5_fp4.checkpoint.make import _draw, make_checkpoint, model_tensors
from glm5_fp4.cli import main
from glm5_fp4.errors import Glm5Fp4Error

SMALL = {"n_routed_experts": 8, "num_hidden_layers": 2}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "glm5": make_checkpoint(root / "glm5", "glm5", seed=3, sizes=SMALL),
        "glm5_bf16": make_checkpoint(root / "glm5_bf16", "glm5", seed=3, dequantized=True, sizes=SMALL),
        "glm5_dense": make_checkpoint(root / "glm5_dense", "glm5", seed=3, dense_attention=True, sizes=SMALL),
        "glm4moe": make_checkpoint(root / "glm4moe", "glm4moe", seed=3, sizes=SMALL),
    }


def _hf_names(model) -> dict[str, tuple]:
    """transformers keeps experts fused in memory; expand them to the per-expert names checkpoints use."""
    out = {}
    for name, t in model.state_dict().items():
        m = re.match(r"(.*mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if not m:
            out[name] = tuple(t.shape)
            continue
        for e in range(t.shape[0]):
            if m[2] == "gate_up_proj":
                half = t.shape[1] // 2
                out[f"{m[1]}.{e}.gate_proj.weight"] = (half, t.shape[2])
                out[f"{m[1]}.{e}.up_proj.weight"] = (half, t.shape[2])
            else:
                out[f"{m[1]}.{e}.down_proj.weight"] = tuple(t.shape[1:])
    return out


@pytest.mark.parametrize("arch", ["glm5", "glm4moe"])
def test_names_and_shapes_match_transformers_model(ckpts, arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(ckpts[f"{arch}"])
    assert cfg.architectures == [{"glm5": "GlmMoeDsaForCausalLM", "glm4moe": "Glm4MoeForCausalLM"}[arch]]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    expected = _hf_names(model)
    bf16 = load_file(str(ckpts[f"{arch}"].parent / ("glm5_bf16" if arch == "glm5" else "glm4moe") / "model.safetensors"))
    if arch == "glm5":
        assert {k: tuple(v.shape) for k, v in bf16.items()} == expected
    quant = load_file(str(ckpts[arch] / "model.safetensors"))
    weights = {k for k in quant if k.endswith(".weight") or k.endswith(".bias") or k.endswith("_bias")}
    assert weights == set(expected)


def test_nvfp4_tensors_follow_modelopt_layout(ckpts):
    t = load_file(str(ckpts["glm5"] / "model.safetensors"))
    p = "model.layers.1.mlp.experts.5"
    assert t[f"{p}.up_proj.weight"].dtype == torch.uint8 and t[f"{p}.up_proj.weight"].shape == (128, 128)
    assert t[f"{p}.up_proj.weight_scale"].dtype == torch.float8_e4m3fn and t[f"{p}.up_proj.weight_scale"].shape == (128, 16)
    assert t[f"{p}.down_proj.weight"].shape == (256, 64) and t[f"{p}.down_proj.weight_scale"].shape == (256, 8)
    assert t[f"{p}.gate_proj.weight_scale_2"].shape == () and t[f"{p}.gate_proj.weight_scale_2"].dtype == torch.float32
    assert t[f"{p}.gate_proj.input_scale"].shape == () and t[f"{p}.gate_proj.input_scale"].dtype == torch.float32
    # ModelOpt shares the global scale of gate and up so engines can fuse them.
    assert t[f"{p}.gate_proj.weight_scale_2"] == t[f"{p}.up_proj.weight_scale_2"]
    assert t["model.layers.0.mlp.gate_proj.weight"].dtype == torch.uint8  # dense MLP is NVFP4 too
    assert t["model.layers.1.mlp.shared_experts.down_proj.weight"].dtype == torch.uint8
    assert t["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16  # attention stays BF16
    assert t["model.layers.1.self_attn.indexer.wk.weight"].dtype == torch.bfloat16
    assert t["lm_head.weight"].dtype == torch.bfloat16
    hq = json.loads((ckpts["glm5"] / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "NVFP4" and hq["group_size"] == 16
    assert "lm_head" in hq["exclude_modules"] and "model.layers.1.self_attn.indexer*" in hq["exclude_modules"]
    qc = json.loads((ckpts["glm5"] / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["ignore"] == hq["exclude_modules"]


def test_dequantized_round_trip_within_bound_and_twin_exact(ckpts):
    cfg = build_config("glm5", SMALL)
    specs = {s.name: s for s in model_tensors(cfg)}
    quant = load_file(str(ckpts["glm5"] / "model.safetensors"))
    twin = load_file(str(ckpts["glm5_bf16"] / "model.safetensors"))
    assert not (ckpts["glm5_bf16"] / "hf_quant_config.json").exists()
    assert "quantization_config" not in json.loads((ckpts["glm5_bf16"] / "config.json").read_text())
    checked = 0
    for name, spec in specs.items():
        if not spec.quantized:
            assert torch.equal(quant[name], twin[name]), name
            continue
        base = name[:-len(".weight")]
        deq = nvfp4.dequantize(quant[name], quant[f"{base}.weight_scale"], quant[f"{base}.weight_scale_2"], torch.float32)
        assert torch.equal(deq.to(torch.bfloat16), twin[name]), name
        source = _draw(spec, seed=3)
        rel = (deq - source).norm() / source.norm()
        assert rel < 0.15, f"{name}: relative error {rel:.3f} beyond NVFP4's"
        checked += 1
    assert checked == 3 * (8 * 1 + 1 + 1)


def test_deterministic_for_a_seed(tmp_path):
    a = make_checkpoint(tmp_path / "a", "glm4moe", seed=7, sizes=SMALL)
    b = make_checkpoint(tmp_path / "b", "glm4moe", seed=7, sizes=SMALL)
    c = make_checkpoint(tmp_path / "c", "glm4moe", seed=8, sizes=SMALL)
    for f in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_dense_attention_view(ckpts):
    from transformers import AutoConfig

    cfg = json.loads((ckpts["glm5_dense"] / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert not any(k.startswith("index") for k in cfg) and "layer_types" not in cfg
    assert cfg["kv_lora_rank"] == 512 and cfg["qk_rope_head_dim"] == 64
    assert (ckpts["glm5_dense"] / "model.safetensors").read_bytes() == (ckpts["glm5"] / "model.safetensors").read_bytes()
    AutoConfig.from_pretrained(ckpts["glm5_dense"])
    assert any("dense-attention" in n for n in inspect_checkpoint(ckpts["glm5_dense"]).notes)


def test_tokenizer_covers_vocab_and_has_chat_template(ckpts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpts["glm5"])
    assert len(tok) == 2048
    cfg = json.loads((ckpts["glm5"] / "config.json").read_text())
    assert cfg["eos_token_id"] == tok.eos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    assert "<|user|>" in text and text.endswith("<|assistant|>\n")
    assert tok.decode(tok.encode("the model streams weights")) == "the model streams weights"


def test_inspect_summary(ckpts, capsys):
    r = inspect_checkpoint(ckpts["glm5"], require_nvfp4=True)
    assert r.quant_algo == "NVFP4" and r.routed_experts == 8 and len(r.moe_layers) == 1
    assert r.quantized_linears == 3 * (8 + 1 + 1)
    assert r.bytes_by_dtype["U8"] == sum(
        t.numel() for k, t in load_file(str(ckpts["glm5"] / "model.safetensors")).items() if t.dtype == torch.uint8)
    assert main(["inspect", str(ckpts["glm5"])]) == 0
    assert "NVFP4" in capsys.readouterr().out
    with pytest.raises(Glm5Fp4Error, match="not an NVFP4 checkpoint"):
        inspect_checkpoint(ckpts["glm5_bf16"], require_nvfp4=True)
    for kind in ("glm5_bf16", "glm5_dense", "glm4moe"):  # complete: every tensor the config implies is there
        inspect_checkpoint(ckpts[kind], require_nvfp4=kind != "glm5_bf16")


def _rewrite_tensor(path, name, new):
    t = load_file(str(path))
    t[name] = new
    from safetensors.torch import save_file
    save_file(t, str(path))


def test_inspect_names_bad_tensor(tmp_path, capsys):
    ck = make_checkpoint(tmp_path / "bad", "glm4moe", seed=1, sizes=SMALL)
    f = ck / "model.safetensors"
    _rewrite_tensor(f, "model.layers.1.mlp.experts.3.down_proj.weight_scale", torch.zeros(256, 4, dtype=torch.float8_e4m3fn))
    with pytest.raises(Glm5Fp4Error, match=r"experts\.3\.down_proj\.weight_scale is F8_E4M3 \[256, 4\], expected F8_E4M3 \[256, 8\]"):
        inspect_checkpoint(ck)
    assert main(["inspect", str(ck)]) == 1
    assert "experts.3.down_proj.weight_scale" in capsys.readouterr().err
    t = load_file(str(f))
    del t["model.layers.1.mlp.experts.7.gate_proj.weight"]
    from safetensors.torch import save_file
    save_file(t, str(f))
    with pytest.raises(Glm5Fp4Error):
        inspect_checkpoint(ck)


def test_inspect_truncated_file(tmp_path):
    ck = make_checkpoint(tmp_path / "trunc", "glm4moe", seed=1, sizes=SMALL)
    f = ck / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(Glm5Fp4Error, match="truncated"):
        inspect_checkpoint(ck)
    f.write_bytes(struct.pack("<Q", 10) + b"{garbage!!")
    with pytest.raises(Glm5Fp4Error, match="corrupt"):
        inspect_checkpoint(ck)


def test_make_checkpoint_errors(tmp_path):
    make_checkpoint(tmp_path / "x", "glm4moe", sizes=SMALL)
    with pytest.raises(Glm5Fp4Error, match="not empty"):
        make_checkpoint(tmp_path / "x", "glm4moe", sizes=SMALL)
    with pytest.raises(Glm5Fp4Error, match="unknown size field"):
        make_checkpoint(tmp_path / "y", "glm5", sizes={"hiden_size": 64})
    with pytest.raises(Glm5Fp4Error, match="dense-attention"):
        make_checkpoint(tmp_path / "z", "glm4moe", dense_attention=True)
    assert main(["make-checkpoint", "--out", str(tmp_path / "w"), "--size", "oops"]) == 1


def test_device_fast_path(tmp_path, capsys):
    """``--device``: drawn and quantized there, written from CPU tensors; a device this machine lacks is named."""
    if torch.cuda.is_available():
        ckpt = make_checkpoint(tmp_path / "gpu", "glm5", seed=3, sizes=SMALL, device="cuda")
        twin = make_checkpoint(tmp_path / "gpu_bf16", "glm5", seed=3, sizes=SMALL, device="cuda", dequantized=True)
        assert inspect_checkpoint(ckpt, require_nvfp4=True).quantized_linears  # valid ModelOpt NVFP4
        quant, bf16 = load_file(str(ckpt / "model.safetensors")), load_file(str(twin / "model.safetensors"))
        for name, spec in {s.name: s for s in model_tensors(build_config("glm5", SMALL))}.items():
            if spec.quantized:
                base = name[:-len(".weight")]
                deq = nvfp4.dequantize(quant[name], quant[f"{base}.weight_scale"], quant[f"{base}.weight_scale_2"])
                assert torch.equal(deq.to(torch.bfloat16), bf16[name]), name
        return
    assert main(["make-checkpoint", "--out", str(tmp_path / "c"), "--device", "cuda"]) == 1
    err = capsys.readouterr().err
    assert "--device 'cuda' is not usable here" in err and "Traceback" not in err
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_sharded_output(tmp_path):
    from glm5_fp4.checkpoint import make as mk

    cfg = build_config("glm4moe", SMALL)
    specs = model_tensors(cfg)
    out = tmp_path / "sharded"
    out.mkdir()
    mk.write_safetensors(mk.generate_tensors(cfg, 0, False, specs), out, total=1, shard_bytes=1_000_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(re.match(r"model-\d{5}-of-\d{5}\.safetensors", f) for f in files)
    loaded = {}
    for f in files:
        loaded.update(load_file(str(out / f)))
    assert set(loaded) == set(index["weight_map"])


@pytest.mark.parametrize("size,needle", [("hidden=12", "unknown size field 'hidden'"),
                                         ("hidden_size=12", "multiples of 32"),
                                         ("n_routed_experts=x", "expected FIELD=INTEGER")])
def test_make_checkpoint_bad_size_leaves_nothing_behind(tmp_path, capsys, size, needle):
    out = tmp_path / "new" / "ck"
    assert main(["make-checkpoint", "--out", str(out), "--size", size]) == 1
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_make_checkpoint_out_that_cannot_be_a_directory(tmp_path, capsys, where):
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    out = existing if where == "file" else existing / "ck"
    assert main(["make-checkpoint", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert str(existing) in err and "not a directory" in err and "Traceback" not in err
    assert existing.read_text() == "keep me"


def test_make_checkpoint_that_fails_while_writing_removes_what_it_wrote(tmp_path, monkeypatch):
    from glm5_fp4.checkpoint import make as mk

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    from glm5_fp4.errors import Glm5Fp4Error

    monkeypatch.setattr(mk, "write_safetensors", broken)
    with pytest.raises(Glm5Fp4Error, match="ck: cannot write the checkpoint \\(No space left on device\\)"):
        make_checkpoint(tmp_path / "ck", "glm4moe", sizes=SMALL)
    assert not (tmp_path / "ck").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    with pytest.raises(Glm5Fp4Error, match="No space left"):
        make_checkpoint(tmp_path / "mine", "glm4moe", sizes=SMALL, overwrite=True)
    # a directory it did not create is not removed, nor is anything written into it
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_overwrite_that_fails_leaves_the_former_checkpoint(tmp_path, monkeypatch):
    """--overwrite writes the new checkpoint beside the old one and moves it in only when whole: a write that fails
    (a full disk) leaves every former file as it was and no scratch directory (before: the new config and tokenizer
    beside the former weights, which `inspect` passed), with one error; a later overwrite replaces the files and
    removes an earlier checkpoint's weight shards that the new one does not have."""
    from safetensors import SafetensorError

    from glm5_fp4.checkpoint import make as M
    from glm5_fp4.errors import Glm5Fp4Error

    ck = make_checkpoint(tmp_path / "ck", "glm4moe", seed=1, sizes=SMALL)
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    real = M.save_file

    def full_disk(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")

    monkeypatch.setattr(M, "save_file", full_disk)
    with pytest.raises(Glm5Fp4Error, match="cannot write the checkpoint .*File too large.*nothing of it"):
        make_checkpoint(ck, "glm4moe", seed=2, sizes=SMALL, overwrite=True)
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]

    monkeypatch.setattr(M, "save_file", real)
    (ck / "model-00002-of-00002.safetensors").write_bytes(b"stale shard")
    make_checkpoint(ck, "glm4moe", seed=2, sizes=SMALL, overwrite=True)
    after = {p.name: p.read_bytes() for p in ck.iterdir()}
    assert set(after) == set(before) and after["config.json"] == before["config.json"]
    assert after["model.safetensors"] != before["model.safetensors"]  # seed 2's weights


def test_a_bf16_twin_written_over_an_nvfp4_checkpoint_leaves_no_quantizer_config(tmp_path):
    """--overwrite with --dequantized over an NVFP4 checkpoint: the former hf_quant_config.json goes too (a loader
    reads it first: the BF16 twin would read as NVFP4); the scratch directory lives inside --out (one file system,
    also where --out is a mount point) and is gone afterwards."""
    ck = make_checkpoint(tmp_path / "ck", "glm4moe", seed=1, sizes=SMALL)
    assert (ck / "hf_quant_config.json").is_file()
    make_checkpoint(ck, "glm4moe", seed=1, sizes=SMALL, dequantized=True, overwrite=True)
    assert not (ck / "hf_quant_config.json").exists()
    assert inspect_checkpoint(ck).quant_algo is None
    assert not [p for p in ck.iterdir() if p.name.startswith(".")]
