"""Routings for MoE tests and benchmarks: balanced (GLM-5's router on random logits) and skewed.

Real serving is skewed: a batch shares prompts and languages, and a prefill chunk is one document whose
tokens pick the same experts. Every generator keeps the router's contract (each token picks ``k``
*distinct* experts, positive weights summing to ``routed_scaling_factor``), so the FLOPs equal the
balanced case's and only the distribution over experts changes:

* ``balanced``: GLM-5's noaux_tc router on random logits (near-uniform loads);
* ``same_k``: every token on the same ``k`` experts (the worst case: ``k`` experts take everything);
* ``one_hot``: one expert in every token's top-k, the other ``k - 1`` uniform;
* ``zipf1.2`` / ``zipf2``: heavy-tailed hot experts, experts drawn without replacement with weights
  ``rank^-s`` (Plackett-Luce through Gumbel top-k), a few experts taking most tokens.

An expert-parallel benchmark times one rank (experts ``0..n-1`` of the router's ``E``). Hot experts drawn over all
``E`` would land on that rank only now and then (``same_k`` left EP8's rank 0 with no expert in a third of the draws),
so with ``hot_experts=n`` the skewed routings draw their hot experts among the measured rank's ``n``: ``same_k``'s
``k`` experts (all ``n`` and the rest elsewhere when ``n < k``), ``one_hot``'s hot expert and zipf's ``n`` highest
ranks are the rank's, the worst case for it. ``balanced`` is the router's and ignores it.
"""

from __future__ import annotations

import math

import torch

from glm5_fp4.errors import Glm5Fp4Error

ROUTINGS = ("balanced", "same_k", "one_hot", "zipf1.2", "zipf2")
SKEWED = ROUTINGS[1:]


def _weights(t: int, k: int, gen, device, scale: float) -> torch.Tensor:
    w = torch.rand(t, k, generator=gen, device=device) + 0.05
    return (w / w.sum(-1, keepdim=True) * scale).float()


def _gumbel_topk(logw: torch.Tensor, t: int, k: int, gen) -> torch.Tensor:
    u = torch.rand(t, logw.numel(), generator=gen, device=logw.device).clamp_(1e-12, 1 - 1e-7)
    return torch.topk(logw[None, :] - torch.log(-torch.log(u)), k, dim=-1).indices


def check(name: str) -> None:
    """Refuse a routing name :func:`make_routing` does not know (before a benchmark measures anything)."""
    if name in ROUTINGS:
        return
    if name.startswith("zipf"):
        try:
            s = float(name[4:])
        except ValueError:
            s = math.nan
        if not (math.isfinite(s) and s > 0):  # nan and inf drew routings that looked measured, <= 0 no skew
            raise Glm5Fp4Error(f"routing {name!r}: zipf needs a finite exponent above 0, e.g. zipf1.2")
        return
    raise Glm5Fp4Error(f"unknown routing {name!r}; choose one of {', '.join(ROUTINGS)} (or zipfS)")


def make_routing(name: str, tokens: int, num_experts: int, top_k: int, gen: torch.Generator | None = None,
                 device: torch.device | str = "cpu", routed_scaling_factor: float = 2.5, spec=None,
                 hot_experts: int | None = None):
    """``(topk_weights float32 [T, k], topk_ids int32 [T, k])`` of routing ``name`` (see the module doc).

    ``spec`` (a :class:`glm5_fp4.spec.Glm5Spec`) makes ``balanced`` use GLM-5's grouped router when the
    expert count matches; otherwise plain top-k of random logits. ``hot_experts``: the measured rank's expert count
    on an expert-parallel shard (its experts are ``0..hot_experts-1``), where the skewed routings put their hot
    experts (module doc).
    """
    device = torch.device(device)
    t, e, k = tokens, num_experts, top_k
    check(name)
    if k > e:
        raise Glm5Fp4Error(f"top_k={k} exceeds the {e} experts")
    if hot_experts is not None and not 1 <= hot_experts <= e:
        raise Glm5Fp4Error(f"hot_experts={hot_experts}: the measured rank holds 1 to {e} of the {e} experts")
    n = hot_experts
    if name == "balanced":
        from glm5_fp4.reference import route

        logits = torch.randn(t, e, generator=gen, device=device)
        if spec is not None and spec.n_routed_experts == e and spec.num_experts_per_tok == k:
            bias = torch.randn(e, generator=gen, device=device) * 0.01
            w, ids = route(logits, bias, k, spec.n_group, spec.topk_group, routed_scaling_factor)
        else:
            w, ids = route(logits, None, k, routed_scaling_factor=routed_scaling_factor)
        return w.float(), ids.to(torch.int32)
    if name == "same_k":
        if n is None:
            chosen = torch.randperm(e, generator=gen, device=device)[:k]
        else:
            own = torch.randperm(n, generator=gen, device=device)[:k]
            rest = n + torch.randperm(e - n, generator=gen, device=device)[: k - own.numel()]
            chosen = torch.cat([own, rest])
        ids = chosen[None, :].expand(t, k)
    elif name == "one_hot":
        hot = int(torch.randint(0, e if n is None else n, (1,), generator=gen, device=device))
        logw = torch.zeros(e, device=device)
        logw[hot] = -math.inf
        rest = _gumbel_topk(logw, t, k - 1, gen)
        ids = torch.cat([torch.full((t, 1), hot, device=device, dtype=rest.dtype), rest], dim=1)
    else:  # zipfS (check() refused anything else)
        s = float(name[4:])
        if n is None:
            ranks = torch.randperm(e, generator=gen, device=device).float() + 1.0
        else:
            ranks = torch.cat([torch.randperm(n, generator=gen, device=device),
                               n + torch.randperm(e - n, generator=gen, device=device)]).float() + 1.0
        ids = _gumbel_topk(-s * torch.log(ranks), t, k, gen)
    return _weights(t, k, gen, device, routed_scaling_factor), ids.to(torch.int32).contiguous()


def loads(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert."""
    return torch.bincount(topk_ids.flatten().long(), minlength=num_experts)


def describe(topk_ids: torch.Tensor, num_experts: int) -> dict:
    """Experts touched, the busiest expert's tokens and the share of slots the 8 busiest take."""
    c = loads(topk_ids, num_experts)
    top = torch.sort(c, descending=True).values
    return {"experts_touched": int((c > 0).sum()), "max_tokens_per_expert": int(top[0]),
            "top8_share": float(top[:8].sum() / max(int(c.sum()), 1))}
