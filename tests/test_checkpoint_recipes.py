"""make-checkpoint recipes: ``glm5`` (nvidia/GLM-5-NVFP4) and ``routed-only`` (GLM-5.1/5.2-NVFP4): the exclude list
(one home: checkpoint.layout.exclude_modules), the tensors written, inspect, the BF16 twin, the CLI flag, and how
SGLang 0.5.15's and vLLM's own ModelOpt exclude matching reads the list."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from glm5_fp4 import nvfp4
from glm5_fp4.checkpoint.configs import build_config
from glm5_fp4.checkpoint.inspect import inspect_checkpoint, mlp_weight_dtypes
from glm5_fp4.checkpoint.layout import RECIPES, exclude_modules, is_excluded, model_tensors, quantized_mlps, recipe_of
from glm5_fp4.checkpoint.make import make_checkpoint
from glm5_fp4.cli import main
from glm5_fp4.errors import Glm5Fp4Error

# 2 dense + 2 MoE layers: 12 layers would be needed to catch "model.layers.1*" matching layer 10; the pattern
# test below does that on names alone.
SMALL = {"n_routed_experts": 4, "num_hidden_layers": 4, "first_k_dense_replace": 2}


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    root = tmp_path_factory.mktemp("routed")
    return {
        "glm5": make_checkpoint(root / "glm5", "glm5", seed=3, sizes=SMALL, recipe="routed-only"),
        "glm5_bf16": make_checkpoint(root / "glm5_bf16", "glm5", seed=3, sizes=SMALL, recipe="routed-only",
                                     dequantized=True),
        "glm4moe": make_checkpoint(root / "glm4moe", "glm4moe", seed=3, sizes=SMALL, recipe="routed-only"),
    }


def _quantized_bases(ckpt) -> set[str]:
    return {k.removesuffix(".weight_scale") for k in load_file(str(ckpt / "model.safetensors")) if k.endswith(".weight_scale")}


@pytest.mark.parametrize("arch", ["glm5", "glm4moe"])
def test_routed_only_writes_only_routed_experts_in_nvfp4(routed, arch):
    quantized = _quantized_bases(routed[arch])
    assert quantized and all(re.search(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj$", b) for b in quantized)
    assert len(quantized) == 3 * 4 * 2  # 4 experts x 3 projections x 2 MoE layers
    tensors = load_file(str(routed[arch] / "model.safetensors"))
    for name, t in tensors.items():
        if ".shared_experts." in name or re.match(r"model\.layers\.[01]\.mlp\.", name):
            assert t.dtype == torch.bfloat16, name
    hq = json.loads((routed[arch] / "hf_quant_config.json").read_text())["quantization"]
    cfg = json.loads((routed[arch] / "config.json").read_text())
    assert hq["exclude_modules"] == cfg["quantization_config"]["ignore"]
    assert {"model.layers.0.mlp*", "model.layers.1.mlp*", "model.layers.2.mlp.shared_experts*",
            "model.layers.3.mlp.shared_experts*"} <= set(hq["exclude_modules"])


def test_inspect_agrees(routed, capsys):
    r = inspect_checkpoint(routed["glm5"], require_nvfp4=True)
    assert r.recipe == "routed-only" and r.quantized_linears == 3 * 4 * 2
    assert inspect_checkpoint(routed["glm5_bf16"]).recipe is None  # BF16: no recipe to name
    assert main(["inspect", str(routed["glm4moe"])]) == 0
    assert "recipe routed-only" in capsys.readouterr().out


def test_glm5_recipe_unchanged_and_named(tmp_path):
    ck = make_checkpoint(tmp_path / "g", "glm4moe", seed=1, sizes=SMALL)
    r = inspect_checkpoint(ck, require_nvfp4=True)
    assert r.recipe == "glm5" and r.quantized_linears == 3 * (2 + 2 * (4 + 1))  # dense MLPs + experts + shared
    cfg = build_config("glm4moe", SMALL)
    assert not any("mlp" in p for p in exclude_modules(cfg))


def test_twin_dequantizes_routed_experts_and_keeps_the_rest(routed):
    cfg = build_config("glm5", SMALL)
    quant = load_file(str(routed["glm5"] / "model.safetensors"))
    twin = load_file(str(routed["glm5_bf16"] / "model.safetensors"))
    assert not (routed["glm5_bf16"] / "hf_quant_config.json").exists()
    for spec in model_tensors(cfg, "routed-only"):
        if not spec.quantized:
            assert torch.equal(quant[spec.name], twin[spec.name]), spec.name
            continue
        b = spec.name.removesuffix(".weight")
        deq = nvfp4.dequantize(quant[spec.name], quant[f"{b}.weight_scale"], quant[f"{b}.weight_scale_2"], torch.float32)
        assert torch.equal(deq.to(torch.bfloat16), twin[spec.name]), spec.name


def test_patterns_name_only_their_layer():
    cfg = build_config("glm5", {"num_hidden_layers": 12, "first_k_dense_replace": 2, "n_routed_experts": 4})
    ex = exclude_modules(cfg, "routed-only")
    assert is_excluded("model.layers.1.mlp.down_proj", ex)
    assert not is_excluded("model.layers.10.mlp.experts.0.down_proj", ex)  # NVIDIA's "model.layers.1*" would
    assert is_excluded("model.layers.10.mlp.shared_experts.up_proj", ex)
    assert recipe_of(cfg, ex) == "routed-only" and recipe_of(cfg, exclude_modules(cfg)) == "glm5"
    assert recipe_of(cfg, ["lm_head"]) == "glm5"  # the recipe names which MLPs are NVFP4, nothing else
    assert recipe_of(cfg, ["lm_head", "model.layers.0.mlp*"]) is None  # neither recipe
    with pytest.raises(ValueError, match="recipe"):
        exclude_modules(cfg, "dense-only")


@pytest.mark.parametrize("arch", ["glm5", "glm4moe"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_quantized_mlps_says_per_class_what_the_written_tensors_are(arch, recipe):
    cfg = build_config(arch, SMALL)
    names = {s.name: s.quantized for s in model_tensors(cfg, recipe) if re.search(r"\.mlp\..*_proj\.weight$", s.name)}
    by_class = {"routed experts": r"\.mlp\.experts\.", "shared experts": r"\.mlp\.shared_experts\.",
                "dense MLPs": r"layers\.[01]\.mlp\."}
    expect = {c: {q for n, q in names.items() if re.search(rx, n)} for c, rx in by_class.items()}
    assert all(len(v) == 1 for v in expect.values())
    assert quantized_mlps(cfg, exclude_modules(cfg, recipe)) == {c: v.pop() for c, v in expect.items()}


def test_quantized_mlps_names_a_class_left_partly_quantized():
    cfg = build_config("glm5", SMALL)
    assert quantized_mlps(cfg, ["lm_head", "model.layers.2.mlp.shared_experts*"]) == \
        {"routed experts": True, "shared experts": None, "dense MLPs": True}
    assert quantized_mlps(cfg, ["model.layers.3.mlp.experts.1.*", "model.layers.*.mlp.gate_proj"]) == \
        {"routed experts": None, "shared experts": True, "dense MLPs": None}
    assert quantized_mlps(build_config("glm5", {**SMALL, "first_k_dense_replace": 0}), []) == \
        {"routed experts": True, "shared experts": True}


def test_mlp_weight_dtypes_of_the_written_checkpoints(routed, tmp_path):
    dtypes, source = mlp_weight_dtypes(routed["glm5"] / "config.json")
    assert dtypes == {"routed experts": "nvfp4", "shared experts": "bf16", "dense MLPs": "bf16"}
    assert source == f"{routed['glm5'] / 'hf_quant_config.json'}, quant_algo NVFP4"
    assert mlp_weight_dtypes(routed["glm5_bf16"]) is None  # no quantization config: nothing to say
    glm5 = make_checkpoint(tmp_path / "g", "glm5", seed=1, sizes=SMALL)
    assert set(mlp_weight_dtypes(glm5)[0].values()) == {"nvfp4"}


def test_engines_exclude_matching_reads_the_list():
    """SGLang 0.5.15's ModelOpt matcher (modelopt_quant.py is_layer_excluded: '*' -> '.*', fullmatch, on the
    fused names SGLang builds) and fnmatch (vLLM's ModelOpt wildcard match) agree with ours on every linear."""
    cfg = build_config("glm5", SMALL)
    ex = exclude_modules(cfg, "routed-only")

    def sglang_excluded(prefix: str) -> bool:  # the 0.5.15 rule, without its part-by-part and fused-name extras
        return any(re.fullmatch(p.replace(".", r"\.").replace("*", ".*"), prefix) for p in ex)

    for layer in range(4):
        mlp = f"model.layers.{layer}.mlp" if layer < 2 else f"model.layers.{layer}.mlp.shared_experts"
        for fused in ("gate_up_proj", "down_proj"):
            assert sglang_excluded(f"{mlp}.{fused}") and is_excluded(f"{mlp}.{fused}", ex)
    assert not sglang_excluded("model.layers.3.mlp.experts")  # the routed MoE stays NVFP4


def test_cli_flag(tmp_path, capsys):
    assert main(["make-checkpoint", "--arch", "glm4moe", "--out", str(tmp_path / "c"), "--recipe", "routed-only",
                 "--size", "n_routed_experts=4", "--size", "num_hidden_layers=2"]) == 0
    assert "recipe routed-only" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["make-checkpoint", "--out", str(tmp_path / "d"), "--recipe", "everything"])
    with pytest.raises(Glm5Fp4Error, match="--recipe"):
        make_checkpoint(tmp_path / "e", "glm4moe", sizes=SMALL, recipe="everything")
    assert not (tmp_path / "e").exists()
    assert RECIPES == ("glm5", "routed-only")
