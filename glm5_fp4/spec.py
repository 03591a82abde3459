"""GLM-5 model dimensions and what follows from them: the one home for these numbers.

`Glm5Spec()` is GLM-5 itself (zai-org/GLM-5 config.json); `Glm5Spec.from_config_json(path)` reads any
GLM-5-family (or tiny test) config. Derived quantities feed the roofline, `plan` and the profiler's
ceilings: parameters and NVFP4 bytes per layer and per tensor-parallel shard, active parameters per
token, KV-cache bytes per token, distinct experts touched per decode step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.inputs import read_json
from glm5_fp4.nvfp4 import BYTES_PER_ELEMENT as NVFP4_BYTES_PER_PARAM

BF16_BYTES = 2.0
FP8_BYTES = 1.0
# Latent KV-cache row kinds the engines store for MLA + DSA models (bytes per token per layer: Glm5Spec.kv_row_bytes).
KV_KINDS = ("fp8", "bf16", "nvfp4_ds_mla")
# vLLM's `nvfp4_ds_mla` row (mla_attention.py state_content_bytes; SM100 FlashMLA only): not derived from dims.
NVFP4_DS_MLA_ROW_BYTES = 352.0
# FP8 caches keep one FP32 scale per this many values (vLLM fp8_ds_mla and the DSA indexer cache; SGLang's DSA pool).
FP8_CACHE_SCALE_BLOCK = 128


def read_config_json(path: str | Path) -> tuple[Path, dict]:
    """A model's config.json (``path``: the file or its checkpoint directory) and the file read; one clear error
    for a missing or malformed file."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    return path, read_json(path, "config.json")


