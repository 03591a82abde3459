"""Read one MoE layer of an NVFP4 checkpoint into the engine-side expert layout (`NvFp4Experts`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.reference import NvFp4Experts


@dataclass
class MoeLayer:
    index: int
    experts: NvFp4Experts
    shared: NvFp4Experts | None
    router_weight: torch.Tensor
    correction_bias: torch.Tensor | None
    top_k: int
    routed_scaling_factor: float


class _Tensors:
    def __init__(self, ckpt: Path):
        self.ckpt = ckpt
        index = ckpt / "model.safetensors.index.json"
        if index.exists():
            self.where = {k: ckpt / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        else:
            self.where = {}
            for f in sorted(ckpt.glob("*.safetensors")):
                with safe_open(str(f), "pt") as h:
                    self.where.update({k: f for k in h.keys()})

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise Glm5Fp4Error(f"{self.ckpt}: tensor {name} not found")
        with safe_open(str(self.where[name]), "pt") as h:
            return h.get_tensor(name)

    def has(self, name: str) -> bool:
        return name in self.where


def _fused_gate_up(t: _Tensors, prefix: str):
    gate, up = f"{prefix}.gate_proj", f"{prefix}.up_proj"
    g2, u2 = t.get(f"{gate}.weight_scale_2"), t.get(f"{up}.weight_scale_2")
    if not torch.equal(g2, u2):
        raise Glm5Fp4Error(
            f"{t.ckpt}: {gate}.weight_scale_2 ({g2.item():.6g}) != {up}.weight_scale_2 ({u2.item():.6g}); "
            "fused gate/up needs one global scale (ModelOpt exports them equal)"
        )
    w = torch.cat([t.get(f"{gate}.weight"), t.get(f"{up}.weight")])
    s = torch.cat([t.get(f"{gate}.weight_scale"), t.get(f"{up}.weight_scale")])
    a = torch.maximum(t.get(f"{gate}.input_scale"), t.get(f"{up}.input_scale")) if t.has(f"{gate}.input_scale") else None
    return w, s, g2.float(), a


def _stack(t: _Tensors, prefixes: list[str]) -> NvFp4Experts:
    w13, s13, g13, a13, w2, s2, g2, a2 = [], [], [], [], [], [], [], []
    for p in prefixes:
        w, s, g, a = _fused_gate_up(t, p)
        w13.append(w), s13.append(s), g13.append(g), a13.append(a)
        d = f"{p}.down_proj"
        w2.append(t.get(f"{d}.weight")), s2.append(t.get(f"{d}.weight_scale")), g2.append(t.get(f"{d}.weight_scale_2").float())
        a2.append(t.get(f"{d}.input_scale") if t.has(f"{d}.input_scale") else None)
    has_inputs = all(a is not None for a in a13 + a2)
    experts = NvFp4Experts(
        torch.stack(w13), torch.stack(s13), torch.stack(g13).reshape(-1),
        torch.stack(w2), torch.stack(s2), torch.stack(g2).reshape(-1),
        torch.stack(a13).reshape(-1).float() if has_inputs else None,
        torch.stack(a2).reshape(-1).float() if has_inputs else None,
    )
    experts.validate(prefixes[0].rsplit(".", 1)[0])
    return experts


def load_moe_layer(ckpt: str | Path, layer: int | None = None) -> MoeLayer:
    """Experts, shared expert and router of MoE ``layer`` (default: the first MoE layer)."""
    ckpt = Path(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    first = cfg.get("first_k_dense_replace", 0)
    layer = first if layer is None else layer
    if not first <= layer < cfg["num_hidden_layers"]:
        raise Glm5Fp4Error(f"{ckpt}: layer {layer} is not a MoE layer (MoE layers: {first}..{cfg['num_hidden_layers'] - 1})")
    t = _Tensors(ckpt)
    p = f"model.layers.{layer}.mlp"
    experts = _stack(t, [f"{p}.experts.{e}" for e in range(cfg["n_routed_experts"])])
    shared = _stack(t, [f"{p}.shared_experts"]) if cfg.get("n_shared_experts") else None
    bias = t.get(f"{p}.gate.e_score_correction_bias") if t.has(f"{p}.gate.e_score_correction_bias") else None
    return MoeLayer(layer, experts, shared, t.get(f"{p}.gate.weight"), bias, cfg["num_experts_per_tok"],
                    cfg.get("routed_scaling_factor", 1.0))
