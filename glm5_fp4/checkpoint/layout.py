"""The tensors a GLM-5-family config implies: names (as nvidia/GLM-5-NVFP4 writes them), shapes before
quantization, and which linears ModelOpt quantizes. One home for the layout: ``make`` writes these tensors
and ``inspect`` checks a checkpoint holds them (the tests hold both to transformers' own model definitions).

Which MLPs are NVFP4 is a *recipe*, and ``exclude_modules`` is its one home (``model_tensors`` marks a tensor
quantized exactly when no exclude pattern matches it, so the written tensors and the written exclude list cannot
disagree):

* ``glm5`` (default): nvidia/GLM-5-NVFP4 (ModelOpt 0.42): dense MLPs, routed and shared experts NVFP4.
* ``routed-only``: the later NVIDIA recipe of GLM-5.1/5.2-NVFP4 (ModelOpt 0.45/0.46), which also excludes the dense
  layers' MLPs and every shared expert, so only routed experts are NVFP4. Engines then run no NVFP4 *linear* layer
  at all (on SM90 SGLang 0.5.15 runs those through a Marlin GEMM that it JIT-compiles at server start-up).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

RECIPES = ("glm5", "routed-only")

MLA_TYPES = ("glm_moe_dsa", "deepseek_v3")  # deepseek_v3: the dense-attention view of a GLM-5 config


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # "linear" (random, fan-in scaled), "norm" (ones), "bias" (small), "embed"
    quantized: bool = False


def _attention_tensors(cfg: dict, p: str) -> list[TensorSpec]:
    h, n = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg["model_type"] in MLA_TYPES:
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        out = [
            TensorSpec(f"{p}.self_attn.q_a_proj.weight", (cfg["q_lora_rank"], h), "linear"),
            TensorSpec(f"{p}.self_attn.q_a_layernorm.weight", (cfg["q_lora_rank"],), "norm"),
            TensorSpec(f"{p}.self_attn.q_b_proj.weight", (n * qk, cfg["q_lora_rank"]), "linear"),
            TensorSpec(f"{p}.self_attn.kv_a_proj_with_mqa.weight", (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h), "linear"),
            TensorSpec(f"{p}.self_attn.kv_a_layernorm.weight", (cfg["kv_lora_rank"],), "norm"),
            TensorSpec(f"{p}.self_attn.kv_b_proj.weight", (n * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]), "linear"),
            TensorSpec(f"{p}.self_attn.o_proj.weight", (h, n * cfg["v_head_dim"]), "linear"),
        ]
        if "index_n_heads" not in cfg:  # the dense-attention view: its config has no DSA indexer
            return out
        d, ih = cfg["index_head_dim"], cfg["index_n_heads"]
        out += [
            TensorSpec(f"{p}.self_attn.indexer.wq_b.weight", (ih * d, cfg["q_lora_rank"]), "linear"),
            TensorSpec(f"{p}.self_attn.indexer.wk.weight", (d, h), "linear"),
            TensorSpec(f"{p}.self_attn.indexer.k_norm.weight", (d,), "norm"),
            TensorSpec(f"{p}.self_attn.indexer.k_norm.bias", (d,), "bias"),
            TensorSpec(f"{p}.self_attn.indexer.weights_proj.weight", (ih, h), "linear"),
        ]
        return out
    hd, kvh = cfg["head_dim"], cfg["num_key_value_heads"]
    return [
        TensorSpec(f"{p}.self_attn.q_proj.weight", (n * hd, h), "linear"),
        TensorSpec(f"{p}.self_attn.k_proj.weight", (kvh * hd, h), "linear"),
        TensorSpec(f"{p}.self_attn.v_proj.weight", (kvh * hd, h), "linear"),
        TensorSpec(f"{p}.self_attn.o_proj.weight", (h, n * hd), "linear"),
    ]


def _mlp_tensors(prefix: str, hidden: int, inter: int) -> list[TensorSpec]:
    return [
        TensorSpec(f"{prefix}.gate_proj.weight", (inter, hidden), "linear", True),
        TensorSpec(f"{prefix}.up_proj.weight", (inter, hidden), "linear", True),
        TensorSpec(f"{prefix}.down_proj.weight", (hidden, inter), "linear", True),
    ]


def layer_tensors(cfg: dict, layer: int) -> list[TensorSpec]:
    """Every tensor of decoder layer ``layer`` with the names nvidia/GLM-5-NVFP4 uses (before quantization)."""
    p = f"model.layers.{layer}"
    h = cfg["hidden_size"]
    out = [TensorSpec(f"{p}.input_layernorm.weight", (h,), "norm"),
           TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), "norm")]
    out += _attention_tensors(cfg, p)
    if layer < cfg["first_k_dense_replace"]:
        out += _mlp_tensors(f"{p}.mlp", h, cfg["intermediate_size"])
    else:
        e, i = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        out += [TensorSpec(f"{p}.mlp.gate.weight", (e, h), "linear"),
                TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (e,), "bias")]
        for j in range(e):
            out += _mlp_tensors(f"{p}.mlp.experts.{j}", h, i)
        if cfg["n_shared_experts"]:
            out += _mlp_tensors(f"{p}.mlp.shared_experts", h, i * cfg["n_shared_experts"])
    return out


def model_tensors(cfg: dict, recipe: str = "glm5") -> list[TensorSpec]:
    """Every tensor of the model; an MLP projection is ``quantized`` unless ``exclude_modules(cfg, recipe)``
    matches it."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    out = [TensorSpec("model.embed_tokens.weight", (v, h), "embed")]
    for layer in range(cfg["num_hidden_layers"]):
        out += layer_tensors(cfg, layer)
    out.append(TensorSpec("model.norm.weight", (h,), "norm"))
    if not cfg.get("tie_word_embeddings"):
        out.append(TensorSpec("lm_head.weight", (v, h), "linear"))
    excluded = exclude_modules(cfg, recipe)
    return [TensorSpec(s.name, s.shape, s.kind, False) if s.quantized and is_excluded(s.name.removesuffix(".weight"),
                                                                                        excluded) else s
            for s in out]


