"""How fast the bytes of a T <= 2 MoE layer can be read at all, by one launch or by two (issue 13, goal 4: TP8 T=1 <=
12 us per layer; the fused kernel takes ~18 us on an H100). Each variant reads exactly the weight bytes the layer
reads -- the routed experts' gate/up words and scales, then their down words and scales, out of the same prepared
layers the benchmark times, as many distinct layers per CUDA graph as the table uses (glm5_fp4.bench.moe.layer_count:
the fewest experts a routing touches overflow twice the GPU's L2; the results before 2026-12-07 used 4, which a 50 MB
L2 can serve at TP8 T=1; each row records ``layers`` and ``l2_may_serve``) -- and does no arithmetic beyond an XOR
per 8 bytes:

* ``layer``: the fused MoE on its default plan (reference; ``gemm1``: its GEMM1 stage alone);
* ``read1``: one launch reading all four regions (the floor of a single-kernel form);
* ``read2``: two launches under programmatic dependent launch, gate/up then down, the second reading only after
  the first has finished (the two-launch form's floor);
* ``read2_pf``: the same with the second launch asking L2 for its bytes before it waits (what GEMM2 does);
* ``chain2``: read2 plus the dependent round trips of today's form: every first-launch program stores its result
  and arrives on a per-slot counter, the last one re-reads the slot's results and writes one value (GEMM1's fused
  split-K reduce), and every second-launch program reads that value after the wait and arrives likewise (GEMM2 by
  slots and its sum).

Programs read 32 KB each (``--chunk``), about three per SM on the first launch, like the slot GEMM1. Wrong results
by design: nothing is checked; the numbers bound what a form with this launch structure can reach.

    python3 benchmarks/small_t_floor.py --tokens 1,2 --json small_t_floor.json
"""

from __future__ import annotations

import argparse
import json
import sys

import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda


@triton.jit
def _read_chunk(p, C: tl.constexpr, ROWS: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * 16 + tl.arange(0, 16)[None, :]
    acc = tl.zeros((ROWS, 16), dtype=tl.int64)
    for i in tl.static_range(0, C, ROWS * 16):
        acc ^= tl.load(p + i + offs)
    return tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0)


