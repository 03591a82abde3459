"""Eager vs piecewise vs full CUDA-graph capture of a GLM-5-shaped decode step, with this project's MoE kernel.

One GPU runs a TP8 rank's share of a GLM-5 decode step: 78 layers (3 dense + 75 MoE) of RMSNorm, the MLA
projections at TP8 width (q_a, q_b, kv_a, kv_b, o), attention over a context (SDPA stands in for MLA
decode; all-reduces are absent on one GPU), router GEMM + grouped top-k, the fused NVFP4 MoE kernel on a
TP8 expert shard (E=256, H=6144, I=256), the shared expert and the residual adds. Three ways to run it:

* ``eager``: every kernel launched from Python each step;
* ``piecewise``: what vLLM's piecewise mode does, everything between attention ops captured as CUDA graphs,
  attention itself launched eagerly (2 graphs + 1 eager attention per layer);
* ``full``: the whole step captured as one CUDA graph.

It reports step time (median of timed steps), kernel launches per step (counted with torch.profiler in
eager mode) and the launch overhead saved. All expert layers share one weight set (each reads 679 MB, far
beyond L2, so every layer still streams its weights from HBM).

    python benchmarks/cuda_graphs.py --out benchmarks/results/cuda_graphs_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from glm5_fp4.kernels import fused_moe, prepare_experts, reserve_workspace  # noqa: E402
from glm5_fp4.reference import NvFp4Experts, route  # noqa: E402
from glm5_fp4.bench.meta import result_metadata  # noqa: E402
from glm5_fp4.spec import GLM5  # noqa: E402
from moe_kernel import event_time_us  # noqa: E402  (benchmarks/moe_kernel.py: the same CUDA-event timing)

TP = 8


def random_nvfp4_experts(e: int, n: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Valid NVFP4 arrays drawn directly (quantizing 800M floats on the host would take minutes)."""
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device)
    scale = (torch.rand(e, n, k // 16, device=device) * 2 + 0.5).to(torch.float8_e4m3fn)
    gs = torch.full((e,), 1.0 / (6 * 448) / k**0.5, device=device)
    return packed, scale, gs


class Step:
    """Weights and buffers of one TP8 rank's decode step; `pieces()` splits it around attention."""

    def __init__(self, batch: int, context: int, layers: int, device):
        s = GLM5
        h, heads = s.hidden_size, s.num_attention_heads // TP
        self.b, self.layers, self.h = batch, layers, h
        bf = dict(dtype=torch.bfloat16, device=device)

        def w(o, i):
            return torch.randn(o, i, **bf) / i**0.5

        self.q_a, self.q_b = w(s.q_lora_rank, h), w(heads * s.qk_head_dim, s.q_lora_rank)
        self.kv_a = w(s.kv_lora_rank + s.qk_rope_head_dim, h)
        self.kv_b = w(heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)
        self.o = w(h, heads * s.v_head_dim)
        self.heads = heads
        self.k_cache = torch.randn(batch, heads, context, s.qk_head_dim, **bf)
        self.v_cache = torch.randn(batch, heads, context, s.v_head_dim, **bf)
        self.gate = w(s.n_routed_experts, h)
        self.bias = torch.zeros(s.n_routed_experts, device=device)
        i = s.moe_intermediate_size // TP
        p13, s13, g13 = random_nvfp4_experts(s.n_routed_experts, 2 * i, h, device)
        p2, s2, g2 = random_nvfp4_experts(s.n_routed_experts, h, i, device)
        self.experts = prepare_experts(NvFp4Experts(p13, s13, g13, p2, s2, g2))
        reserve_workspace(self.experts, s.num_experts_per_tok, max(batch, 1))
        self.shared13, self.shared2 = w(2 * i, h), w(h, i)
        di = s.intermediate_size // TP
        self.dense13, self.dense2 = w(2 * di, h), w(h, di)
        self.x = torch.randn(batch, h, **bf)
        self.resid = torch.empty_like(self.x)
        self.q = torch.empty(batch, heads, 1, s.qk_head_dim, **bf)
        self.attn = torch.empty(batch, heads * s.v_head_dim, **bf)
        self.kv_new = torch.empty(batch, heads * (s.qk_nope_head_dim + s.v_head_dim), **bf)

    def pre_attention(self, layer: int) -> None:
        s = GLM5
        self.resid.copy_(self.x)
        xn = F.rms_norm(self.x, (self.h,))
        q = F.rms_norm(xn @ self.q_a.T, (s.q_lora_rank,)) @ self.q_b.T
        self.q.copy_(q.view(self.b, self.heads, 1, s.qk_head_dim))
        # The new token's latent goes to the KV cache in a real model; a fixed buffer stands in for it.
        self.kv_new.copy_(F.rms_norm((xn @ self.kv_a.T)[:, : s.kv_lora_rank], (s.kv_lora_rank,)) @ self.kv_b.T)

    def attention(self, layer: int) -> None:
        o = F.scaled_dot_product_attention(self.q, self.k_cache, self.v_cache)
        self.attn.copy_(o.reshape(self.b, -1))

    def post_attention(self, layer: int) -> None:
        s = GLM5
        x = self.resid + self.attn @ self.o.T
        xn = F.rms_norm(x, (self.h,))
        if layer < s.first_k_dense:
            g, u = (xn @ self.dense13.T).chunk(2, dim=-1)
            y = (F.silu(g) * u) @ self.dense2.T
        else:
            weights, ids = route(xn @ self.gate.T, self.bias, s.num_experts_per_tok,
                                 routed_scaling_factor=s.routed_scaling_factor)
            y = fused_moe(xn, weights, ids, self.experts)
            g, u = (xn @ self.shared13.T).chunk(2, dim=-1)
            y = y + (F.silu(g) * u) @ self.shared2.T
        self.x.copy_(x + y)

    def eager(self) -> None:
        for layer in range(self.layers):
            self.pre_attention(layer)
            self.attention(layer)
            self.post_attention(layer)


def count_launches(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def capture(fn, stream) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    return g


def run_batch(batch: int, context: int, layers: int, steps: int) -> dict:
    step = Step(batch, context, layers, "cuda")
    for _ in range(3):
        step.eager()
    torch.cuda.synchronize()
    launches = count_launches(step.eager)
    eager_us = event_time_us(step.eager, iters=steps, warmup=1)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pre = [capture(lambda i=i: step.pre_attention(i), stream) for i in range(layers)]
        post = [capture(lambda i=i: step.post_attention(i), stream) for i in range(layers)]
        full = capture(step.eager, stream)
    torch.cuda.current_stream().wait_stream(stream)

    def piecewise():
        for i in range(layers):
            pre[i].replay()
            step.attention(i)
            post[i].replay()

    piecewise()
    full.replay()
    torch.cuda.synchronize()
    piecewise_us = event_time_us(piecewise, iters=steps, warmup=1)
    full_us = event_time_us(full.replay, iters=steps, warmup=1)
    eager_attention_launches = count_launches(lambda: [step.attention(i) for i in range(layers)])
    return {
        "batch": batch, "context": context, "layers": layers,
        "eager_us": eager_us, "piecewise_us": piecewise_us, "full_us": full_us,
        "kernels_per_step": launches,
        "host_launches_per_step": {"eager": launches, "piecewise": 2 * layers + eager_attention_launches, "full": 1},
        "saved_by_piecewise_us": eager_us - piecewise_us, "saved_by_full_us": eager_us - full_us,
        "per_launch_overhead_us": (eager_us - full_us) / max(launches - 1, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "cuda_graphs_h200.json"))
    parser.add_argument("--batches", default="1,64,512")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=GLM5.num_layers)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2

    rows = []
    for b in (int(v) for v in args.batches.split(",")):
        r = run_batch(b, args.context, args.layers, args.steps)
        rows.append(r)
        print(f"B={b:4d}: eager {r['eager_us'] / 1000:8.2f} ms | piecewise {r['piecewise_us'] / 1000:8.2f} ms | "
              f"full {r['full_us'] / 1000:8.2f} ms | {r['kernels_per_step']} kernels/step | "
              f"saved by full graph {r['saved_by_full_us'] / 1000:.2f} ms", flush=True)
        torch.cuda.empty_cache()
    result = {
        **result_metadata(benchmark="cuda_graphs", tp_shard=TP),
        "method": f"median of {args.steps} steps timed with CUDA events; launches counted with torch.profiler (eager)",
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