def expected_distinct_experts(tokens: float, num_experts: int, top_k: int) -> float:
    """Expected distinct experts ``tokens`` tokens route to, each choosing ``top_k`` of ``num_experts`` uniformly:
    E(1-(1-k/E)^T) (an expert misses one token's choice with probability exactly 1 - k/E)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def expected_distinct_groups(num_experts: int, top_k: int, groups: int) -> float:
    """Expected distinct groups (e.g. expert-parallel GPUs, ``num_experts / groups`` experts each) one token's
    ``top_k`` distinct experts fall in: G(1 - C(E - E/G, k) / C(E, k))."""
    per_group = num_experts // groups
    miss = 1.0
    for i in range(top_k):  # probability that none of the k draws (without replacement) lands in one group
        miss *= (num_experts - per_group - i) / (num_experts - i)
    return groups * (1.0 - miss)


def _typed(value, default, key: str, where: str):
    """``value`` of config field ``key`` if it has the type of the spec's default for it (int: not bool; float: any
    finite number; None default: int or null), else one error naming the field."""
    if isinstance(default, bool):
        ok = isinstance(value, bool)
        want = "true or false"
    elif isinstance(default, int) or default is None:
        ok = (isinstance(value, int) and not isinstance(value, bool)) or (default is None and value is None)
        want = "an integer" + (" or null" if default is None else "")
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        want = "a number"
    else:
        ok = isinstance(value, type(default))
        want = f"a {type(default).__name__}"
    if not ok:
        raise Glm5Fp4Error(f"{where}: field {key} is {value!r}, expected {want}")
    return value


@dataclass(frozen=True)
class Glm5Spec:
    """Dimensions of a GLM-5 (glm_moe_dsa) model; defaults are GLM-5's own config.json values."""

    hidden_size: int = 6144
    num_layers: int = 78
    first_k_dense: int = 3
    moe_layer_freq: int = 1
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    num_attention_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    index_topk: int | None = 2048
    index_n_heads: int = 32
    index_head_dim: int = 128
    vocab_size: int = 154880
    tie_word_embeddings: bool = False
    num_mtp_layers: int = 1
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 202752  # the longest context; engines refuse a longer max_model_len
    architecture: str = "GlmMoeDsaForCausalLM"
    name: str = field(default="GLM-5", compare=False)

    # -- construction ---------------------------------------------------------------------------
    _HF_KEYS = {
        "num_hidden_layers": "num_layers",
        "first_k_dense_replace": "first_k_dense",
        "num_nextn_predict_layers": "num_mtp_layers",
    }

    # config.json keys a config must carry to describe a model at all; every other field defaults to GLM-5's own value.
    # Without these, a JSON file that is no model config (a load-test summary, `{}`) would silently plan GLM-5 with
    # whatever few keys it happens to share.
    REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "moe_intermediate_size", "n_routed_experts",
                     "num_experts_per_tok")

    @classmethod
    def from_config(cls, config: dict, name: str = "config", where: str | None = None) -> "Glm5Spec":
        """``where``: how errors name the source (default ``name``)."""
        where = where or name
        if not isinstance(config, dict):
            raise Glm5Fp4Error(f"{where}: not a model config (not a JSON object but {type(config).__name__})")
        missing = [k for k in cls.REQUIRED_KEYS if k not in config]
        if len(missing) == len(cls.REQUIRED_KEYS):
            raise Glm5Fp4Error(f"{where}: not a model config (no {', '.join(missing)})")
        if missing:
            raise Glm5Fp4Error(f"{where}: model config lacks {', '.join(missing)} (required: "
                               f"{', '.join(cls.REQUIRED_KEYS)}; other fields default to GLM-5's)")
        for k in cls.REQUIRED_KEYS:
            if type(config[k]) is not int:  # bool is an int subclass: reject it too
                raise Glm5Fp4Error(f"{where}: field {k} must be an integer, got {config[k]!r}")
        defaults = {f.name: f.default for f in fields(cls)}
        kwargs: dict = {}
        for key, value in config.items():
            target = cls._HF_KEYS.get(key, key)
            if target in defaults and target not in ("architecture", "name"):
                # (index_topk: null in a dense-attention view)
                kwargs[target] = _typed(value, None if target == "index_topk" else defaults[target], key, where)
        archs = config.get("architectures") or [cls.architecture]
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise Glm5Fp4Error(f"{where}: field architectures is {archs!r}, expected a list of names")
        kwargs["architecture"] = archs[0]
        kwargs["name"] = name
        if "index_topk" not in config:
            kwargs["index_topk"] = None  # dense-attention view or a GQA model: no DSA indexer
        if config.get("model_type") == "glm4_moe" or "num_key_value_heads" in config and "kv_lora_rank" not in config:
            raise Glm5Fp4Error(
                f"{where}: model_type {config.get('model_type')!r} has no MLA; Glm5Spec describes GLM-5 (glm_moe_dsa)"
            )
        spec = cls(**kwargs)
        spec.validate(where)
        return spec

    @classmethod
    def from_config_json(cls, path: str | Path) -> "Glm5Spec":
        path, config = read_config_json(path)
        return cls.from_config(config, name=str(path.parent.name or path), where=str(path))

    def validate(self, name: str = "config") -> None:
        for f in ("hidden_size", "num_layers", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "moe_layer_freq", "intermediate_size", "n_group", "topk_group", "num_attention_heads",
                  "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "index_n_heads", "index_head_dim", "vocab_size", "max_position_embeddings"):
            if getattr(self, f) <= 0:
                raise Glm5Fp4Error(f"{name}: field {f} must be positive, got {getattr(self, f)}")
        for f in ("n_shared_experts", "num_mtp_layers"):
            if getattr(self, f) < 0:
                raise Glm5Fp4Error(f"{name}: field {f} must be >= 0, got {getattr(self, f)}")
        if self.index_topk is not None and self.index_topk <= 0:
            raise Glm5Fp4Error(f"{name}: field index_topk must be positive, got {self.index_topk}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise Glm5Fp4Error(
                f"{name}: num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts={self.n_routed_experts}"
            )
        if self.n_routed_experts % self.n_group:
            raise Glm5Fp4Error(f"{name}: n_routed_experts={self.n_routed_experts} not divisible by n_group={self.n_group}")
        if not 0 <= self.first_k_dense <= self.num_layers:
            raise Glm5Fp4Error(f"{name}: first_k_dense_replace={self.first_k_dense} outside 0..{self.num_layers}")

    # -- layer structure --------------------------------------------------------------------------
    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense and (layer - self.first_k_dense) % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # -- parameters -------------------------------------------------------------------------------
    @property
    def expert_params(self) -> int:
        """One routed (or shared) expert: gate, up and down projections."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def attention_params(self) -> int:
        """MLA projections of one layer (norms excluded: they are negligible and stay high precision)."""
        h, n = self.hidden_size, self.num_attention_heads
        q = h * self.q_lora_rank + self.q_lora_rank * n * self.qk_head_dim
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv_b = self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
        o = n * self.v_head_dim * h
        return q + kv_a + kv_b + o

    @property
    def indexer_params(self) -> int:
        """DSA lightning indexer of one layer (0 without DSA)."""
        if self.index_topk is None:
            return 0
        wq_b = self.q_lora_rank * self.index_n_heads * self.index_head_dim
        wk = self.hidden_size * self.index_head_dim
        weights_proj = self.hidden_size * self.index_n_heads
        return wq_b + wk + weights_proj

    @property
    def routed_expert_params(self) -> int:
        return self.moe_layers * self.n_routed_experts * self.expert_params

    @property
    def shared_expert_params(self) -> int:
        return self.moe_layers * self.n_shared_experts * self.expert_params

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def router_params(self) -> int:
        return self.moe_layers * self.n_routed_experts * self.hidden_size

    @property
    def total_params(self) -> int:
        """All parameters without the MTP layer."""
        return (
            self.num_layers * (self.attention_params + self.indexer_params)
            + self.routed_expert_params
            + self.shared_expert_params
            + self.dense_layers * self.dense_mlp_params
            + self.router_params
            + self.embedding_params
            + self.lm_head_params
        )

    @property
    def active_params_per_token(self) -> int:
        """Parameters one token's forward pass multiplies (embedding lookup excluded)."""
        return (
            self.num_layers * (self.attention_params + self.indexer_params)
            + self.moe_layers * (self.num_experts_per_tok + self.n_shared_experts) * self.expert_params
            + self.dense_layers * self.dense_mlp_params
            + self.router_params
            + self.lm_head_params
        )

    # -- bytes ------------------------------------------------------------------------------------
    def routed_expert_bytes(self, tp: int = 1, bytes_per_param: float = NVFP4_BYTES_PER_PARAM) -> float:
        """Routed-expert weights one tensor-parallel rank holds (experts are split along the intermediate dim)."""
        return self.routed_expert_params * bytes_per_param / tp

    def expert_bytes(self, tp: int = 1, bytes_per_param: float = NVFP4_BYTES_PER_PARAM) -> float:
        """One expert's weights on one TP rank."""
        return self.expert_params * bytes_per_param / tp

    def layer_weight_bytes(
        self,
        layer: int,
        tp: int = 1,
        expert_bytes_per_param: float = NVFP4_BYTES_PER_PARAM,
        attention_bytes_per_param: float = BF16_BYTES,
    ) -> float:
        """Weights of one decoder layer on one TP rank, in the precisions of nvidia/GLM-5-NVFP4 by default
        (MLPs and experts NVFP4, attention and indexer BF16, router BF16)."""
        attn = (self.attention_params + self.indexer_params) * attention_bytes_per_param
        if self.is_moe_layer(layer):
            mlp = (self.n_routed_experts + self.n_shared_experts) * self.expert_params * expert_bytes_per_param
            mlp += self.n_routed_experts * self.hidden_size * BF16_BYTES
        else:
            mlp = self.dense_mlp_params * expert_bytes_per_param
        return (attn + mlp) / tp

    def kv_row_bytes(self, kind: str = "bf16") -> float:
        """Latent KV bytes per token per layer as the engines store ``kind`` (one of :data:`KV_KINDS`).

        ``fp8`` is the scaled DSA row of vLLM's ``fp8_ds_mla`` and SGLang's DSA FP8 pool: kv_lora in FP8 + one
        FP32 scale per 128 values + the rope part kept in BF16 (512 + 16 + 128 = 656 B for GLM-5, not 576).
        """
        if kind == "fp8":
            return (self.kv_lora_rank * FP8_BYTES + self.kv_lora_rank // FP8_CACHE_SCALE_BLOCK * 4
                    + self.qk_rope_head_dim * BF16_BYTES)
        if kind == "bf16":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * BF16_BYTES
        if kind == "nvfp4_ds_mla":
            return NVFP4_DS_MLA_ROW_BYTES
        raise Glm5Fp4Error(f"unknown KV-cache row kind {kind!r}; known: {', '.join(KV_KINDS)}")

    def indexer_row_bytes(self) -> float:
        """DSA indexer key cache per token per layer: FP8 keys plus one FP32 scale per 128 (0 without DSA)."""
        if self.index_topk is None:
            return 0.0
        return self.index_head_dim * FP8_BYTES + math.ceil(self.index_head_dim / FP8_CACHE_SCALE_BLOCK) * 4

    def kv_bytes_per_token(self, kind: str = "bf16", include_indexer: bool = True) -> float:
        """KV-cache bytes per token over all layers: the latent row of ``kind`` plus the indexer key (when the
        model has DSA). Under TP every rank holds all of it."""
        return self.num_layers * (self.kv_row_bytes(kind) + (self.indexer_row_bytes() if include_indexer else 0.0))

    # -- decode-step quantities ---------------------------------------------------------------------
    def expected_experts_touched(self, tokens: float) -> float:
        """Expected distinct routed experts per MoE layer for ``tokens`` independent tokens: E(1-(1-k/E)^T)."""
        return expected_distinct_experts(tokens, self.n_routed_experts, self.num_experts_per_tok)

    def selected_tokens(self, context: int) -> int:
        """Cached tokens each query attends to: DSA selects min(context, index_topk); dense MLA all of them."""
        return min(context, self.index_topk) if self.index_topk is not None else context

    def mla_flops_per_token_layer(self, context: int, heads: float | None = None) -> float:
        """Attention score/value FLOPs of one query token in one layer (MLA absorbed form: each head dots a
        (kv_lora + rope)-wide query with each selected latent and mixes kv_lora-wide values)."""
        heads = self.num_attention_heads if heads is None else heads
        return 2.0 * heads * self.selected_tokens(context) * (2 * self.kv_lora_rank + self.qk_rope_head_dim)

    def decode_flops_per_token(self, context: int = 0) -> float:
        """2 x active parameters plus the attention score/value FLOPs over ``context`` cached tokens."""
        return 2.0 * self.active_params_per_token + self.num_layers * self.mla_flops_per_token_layer(context)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "architecture": self.architecture,
            "layers": self.num_layers,
            "moe_layers": self.moe_layers,
            "routed_experts": self.n_routed_experts,
            "experts_per_token": self.num_experts_per_tok,
            "total_params": self.total_params,
            "active_params_per_token": self.active_params_per_token,
            "routed_expert_share": self.routed_expert_params / self.total_params,
            "kv_bytes_per_token_bf16": self.kv_bytes_per_token(),
        }


GLM5 = Glm5Spec()
