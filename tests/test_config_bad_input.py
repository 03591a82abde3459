"""Model and quantizer config files that are near misses of valid ones: `plan --config` and `inspect` give one error
naming the file and the field (before: TypeError / ZeroDivisionError / AttributeError / UnicodeDecodeError
tracebacks from deep in the cost model or the checkpoint reader)."""

from __future__ import annotations

import json
import shutil

import pytest

from glm5_fp4.checkpoint.make import make_checkpoint
from glm5_fp4.cli import main

SMALL = {"n_routed_experts": 8, "num_hidden_layers": 2}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ck") / "glm5", "glm5", seed=1, sizes=SMALL)


def _copy(ckpt, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(ckpt, dst)
    return dst


@pytest.mark.parametrize("key,value,culprit", [
    ("num_attention_heads", "4", "field num_attention_heads is '4', expected an integer"),
    ("kv_lora_rank", "512", "field kv_lora_rank is '512', expected an integer"),
    ("moe_layer_freq", 0, "field moe_layer_freq must be positive, got 0"),
    ("n_group", 0, "field n_group must be positive, got 0"),
    ("num_attention_heads", -4, "field num_attention_heads must be positive, got -4"),
    ("vocab_size", None, "field vocab_size is None, expected an integer"),
    ("q_lora_rank", None, "field q_lora_rank is None, expected an integer"),
    ("routed_scaling_factor", "2.5", "field routed_scaling_factor is '2.5', expected a number"),
    ("tie_word_embeddings", "no", "field tie_word_embeddings is 'no', expected true or false"),
    ("architectures", "GlmMoeDsaForCausalLM", "field architectures is 'GlmMoeDsaForCausalLM', expected a list"),
    ("quantization_config", "nvfp4", "quantization_config is 'nvfp4', expected an object"),
])
def test_plan_names_the_config_field(ckpt, tmp_path, capsys, key, value, culprit):
    ck = _copy(ckpt, tmp_path)
    (ck / "hf_quant_config.json").unlink()  # (the config's own quantization block is the one read then)
    cfg = json.loads((ck / "config.json").read_text())
    cfg[key] = value
    (ck / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--config", str(ck / "config.json"), "--layouts", "tp4pp2"]) == 1
    err = capsys.readouterr().err
    assert f"{ck / 'config.json'}: " in err and culprit in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("name,content,culprit", [
    ("config.json", b'{"hidden_size": \xff}', "config.json: not UTF-8 text"),
    ("config.json", "dir", "config.json: is a directory; expected a config.json file"),
    ("hf_quant_config.json", b"[1]", "hf_quant_config.json: expected a JSON object, got list"),
    ("hf_quant_config.json", b'{"quantization": [1]}', "hf_quant_config.json: quantization is [1], expected an object"),
    ("hf_quant_config.json", b'{"quantization": {"quant_algo": 4}}', "quantization.quant_algo is 4"),
    ("hf_quant_config.json", b'{"quantization": {"quant_algo": "NVFP4", "exclude_modules": "lm_head"}}',
     "quantization.exclude_modules is 'lm_head', expected a list"),
    ("hf_quant_config.json", b'{"quantization": {"quant_algo": "NVFP4", "group_size": "16"}}',
     "quantization.group_size is '16', expected an integer"),
    ("model.safetensors.index.json", b'{"weight_map": {"a": ["model.safetensors"]}}',
     "weight_map['a'] is ['model.safetensors'], expected a file name"),
    ("model.safetensors.index.json", b"\xff\xfe", "model.safetensors.index.json: not UTF-8 text"),
])
def test_inspect_names_the_file_and_field(ckpt, tmp_path, capsys, name, content, culprit):
    ck = _copy(ckpt, tmp_path)
    target = ck / name
    target.unlink(missing_ok=True)
    if content == "dir":
        target.mkdir()
    else:
        target.write_bytes(content)
    assert main(["inspect", str(ck)]) == 1
    err = capsys.readouterr().err
    assert culprit in err and str(ck) in err, err
    assert "Traceback" not in err