def exclude_modules(cfg: dict, recipe: str = "glm5") -> list[str]:
    """ModelOpt's exclude list for this config and recipe (see the module docstring): lm_head and all attention
    (with the indexer), as NVIDIA's; ``routed-only`` adds each dense layer's MLP and each MoE layer's shared
    experts, spelled as SGLang's and vLLM's ModelOpt configs match them (glob, ``*`` = any characters)."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    out = ["lm_head"]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.self_attn"
        if cfg["model_type"] == "glm_moe_dsa":
            out += [f"{p}.{m}" for m in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")]
            out.append(f"{p}.indexer*")
        else:
            out += [f"{p}.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if recipe == "routed-only":
            # "model.layers.1.mlp*", not NVIDIA's "model.layers.1*" (which would match layers 10-19 too)
            dense = layer < cfg["first_k_dense_replace"]
            out.append(f"model.layers.{layer}.mlp*" if dense else f"model.layers.{layer}.mlp.shared_experts*")
    return sorted(out)


def is_excluded(module: str, patterns: list[str]) -> bool:
    """Whether an exclude list (ModelOpt's glob patterns) names ``module`` (a tensor name without ``.weight``)."""
    return any(fnmatch.fnmatchcase(module, p) or module == p for p in patterns)


# The MLP classes, named as the cost model's components.
MLP_CLASSES = ("routed experts", "shared experts", "dense MLPs")


def quantized_mlps(cfg: dict, patterns: list[str]) -> dict[str, bool | None]:
    """Per MLP class of this config (:data:`MLP_CLASSES`), whether an exclude list leaves its projections quantized:
    True (all of them), False (none), None (some, e.g. a hand-made list)."""
    seen: dict[str, set[bool]] = {}
    for layer in range(cfg["num_hidden_layers"]):
        mlp = f"model.layers.{layer}.mlp."
        # Only patterns whose literal head fits under this layer's MLP can match there: a full GLM-5 has ~550
        # patterns and 58k routed-expert projections, which is a minute of fnmatch tried pairwise.
        near = [p for p in patterns if mlp.startswith(_literal_head(p)) or _literal_head(p).startswith(mlp)]
        for s in layer_tensors(cfg, layer):
            if not s.quantized:
                continue
            cls = ("dense MLPs" if layer < cfg["first_k_dense_replace"] else
                   "shared experts" if s.name.startswith(mlp + "shared_experts.") else "routed experts")
            seen.setdefault(cls, set()).add(not is_excluded(s.name.removesuffix(".weight"), near))
    return {c: next(iter(v)) if len(v) == 1 else None for c in MLP_CLASSES if (v := seen.get(c))}


def _literal_head(pattern: str) -> str:
    """What every name a glob pattern matches starts with."""
    return re.split(r"[*?[]", pattern, maxsplit=1)[0]


def recipe_of(cfg: dict, patterns: list[str]) -> str | None:
    """Which recipe an exclude list describes for this config: the one whose quantized MLP set it leaves (None:
    neither, e.g. a hand-made list)."""
    kept = lambda r: [s.name for s in model_tensors(cfg, r) if s.quantized]  # noqa: E731
    actual = [s.name for s in model_tensors(cfg) if s.quantized and not is_excluded(s.name.removesuffix(".weight"),
                                                                                    patterns)]
    return next((r for r in RECIPES if kept(r) == actual), None)
