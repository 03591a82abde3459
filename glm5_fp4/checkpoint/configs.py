"""config.json contents for the architectures the tiny checkpoints come in.

`glm5`: GlmMoeDsaForCausalLM (model_type glm_moe_dsa), keys as in zai-org/GLM-5's config.json.
`glm4moe`: Glm4MoeForCausalLM, the same MoE block behind standard GQA attention (faster on CPU).
The dense-attention view of a glm5 config is what vLLM's CPU backend can serve (no DSA there).
"""

from __future__ import annotations

import copy

from glm5_fp4.errors import Glm5Fp4Error

ARCHS = ("glm5", "glm4moe")

# Sizes of the default tiny models. kv_lora_rank=512 and qk_rope_head_dim=64 are the only MLA shape vLLM's
# CPU MLA backend accepts (a 576-wide latent), so they stay at GLM-5's own values.
TINY_SIZES = {
    "hidden_size": 256,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "vocab_size": 2048,
    # glm5 only
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "index_topk": 2048,
    "index_n_heads": 4,
    "index_head_dim": 64,
    # glm4moe only
    "num_key_value_heads": 2,
    "head_dim": 64,
}

MAX_VOCAB_SIZE = 1 << 20

_GLM5_ONLY = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "index_topk", "index_n_heads", "index_head_dim")
_GLM4_ONLY = ("num_key_value_heads", "head_dim")

# Keys that exist only for DSA; dropping them (and declaring deepseek_v3) gives the dense-attention view.
DSA_ONLY_KEYS = ("index_topk", "index_n_heads", "index_head_dim", "indexer_rope_interleave",
                 "indexer_types", "layer_types", "mlp_layer_types")


def build_config(arch: str, sizes: dict | None = None, eos_token_id: int = 1, pad_token_id: int = 1) -> dict:
    """A complete config.json dict for ``arch`` with ``sizes`` overriding the tiny defaults."""
    if arch not in ARCHS:
        raise Glm5Fp4Error(f"unknown --arch {arch!r}; choose one of {ARCHS}")
    s = dict(TINY_SIZES)
    other = _GLM4_ONLY if arch == "glm5" else _GLM5_ONLY
    for key, value in (sizes or {}).items():
        if key not in TINY_SIZES:
            raise Glm5Fp4Error(f"unknown size field {key!r}; known: {', '.join(sorted(TINY_SIZES))}")
        if key in other:  # was ignored without a word: the config the user asked for is not the one written
            raise Glm5Fp4Error(f"--size {key} applies to --arch {'glm4moe' if arch == 'glm5' else 'glm5'} only")
        s[key] = value
    vocab = s["vocab_size"]
    if isinstance(vocab, int) and vocab > MAX_VOCAB_SIZE:
        # the tokenizer gets one added token per id past its merges: 1e9 of them aborted the process
        raise Glm5Fp4Error(f"--size vocab_size {vocab} is past {MAX_VOCAB_SIZE:,} (GLM-5's is 154,880)")
    # shapes first: the NVFP4 divisibility rule below and the layout both assume positive integers
    check_config({**s, "model_type": "glm_moe_dsa" if arch == "glm5" else "glm4_moe"}, "--size")
    if s["moe_intermediate_size"] % 32 or s["hidden_size"] % 32 or s["intermediate_size"] % 32:
        raise Glm5Fp4Error("hidden_size, intermediate_size and moe_intermediate_size must be multiples of 32 "
                           "(NVFP4 blocks of 16 along K, two codes per byte)")
    layers = s["num_hidden_layers"]
    common = {
        "hidden_size": s["hidden_size"],
        "num_hidden_layers": layers,
        "first_k_dense_replace": s["first_k_dense_replace"],
        "moe_layer_freq": 1,
        "intermediate_size": s["intermediate_size"],
        "moe_intermediate_size": s["moe_intermediate_size"],
        "n_routed_experts": s["n_routed_experts"],
        "n_shared_experts": s["n_shared_experts"],
        "num_experts_per_tok": s["num_experts_per_tok"],
        "num_attention_heads": s["num_attention_heads"],
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "hidden_act": "silu",
        "vocab_size": s["vocab_size"],
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "num_nextn_predict_layers": 0,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": None,
        "dtype": "bfloat16",
        "transformers_version": "5.0.2.dev0",
    }
    if arch == "glm5":
        cfg = {
            "architectures": ["GlmMoeDsaForCausalLM"],
            "model_type": "glm_moe_dsa",
            **common,
            "num_key_value_heads": s["num_attention_heads"],
            "q_lora_rank": s["q_lora_rank"],
            "kv_lora_rank": s["kv_lora_rank"],
            "qk_nope_head_dim": s["qk_nope_head_dim"],
            "qk_rope_head_dim": s["qk_rope_head_dim"],
            "qk_head_dim": s["qk_nope_head_dim"] + s["qk_rope_head_dim"],
            "head_dim": s["qk_rope_head_dim"],
            "v_head_dim": s["v_head_dim"],
            "index_topk": s["index_topk"],
            "index_n_heads": s["index_n_heads"],
            "index_head_dim": s["index_head_dim"],
            "indexer_rope_interleave": True,
            "rope_interleave": True,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
            "max_position_embeddings": 8192,
            # The name every transformers release with GLM-5 accepts: 5.17 (the H200 image's) knows only this one;
            # 5.19 renamed it "indexed_attention" and keeps this as an alias.
            "layer_types": ["deepseek_sparse_attention"] * layers,
            "indexer_types": ["full"] * layers,
            "mlp_layer_types": ["dense" if i < s["first_k_dense_replace"] else "sparse" for i in range(layers)],
        }
    else:
        cfg = {
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            **common,
            "num_key_value_heads": s["num_key_value_heads"],
            "head_dim": s["head_dim"],
            "partial_rotary_factor": 0.5,
            "use_qk_norm": False,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default", "partial_rotary_factor": 0.5},
            "max_position_embeddings": 8192,
        }
    return cfg


