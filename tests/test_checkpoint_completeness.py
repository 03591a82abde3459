"""`inspect` checks the whole checkpoint against its config: every tensor present (through
model.safetensors.index.json when there is one), with the right shape and dtype, and names what is not."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm5_fp4.checkpoint import make as mk
from glm5_fp4.checkpoint.configs import build_config
from glm5_fp4.checkpoint.inspect import inspect_checkpoint
from glm5_fp4.checkpoint.make import make_checkpoint
from glm5_fp4.cli import main
from glm5_fp4.errors import Glm5Fp4Error

SMALL = {"n_routed_experts": 4, "num_hidden_layers": 3, "hidden_size": 128, "vocab_size": 512}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("complete")
    return {arch: make_checkpoint(root / arch, arch, seed=1, sizes=SMALL) for arch in ("glm5", "glm4moe")}


def _copy(made, arch, tmp_path):
    return Path(shutil.copytree(made[arch], tmp_path / arch))


def _keep_only(ckpt, keep):
    f = ckpt / "model.safetensors"
    tensors = load_file(str(f))
    save_file({k: v for k, v in tensors.items() if keep(k)}, str(f))


@pytest.mark.parametrize("arch", ["glm5", "glm4moe"])
def test_routed_experts_alone_are_not_a_checkpoint(made, tmp_path, capsys, arch):
    inspect_checkpoint(made[arch], require_nvfp4=True)  # complete: passes
    ck = _copy(made, arch, tmp_path)
    _keep_only(ck, lambda k: ".mlp.experts." in k)
    assert main(["inspect", str(ck), "--require-nvfp4"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    for needle in ("missing", "model.embed_tokens.weight", "lm_head", "attention", "norms", "router",
                   "shared experts", "dense MLP"):
        assert needle in err, (needle, err)
    # the count is the config's own tensor list minus the experts: an independent tally
    cfg = json.loads((ck / "config.json").read_text())
    quantized_per_linear = 3  # weight, weight_scale, weight_scale_2 (input_scale is optional: W4A16 exports lack it)
    want = sum(quantized_per_linear if s.quantized else 1 for s in mk.model_tensors(build_config(arch, SMALL))
               if ".mlp.experts." not in s.name)
    assert f"missing {want:,} of" in err and cfg["num_hidden_layers"] == 3


@pytest.mark.parametrize("name,new,needle", [
    ("model.embed_tokens.weight", torch.zeros(512, 64, dtype=torch.bfloat16),
     r"model\.embed_tokens\.weight is BF16 \[512, 64\], expected BF16 \[512, 128\]"),
    ("model.norm.weight", torch.zeros(128, dtype=torch.uint8),
     r"model\.norm\.weight is U8 \[128\], expected a float \(BF16/F16/F32\) \[128\]"),
    ("model.layers.1.mlp.gate.weight", torch.zeros(7, 128, dtype=torch.bfloat16),
     r"mlp\.gate\.weight is BF16 \[7, 128\], expected BF16 \[4, 128\]"),
    ("model.layers.2.self_attn.o_proj.weight", torch.zeros(128, 256, dtype=torch.uint8), r"o_proj\.weight is U8"),
])
def test_wrong_shape_or_dtype_of_any_tensor_is_named(made, tmp_path, name, new, needle):
    ck = _copy(made, "glm5", tmp_path)
    tensors = load_file(str(ck / "model.safetensors"))
    assert name in tensors
    tensors[name] = new
    save_file(tensors, str(ck / "model.safetensors"))
    with pytest.raises(Glm5Fp4Error, match=needle):
        inspect_checkpoint(ck, require_nvfp4=True)


def _sharded(tmp_path, arch="glm4moe"):
    out = tmp_path / "sharded"
    out.mkdir()
    cfg = build_config(arch, SMALL)
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": mk.exclude_modules(cfg)}}))
    mk.write_safetensors(mk.generate_tensors(cfg, 0, False, mk.model_tensors(cfg)), out, total=1, shard_bytes=500_000)
    return out


def test_sharded_checkpoint_is_read_through_its_index(tmp_path):
    ck = _sharded(tmp_path)
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    report = inspect_checkpoint(ck, require_nvfp4=True)
    assert report.tensors == len(index["weight_map"])
    (ck / shards[1]).unlink()  # a shard the index needs
    with pytest.raises(Glm5Fp4Error, match=rf"model.safetensors.index.json names {shards[1]}, which is missing"):
        inspect_checkpoint(ck, require_nvfp4=True)


def test_index_naming_a_tensor_its_shard_does_not_hold(tmp_path):
    ck = _sharded(tmp_path)
    path = ck / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    name = "model.layers.0.input_layernorm.weight"
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = other
    path.write_text(json.dumps(index))
    with pytest.raises(Glm5Fp4Error, match=rf"{name}.*{other}"):
        inspect_checkpoint(ck)

