"""`glm5_nvfp4` meets vLLM's quantization detection (the real ModelConfig, tiny checkpoints, no weights loaded).

The trap (vllm.md §2.3): vLLM asks every config's override, custom ones first, and the first non-None
answer becomes the method. Ours must answer only when asked, and must answer when asked.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from glm5_fp4.checkpoint.make import make_checkpoint  # noqa: E402
from glm5_fp4.engines import vllm_plugin  # noqa: E402
from glm5_fp4.errors import Glm5Fp4Error  # noqa: E402

vllm_plugin.register()

from vllm.config import LoadConfig, ModelConfig  # noqa: E402
from vllm.model_executor.model_loader.weight_utils import get_quant_config  # noqa: E402

from glm5_fp4.engines.vllm.config import Glm5NvFp4Config  # noqa: E402

# As vLLM hands it to overrides: hf_quant_config.json form, quant_method added by vLLM's config normaliser.
NVFP4_NESTED = {"producer": {"name": "modelopt"}, "quant_method": "modelopt_fp4",
                "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                 "exclude_modules": ["lm_head"]}}
NVFP4_FLAT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"]}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    out = {
        "nvfp4": make_checkpoint(root / "nvfp4", arch="glm5", dense_attention=True, sizes={"num_hidden_layers": 2}),
        "bf16": make_checkpoint(root / "bf16", arch="glm5", dense_attention=True, dequantized=True,
                                sizes={"num_hidden_layers": 2}),
    }
    legacy = root / "legacy"  # ModelOpt <= 0.29: only hf_quant_config.json
    shutil.copytree(out["nvfp4"], legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    del cfg["quantization_config"]
    (legacy / "config.json").write_text(json.dumps(cfg))
    out["legacy"] = legacy
    for name, qcfg in {"fp8": {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": []},
                       "ct": {"quant_method": "compressed-tensors", "config_groups": {}}}.items():
        d = root / name
        shutil.copytree(out["bf16"], d)
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"] = qcfg
        (d / "config.json").write_text(json.dumps(cfg))
        out[name] = d
    return out


@pytest.mark.parametrize("user", [None, "modelopt_fp4"])
def test_a_modelopt_checkpoint_is_not_claimed_unless_asked(ckpts, user):
    assert ModelConfig(model=str(ckpts["nvfp4"]), quantization=user).quantization == "modelopt_fp4"


@pytest.mark.parametrize("ckpt", ["nvfp4", "legacy"])
def test_asked_for_it_the_name_survives_the_builtin_override(ckpts, ckpt):
    assert ModelConfig(model=str(ckpts[ckpt]), quantization="glm5_nvfp4").quantization == "glm5_nvfp4"
    assert ModelConfig(model=str(ckpts[ckpt])).quantization == "modelopt_fp4"


def test_the_trap_is_real(ckpts, monkeypatch):
    """An override that stays silent when asked is silently replaced by vLLM's modelopt_fp4."""
    monkeypatch.setattr(Glm5NvFp4Config, "override_quantization_method", classmethod(lambda *a, **k: None))
    assert ModelConfig(model=str(ckpts["nvfp4"]), quantization="glm5_nvfp4").quantization == "modelopt_fp4"


@pytest.mark.parametrize("cfg", [NVFP4_NESTED, NVFP4_FLAT, {**NVFP4_FLAT, "quant_algo": "W4A16_NVFP4"}])
def test_override_answers_for_every_nvfp4_spelling(cfg):
    assert Glm5NvFp4Config.override_quantization_method(cfg, "glm5_nvfp4") == "glm5_nvfp4"
    assert Glm5NvFp4Config.override_quantization_method(cfg, None) is None
    assert Glm5NvFp4Config.override_quantization_method(cfg, "modelopt_fp4") is None


@pytest.mark.parametrize("name,needle", [("fp8", "quant_algo='FP8'"),
                                         ("ct", "quant_method='compressed-tensors'")])
def test_asked_for_a_non_nvfp4_quantized_checkpoint_fails_clearly(ckpts, name, needle):
    with pytest.raises(Glm5Fp4Error, match=needle):
        ModelConfig(model=str(ckpts[name]), quantization="glm5_nvfp4")


def test_the_checkpoint_config_is_parsed_as_vllm_does(ckpts):
    mc = ModelConfig(model=str(ckpts["nvfp4"]), quantization="glm5_nvfp4")
    qc = get_quant_config(mc, LoadConfig())
    assert type(qc) is Glm5NvFp4Config and qc.get_name() == "glm5_nvfp4"
    assert qc.declared_by_checkpoint and qc.quant_method == "NVFP4" and qc.group_size == 16
    assert any("self_attn" in m for m in qc.exclude_modules)  # attention stays BF16, as NVIDIA's


def test_an_unquantized_checkpoint_gets_a_config_that_names_tensors_at_load(ckpts):
    mc = ModelConfig(model=str(ckpts["bf16"]), quantization="glm5_nvfp4")
    qc = get_quant_config(mc, LoadConfig())
    assert type(qc) is Glm5NvFp4Config and not qc.declared_by_checkpoint


def test_exclude_modules_only_configs_keep_attention_unquantized():
    qc = Glm5NvFp4Config.from_config({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                      "exclude_modules": ["lm_head", "model.layers.0.self_attn*"]})
    assert qc.is_layer_excluded("model.layers.0.self_attn.o_proj")
    assert not qc.is_layer_excluded("model.layers.0.mlp.down_proj")


def test_a_routed_only_checkpoint_keeps_dense_mlps_and_shared_experts_unquantized(tmp_path):
    """make-checkpoint --recipe routed-only (GLM-5.1/5.2-NVFP4's recipe) read by vLLM: its dense MLPs and shared
    experts are excluded linears (BF16), its routed experts are not."""
    ck = make_checkpoint(tmp_path / "routed", arch="glm5", dense_attention=True, recipe="routed-only",
                         sizes={"num_hidden_layers": 2, "first_k_dense_replace": 1})
    qc = get_quant_config(ModelConfig(model=str(ck), quantization="glm5_nvfp4"), LoadConfig())
    assert type(qc) is Glm5NvFp4Config and qc.declared_by_checkpoint
    for prefix in ("model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj",
                   "model.layers.1.mlp.shared_experts.gate_up_proj", "model.layers.1.mlp.shared_experts.down_proj"):
        assert qc.is_layer_excluded(prefix), prefix
    assert not qc.is_layer_excluded("model.layers.1.mlp.experts")