@triton.jit
def _floor_kernel(ids_ptr, r0, r1, r2, r3, s0, s1, s2, s3, out_ptr, cnt_ptr, val_ptr,
                  P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr, C: tl.constexpr,
                  ROWS: tl.constexpr, NP: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr,
                  ARRIVE: tl.constexpr, READ_VAL: tl.constexpr):
    """Grid (P0+P1+P2+P3, slots): program (c, slot) reads chunk c of the regions r0..r3 (each [E, stride] int64,
    P_i chunks of C elements per expert) of the slot's expert."""
    c = tl.program_id(0)
    slot = tl.program_id(1)
    e = tl.load(ids_ptr + slot).to(tl.int64)
    if c < P0:
        base = r0 + e * s0 + c.to(tl.int64) * C
    elif c < P0 + P1:
        base = r1 + e * s1 + (c - P0).to(tl.int64) * C
    elif c < P0 + P1 + P2:
        base = r2 + e * s2 + (c - P0 - P1).to(tl.int64) * C
    else:
        base = r3 + e * s3 + (c - P0 - P1 - P2).to(tl.int64) * C
    if PREFETCH:
        offs = tl.arange(0, C // 16) * 16  # one request per 128 bytes
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [base + offs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    if USE_PDL:
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()
    v = _read_chunk(base, C, ROWS)
    if READ_VAL:
        v ^= tl.load(val_ptr + slot, cache_modifier=".cg")
    tl.store(out_ptr + slot * NP + c, v)
    if ARRIVE:
        tl.debug_barrier()
        last = tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu") == NP - 1
        if last:
            tl.atomic_xchg(cnt_ptr + slot, 0, sem="relaxed", scope="gpu")
            allv = tl.load(out_ptr + slot * NP + tl.arange(0, 128), mask=tl.arange(0, 128) < NP, other=0,
                           cache_modifier=".cg")
            tl.store(val_ptr + slot, tl.xor_sum(allv, axis=0))


def _views(p, chunk: int):
    """The prepared layer's four weight regions as [E, n] int64 views, and the chunks per expert of each."""
    import torch

    regions = [p.w13, p.w13_scale, p.w2, p.w2_scale]
    views = [r.reshape(r.shape[0], -1).view(dtype=torch.int64) for r in regions]
    for v in views:
        if v.shape[1] % chunk:
            raise SystemExit(f"region of {v.shape[1]} int64 per expert is not a multiple of --chunk {chunk}")
    return views, [v.shape[1] // chunk for v in views]


DEVICE = "cuda"  # the tests run the script's bookkeeping on the CPU


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shard", default="tp8", help="a TP shard (the floor kernel reads experts by the router's ids)")
    ap.add_argument("--tokens", default="1,2")
    ap.add_argument("--layers", type=int, default=None,
                    help="distinct expert sets per graph; default: the table's rule, enough that the fewest experts a "
                         "routing touches overflow twice the GPU's L2 (at least 4)")
    ap.add_argument("--chunk", type=int, default=4096, help="int64 elements each program reads (4096: 32 KB)")
    ap.add_argument("--json", default="small_t_floor.json")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    from glm5_fp4.bench import moe as B
    from glm5_fp4.bench.meta import git_sha
    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.outputs import output_file

    try:
        tokens = B.token_counts(args.tokens)
        if B.glm5_shard(args.shard).expert_parallel:
            raise Glm5Fp4Error(f"--shard {args.shard}: a TP shard only (the floor kernel indexes the layer by the "
                               "router's global expert ids)")
        if args.layers is not None and args.layers < 1:
            raise Glm5Fp4Error(f"--layers {args.layers}: at least one layer per CUDA graph")
        if args.chunk < 1 or args.chunk & (args.chunk - 1):  # 0 divided by zero, -64 gave negative program counts
            raise Glm5Fp4Error(f"--chunk {args.chunk}: a power of two (int64 elements per program, a Triton range)")
        output_file(args.json, "--json")  # (written after every row is timed)
        git_sha()  # a GLM5_FP4_GIT_SHA that names no commit
    except Glm5Fp4Error as exc:
        ap.error(str(exc))
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("small_t_floor needs a CUDA GPU", file=sys.stderr)
        return 2
    from glm5_fp4.bench.meta import result_metadata
    from glm5_fp4.bench.timing import copy_bandwidth_gbs, graph_time_us

    gen = torch.Generator(device=DEVICE).manual_seed(1)
    sh = B.glm5_shard(args.shard)
    l2 = B.l2_cache_bytes(DEVICE)
    count = B.layer_count(sh, args.layers, l2, DEVICE)
    layers = B.make_layers(sh, count, gen, device=DEVICE)
    copy = copy_bandwidth_gbs()
    rows = []
    for t in tokens:
        call = B.call_inputs(sh, t, "balanced", gen, DEVICE)
        x, tw, ids = call.x, call.tw, call.ids
        ids32 = ids.to(torch.int32).reshape(-1).contiguous()
        slots = ids32.numel()
        per = [_views(p, args.chunk) for p in layers.prepared]
        counts = per[0][1]
        np_all = sum(counts)
        out = torch.zeros(slots * 128, dtype=torch.int64, device=DEVICE)
        cnt = torch.zeros(slots, dtype=torch.int32, device=DEVICE)
        val = torch.zeros(slots, dtype=torch.int64, device=DEVICE)
        nbytes = sum(int(v.shape[1]) * 8 for v in per[0][0]) * len(set(ids32.tolist()))

        def launch(views, regions, pdl, prefetch=False, arrive=False, read_val=False):
            ps = [counts[i] if i in regions else 0 for i in range(4)]
            np_ = sum(ps)
            r = [views[i] if i in regions else views[regions[0]] for i in range(4)]
            _floor_kernel[(np_, slots)](
                ids32, *r, *[v.shape[1] for v in r], out, cnt, val, P0=ps[0], P1=ps[1], P2=ps[2], P3=ps[3],
                C=args.chunk, ROWS=32, NP=np_, USE_PDL=pdl, PREFETCH=prefetch, ARRIVE=arrive, READ_VAL=read_val,
                num_warps=4, launch_pdl=pdl)

        def variant(kind):
            def run():
                for views, _ in per:
                    if kind == "read1":
                        launch(views, (0, 1, 2, 3), True)
                    elif kind == "read1_13":
                        launch(views, (0, 1), True)
                    else:
                        launch(views, (0, 1), True, arrive=kind == "chain2")
                        launch(views, (2, 3), True, prefetch=kind in ("read2_pf", "chain2"),
                               arrive=kind == "chain2", read_val=kind == "chain2")
            return run

        times = {k: graph_time_us(variant(k), replays=50) / len(per)
                 for k in ("read1", "read1_13", "read2", "read2_pf", "chain2")}
        times["layer"] = call.time(layers)
        times["gemm1"] = call.time(layers, stages=("align", "gemm1"))
        floor_us = nbytes / copy / 1e3
        row = dict(tokens=t, slots=slots, programs_per_slot=np_all, bytes=nbytes, floor_us=floor_us, layers=count,
                   l2_may_serve=B.l2_may_serve(count, call.weight_bytes, l2), us=times)
        rows.append(row)
        print(f"T={t}: {nbytes / 1e6:.1f} MB, copy-bandwidth floor {floor_us:.1f} us; "
              + ", ".join(f"{k} {v:.1f}" for k, v in times.items()), flush=True)
    res = dict(meta=result_metadata(copy_gbs=copy, shard=args.shard, layers=count, l2_bytes=l2, chunk=args.chunk),
               rows=rows)
    from glm5_fp4.outputs import write_file

    write_file(args.json, json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
