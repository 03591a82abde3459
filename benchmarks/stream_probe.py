"""How fast can a GEMM1-shaped Triton loop stream NVFP4 expert weights on this GPU, and does the weight layout
decide it? (issue 13, goal 1). One GPU call (on the lent H200: `. benchmarks/gpu_deps.sh` first).

GEMM1 holds each expert as row-major packed words ``[2I, H/2 bytes]`` and scales ``[2I, H/16]``: a K tile of a
64-row weight tile is 64 runs of 128 bytes (and 64 runs of 16 scale bytes) at the row stride. The probe streams
every expert's gate/up rows of a TP shard with the kernel's loop structure -- per program one (expert, N tile),
per K tile a [BN, BK/4] fp16 view of the words, widened in registers to a [BN, BK] MMA operand and multiplied
with an activation tile (as the real decode feeds the MMA) -- and times it for two layouts of the same bytes:

* ``rows``: today's row-major layout;
* ``ktiles``: K-tile-major (``[H/BK, 2I, BK/2 bytes]`` per expert): each K tile of a weight tile is one
  contiguous run (8 KB of words, 1 KB of scales at BN=64, BK=256).

Bandwidth is reported against a device copy (read + write) measured in the same run. ``--no-x`` keeps one
activation tile in registers (the weight stream alone); ``--no-widen`` multiplies the fp16 view as is (the stream's
own ceiling: a quarter of the MMA work, no register shuffles); ``--no-dot`` drops the MMA (the loads then are not
software-pipelined by Triton: a latency bound, not a streaming one).

    python benchmarks/stream_probe.py --json probe.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _probe_kernel(w_ptr, s_ptr, x_ptr, out_ptr, H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr,
                  BM: tl.constexpr, BK: tl.constexpr, KTILES: tl.constexpr, LOAD_X: tl.constexpr,
                  DOT: tl.constexpr, STAGES: tl.constexpr, WIDEN: tl.constexpr = True,
                  EXPERTS_FASTEST: tl.constexpr = False, ROTATE: tl.constexpr = False):
    NT: tl.constexpr = I // BN
    E = tl.num_programs(0) // NT
    pid = tl.program_id(0)
    if EXPERTS_FASTEST:  # the grouped GEMM1's order: one N tile of every expert side by side
        e = (pid % E).to(tl.int64)
        n = pid // E
    else:
        e = (pid // NT).to(tl.int64)
        n = pid % NT
    NK: tl.constexpr = H // BK
    RW: tl.constexpr = H // 4  # fp16 views per row (H/2 bytes)
    KW: tl.constexpr = BK // 4  # fp16 views per row per K tile
    KS: tl.constexpr = BK // 16  # scale bytes per row per K tile
    rows = n * BN + tl.arange(0, BN)
    ow = tl.arange(0, KW)
    osc = tl.arange(0, KS)
    if KTILES:
        pw = w_ptr + e * (2 * I * RW) + rows[:, None] * KW + ow[None, :]
        ps = s_ptr + e * (2 * I * (H // 16)) + rows[:, None] * KS + osc[None, :]
        w_step: tl.constexpr = 2 * I * KW
        s_step: tl.constexpr = 2 * I * KS
        up_w: tl.constexpr = I * KW
        up_s: tl.constexpr = I * KS
    else:
        pw = w_ptr + e * (2 * I * RW) + rows[:, None] * RW + ow[None, :]
        ps = s_ptr + e * (2 * I * (H // 16)) + rows[:, None] * (H // 16) + osc[None, :]
        w_step: tl.constexpr = KW
        s_step: tl.constexpr = KS
        up_w: tl.constexpr = I * RW
        up_s: tl.constexpr = I * (H // 16)
    XK: tl.constexpr = BK if WIDEN else KW
    ok = tl.arange(0, XK)
    om = tl.arange(0, BM)
    px = x_ptr + ok[:, None] * BM + om[None, :]
    x_keep = tl.load(px)
    acc_g = tl.zeros((BN, BM), dtype=tl.float32)
    acc_u = tl.zeros((BN, BM), dtype=tl.float32)
    acc_s = tl.zeros((BN, KS), dtype=tl.int32)
    acc_w = tl.zeros((BN, KW), dtype=tl.float16)
    for kt0 in tl.range(0, H // BK, num_stages=STAGES):
        if ROTATE:  # each expert starts its K loop at another K tile, so concurrent programs spread over K
            kt = (kt0 + e.to(tl.int32)) % NK
        else:
            kt = kt0
        wg = tl.load(pw + kt * w_step)
        wu = tl.load(pw + (kt * w_step + up_w))
        sg = tl.load(ps + kt * s_step)
        su = tl.load(ps + (kt * s_step + up_s))
        acc_s += sg.to(tl.int32) + su.to(tl.int32)
        if DOT:
            if LOAD_X:
                xt = tl.load(px + kt * (XK * BM))
            else:
                xt = x_keep
            # [BN, KW] -> [BN, BK]: the register widening a decode does (values are nonsense; bytes are not)
            if WIDEN:
                og = tl.reshape(tl.join(tl.join(wg, wg), tl.join(wg, wg)), (BN, BK))
                ou = tl.reshape(tl.join(tl.join(wu, wu), tl.join(wu, wu)), (BN, BK))
            else:
                og = wg
                ou = wu
            acc_g = tl.dot(og, xt, acc_g)
            acc_u = tl.dot(ou, xt, acc_u)
        else:
            acc_w += wg + wu
    total = tl.sum(acc_g + acc_u, 1) + tl.sum(acc_s, 1).to(tl.float32) + tl.sum(acc_w.to(tl.float32), 1)
    tl.store(out_ptr + pid * BN + tl.arange(0, BN), total)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", default="tp8,tp4")
    ap.add_argument("--tiles", default="64x32x256,64x32x128,128x32x128",
                    help="BNxBMxBK of the GEMM1 tile (BN weight rows of gate and of up, BM tokens, BK K)")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--no-x", action="store_true")
    ap.add_argument("--no-dot", action="store_true")
    ap.add_argument("--no-widen", action="store_true", help="the MMA takes the [BN, BK/4] fp16 view of the words "
                    "as is (a quarter of the real MMA work, no register widening): the stream's own ceiling")
    ap.add_argument("--orders", default="n_fastest", help="comma-separated grid orders: n_fastest (each expert's "
                    "N tiles side by side), experts_fastest (the grouped GEMM1's: one N tile of every expert)")
    ap.add_argument("--rotate", default="0", help="comma-separated 0/1: each expert starts its K loop at K tile "
                    "e mod H/BK")
    ap.add_argument("--json", default="stream_probe.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    from glm5_fp4.bench.meta import result_metadata
    from glm5_fp4.bench.moe import glm5_shard
    from glm5_fp4.bench.timing import copy_bandwidth_gbs

    dev = "cuda"
    copy_bw = copy_bandwidth_gbs()
    rows = []
    for shard in args.shards.split(","):
        sh = glm5_shard(shard)
        H, I, E = sh.hidden, sh.intermediate, sh.num_experts
        w = torch.randint(-2**15, 2**15, (E, 2 * I, H // 4), dtype=torch.int16, device=dev).view(torch.float16)
        w = torch.where(torch.isfinite(w), w, torch.zeros_like(w))
        s = torch.randint(0, 127, (E, 2 * I, H // 16), dtype=torch.uint8, device=dev)
        nbytes = w.numel() * 2 + s.numel()
        for tile, stages, warps, order, rot in itertools.product(
                args.tiles.split(","), args.stages.split(","), args.warps.split(","), args.orders.split(","),
                args.rotate.split(",")):
            bn, bm, bk = (int(v) for v in tile.split("x"))
            if I % bn:
                continue
            x = torch.randn(H, bm, dtype=torch.float16, device=dev)
            out = torch.empty(E * I, dtype=torch.float32, device=dev)
            for ktiles in (False, True):
                key = dict(shard=shard, tile=tile, stages=int(stages), warps=int(warps), order=order,
                           rotate=rot == "1", layout="ktiles" if ktiles else "rows")
                fn = lambda: _probe_kernel[(E * (I // bn),)](  # noqa: E731
                    w, s, x, out, H, I, bn, bm, bk, ktiles, not args.no_x, not args.no_dot, int(stages), not args.no_widen,
                    order == "experts_fastest", rot == "1", num_warps=int(warps))
                try:
                    fn()
                    ms = triton.testing.do_bench(fn, warmup=10, rep=100)
                except Exception as exc:  # noqa: BLE001 -- a tile that does not fit is a row, not a crash
                    rows.append({**key, "error": f"{type(exc).__name__}: {exc}"[:200]})
                    print(rows[-1], flush=True)
                    continue
                bw = nbytes / ms / 1e6
                rows.append({**key, "us": round(ms * 1e3, 1), "gb_s": round(bw, 1),
                             "pct_copy": round(100 * bw / copy_bw, 1)})
                print(rows[-1], flush=True)
        del w, s
    meta = result_metadata(benchmark="stream_probe", copy_gb_s=round(copy_bw, 1), load_x=not args.no_x,
                           dot=not args.no_dot, widen=not args.no_widen, tiles=args.tiles, warps=args.warps)
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