def dense_attention_view(config: dict) -> dict:
    """The config vLLM's CPU backend can serve: same weights, DSA indexer removed, model_type deepseek_v3.

    For sequences no longer than ``index_topk`` DSA selects every token, so dense MLA computes the same function.
    """
    if config.get("model_type") not in ("glm_moe_dsa", "deepseek_v3"):
        raise Glm5Fp4Error(
            f"the dense-attention view applies to GLM-5 (glm_moe_dsa) configs, not model_type {config.get('model_type')!r}"
        )
    view = copy.deepcopy(config)
    view["model_type"] = "deepseek_v3"
    for key in DSA_ONLY_KEYS:
        view.pop(key, None)
    return view


# Sizes every GLM-5-family config needs; each must be a positive integer (0 makes empty tensors that
# loaders index into, a string or float is not a shape).
_POSITIVE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "moe_intermediate_size",
             "n_routed_experts", "num_experts_per_tok", "vocab_size")
_NON_NEGATIVE = ("first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers")
_MLA_POSITIVE = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_DSA_POSITIVE = ("index_topk", "index_n_heads", "index_head_dim")
_GQA_POSITIVE = ("num_key_value_heads", "head_dim")


def check_config(config: object, where: str) -> None:
    """Raise one Glm5Fp4Error naming the field if ``config`` cannot describe a servable GLM-5-family MoE model.

    The one home of these rules: make-checkpoint runs it before writing anything, inspect on what it reads, so
    a checkpoint the one writes the other accepts, and neither passes a model no engine can build (top-64 of
    16 experts, all layers dense, a vocabulary smaller than its tokenizer's...). ``where`` names the source in
    messages (a config.json path, or "--size").
    """
    from glm5_fp4.checkpoint.layout import MLA_TYPES

    if not isinstance(config, dict):
        raise Glm5Fp4Error(f"{where}: expected a JSON object, got {type(config).__name__}")
    archs = config.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not archs or not all(isinstance(a, str) and a
                                                                                     for a in archs)):
        raise Glm5Fp4Error(f"{where}: field 'architectures' is {archs!r}, expected a list of class names such as "
                           '["GlmMoeDsaForCausalLM"]')

    def integer(key: str, minimum: int, required: bool = True) -> int | None:
        if key not in config:
            if required:
                raise Glm5Fp4Error(f"{where}: field {key!r} missing (not a GLM-5-family MoE config)")
            return None
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise Glm5Fp4Error(f"{where}: field {key!r} is {value!r}, expected an integer")
        if value < minimum:
            raise Glm5Fp4Error(f"{where}: field {key!r} is {value}, expected an integer >= {minimum}")
        return value

    for key in _POSITIVE:
        integer(key, 1)
    for key in _NON_NEGATIVE:
        if config.get(key) is not None:  # null: the field's default, as transformers reads it
            integer(key, 0, required=False)
    tie = config.get("tie_word_embeddings")
    if tie is not None and not isinstance(tie, bool):  # "false" is truthy: lm_head would be read as the embedding
        raise Glm5Fp4Error(f"{where}: field 'tie_word_embeddings' is {tie!r}, expected true or false")
    mla = config.get("model_type") in MLA_TYPES
    for key in _MLA_POSITIVE if mla else _GQA_POSITIVE:
        integer(key, 1)
    rope = config.get("qk_rope_head_dim") if mla else None
    if isinstance(rope, int) and rope % 2:  # RoPE rotates pairs of dimensions; transformers refuses to build it
        raise Glm5Fp4Error(f"{where}: field 'qk_rope_head_dim' is {rope}, expected an even number (RoPE rotates "
                           "pairs of dimensions)")
    if mla and "index_n_heads" in config:
        for key in _DSA_POSITIVE:
            integer(key, 1)
    if not mla and config["num_attention_heads"] % config["num_key_value_heads"]:
        raise Glm5Fp4Error(f"{where}: num_attention_heads {config['num_attention_heads']} is not a multiple of "
                           f"num_key_value_heads {config['num_key_value_heads']}")
    experts, top_k = config["n_routed_experts"], config["num_experts_per_tok"]
    if top_k > experts:
        raise Glm5Fp4Error(f"{where}: num_experts_per_tok {top_k} is more than n_routed_experts {experts} "
                           "(each token cannot be routed to more experts than there are)")
    layers, dense = config["num_hidden_layers"], config.get("first_k_dense_replace", 0)
    if dense >= layers:
        raise Glm5Fp4Error(f"{where}: first_k_dense_replace {dense} leaves no MoE layer in a "
                           f"{layers}-layer model (expected < num_hidden_layers)")
    n_group = integer("n_group", 1, required=False)
    topk_group = integer("topk_group", 1, required=False)
    if n_group is not None:
        if experts % n_group:
            raise Glm5Fp4Error(f"{where}: n_routed_experts {experts} is not a multiple of n_group {n_group}")
        if topk_group is not None and topk_group > n_group:
            raise Glm5Fp4Error(f"{where}: topk_group {topk_group} is more than n_group {n_group}")
    for key in ("mlp_layer_types", "layer_types", "indexer_types"):
        value = config.get(key)
        if value is not None and (not isinstance(value, list) or len(value) != layers):
            raise Glm5Fp4Error(f"{where}: field {key!r} must list one entry per layer ({layers}), "
                               f"got {value if not isinstance(value, list) else f'{len(value)} entries'}")
    # the engines build each layer's MLP from these, the checkpoint's tensors follow first_k_dense_replace
    freq = config.get("moe_layer_freq", 1)
    if freq != 1 or isinstance(freq, bool):
        raise Glm5Fp4Error(f"{where}: moe_layer_freq {freq!r}: vLLM makes layer i a MoE layer where i % moe_layer_freq "
                           f"== 0, but GLM-5-family layers have experts in every layer from first_k_dense_replace "
                           f"({dense}) on (expected 1)")
    kinds = config.get("mlp_layer_types")
    if kinds is not None and kinds != ["dense"] * dense + ["sparse"] * (layers - dense):
        raise Glm5Fp4Error(f"{where}: mlp_layer_types {kinds} disagrees with first_k_dense_replace {dense} "
                           f"(expected {dense} 'dense' then 'sparse'): transformers builds each layer's MLP from it")


def check_tokenizer_fits(vocab_size: int, tokenizer_ids: int, where: str) -> None:
    """A token id at or past vocab_size indexes outside the embedding: the first prompt using it crashes."""
    if tokenizer_ids > vocab_size:
        raise Glm5Fp4Error(f"{where}: vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer_ids} ids "
                           "(ids past vocab_size would index outside the embedding)")
