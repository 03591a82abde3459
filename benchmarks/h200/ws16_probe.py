"""The 16-token warp-specialised GEMM1 (opt-in gemm1_ws16) row by row: its act rows against the default GEMM1's on the
same work list, the worst error per row's place within its block and per 64 act columns, for variants that change one
thing (one activation pass of 16 rows instead of two of 8, K tiles of 64). How write-up 30 found the removed ws=2
mode's race (rows wrong only once a CTA took several work items); a pattern by place or column points at the
activation passes or the operand layout.

    python3 benchmarks/h200/ws16_probe.py        (a GPU; prints one block per variant)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))  # from any folder
from test_moe_kernel_gpu import GLM_TP8, experts, inputs  # noqa: E402

from glm5_fp4.kernels import configs as C  # noqa: E402
from glm5_fp4.kernels import launch as L  # noqa: E402
from glm5_fp4.kernels.moe import default_plan, make_call  # noqa: E402


def act_rows(x, w, ids, prep, plan):
    """GEMM1's act rows (sorted positions) and each row's place within its work-list block."""
    call = make_call(x, w, ids, prep, "w4a16")
    call.workspace.act.fill_(float("nan"))
    L.run(L.launches(plan, call, ("align", "gemm1")))
    torch.cuda.synchronize()
    nb = int(call.workspace.num_blocks.item())
    blocks = call.workspace.blocks[:nb].long().cpu()
    rows = call.num_slots
    place = torch.full((rows,), -1, dtype=torch.long)
    for _, start, count, _ in blocks.tolist():
        place[start:start + count] = torch.arange(count)
    return call.workspace.act[:rows].float().clone(), place


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)  # --help, and no stray arguments
    if not torch.cuda.is_available():
        raise SystemExit("ws16_probe needs a CUDA GPU")
    ex, prep = experts(**GLM_TP8)
    e, h, k = GLM_TP8["e"], GLM_TP8["h"], GLM_TP8["k"]
    for t, routing in ((64, "balanced"), (16, "same_k")):
        torch.manual_seed(0)
        x, w, ids = inputs(t, e, h, k, routing=routing)
        base = default_plan(x, ids, prep, "w4a16")
        ws16 = default_plan(x, ids, prep, "w4a16", form="gemm1_ws16")
        ref, place = act_rows(x, w, ids, prep, base)
        print(f"T={t} {routing}: base {base.gemm1} split {base.gemm1_split_k}; ws16 {ws16.gemm1}")
        passes = C.WS_X_PASSES
        variants = {
            "ws16": (ws16, passes),
            "ws16_one_pass": (ws16, 1),  # one pass of 16 rows (launch._check_ws refuses it: allowed here alone)
            "ws16_bk64": (dataclasses.replace(ws16, gemm1=dataclasses.replace(ws16.gemm1, bk=64)), passes),
        }
        for name, (plan, n_passes) in variants.items():
            C.WS_X_PASSES, verified = n_passes, C.WS_X_ROWS_VERIFIED
            C.WS_X_ROWS_VERIFIED = C.ws_x_pass_rows(plan.gemm1)
            try:
                got = act_rows(x, w, ids, prep, plan)
            except Exception as exc:  # noqa: BLE001 - a probe: say what failed and go on
                print(f"  {name}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            finally:
                C.WS_X_PASSES, C.WS_X_ROWS_VERIFIED = passes, verified
            got, _ = got
            scale = ref.abs().mean().item()
            d = torch.nan_to_num((got - ref).abs(), nan=1e9).amax(dim=1).cpu() / scale
            by_place = [round(d[place == j].max().item(), 3) for j in range(int(place.max()) + 1)]
            cols = torch.nan_to_num((got - ref).abs(), nan=1e9).amax(dim=0).view(-1, 64).amax(dim=1) / scale
            print(f"  {name}: max rel {d.max().item():.3g} nan rows {int(got.isnan().any(dim=1).sum())} "
                  f"bad rows {int((d > 0.05).sum())}/{d.numel()}\n    by place in block {by_place}\n"
                  f"    by 64 act columns {[round(c, 3) for c in cols.tolist()]}")


if __name__ == "__main__":
    main()
