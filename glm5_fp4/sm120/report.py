"""Markdown for the compile matrix and the predicted floors (the JSON is the matrix's ``to_dict``)."""

from __future__ import annotations

import re

ARCH_TITLE = {"sm120": "sm_120 (RTX PRO 6000 Blackwell)", "sm100": "sm_100 (B200)", "sm90": "sm_90 (H200)"}


def _origins(origins: list[str]) -> str:
    """'tp8 w4a16 picked T=16', ... -> 'picked T=16..1024 (5); gemm1 candidate' (shape/mode are columns)."""
    by_label: dict[str, set[int]] = {}
    other = set()
    for o in origins:
        what = o.split(" ", 2)[-1]
        m = re.fullmatch(r"(.*) T=(\d+)", what)
        if m:
            by_label.setdefault(m.group(1), set()).add(int(m.group(2)))
        else:
            other.add(what)
    parts = []
    for label, ts in sorted(by_label.items()):
        t = sorted(ts)
        parts.append(f"{label} T={t[0]}" if len(t) == 1 else f"{label} T={t[0]}..{t[-1]} ({len(t)})")
    return "; ".join(parts + sorted(other))


# constexprs shown in their own columns (or constant across the matrix); every other one is part of the tile
_NOT_TILE = {"H", "I", "W4A4", "USE_ASM", "TOPK", "E_POW2", "DIAG", "SLOT_MODE", "PLACED"}


def _tile(cx: dict) -> str:
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in cx.items() if k not in _NOT_TILE)


def _sched(cx: dict, kernel: str) -> str:
    if "slot" in kernel or cx.get("SLOT_MODE"):
        return "slot"
    if "native" in kernel:
        return "native"
    if "gemm" in kernel:
        return "grouped"
    return "-"


def _fmt_int(v) -> str:
    return "?" if v is None else f"{v:,}"


def matrix_table(rows: list[dict]) -> list[str]:
    lines = [
        "| kernel | sched | tile | warps/stages | H, I | mode | shared B (limit %) | regs | spill st/ld B | intended | MMA found | cvt e4m3 | status | selected as |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {"moe_gemm1_kernel": 0, "moe_gemm2_grouped_kernel": 1, "moe_gemm2_slot_kernel": 2}

    def key(r):
        cx = r["constexprs"]
        tile = tuple(int(cx.get(k, 0)) for k in ("BN", "BM", "BK", "N_SPLIT", "BLOCK"))
        return (order.get(r["kernel"], 5 if "native" in r["kernel"] else 9), r["kernel"], -cx.get("H", 0),
                cx.get("I", 0), bool(cx.get("W4A4")), _sched(cx, r["kernel"]), tile, r["num_warps"], r["num_stages"])

    rows = sorted(rows, key=key)
    for r in rows:
        cx, b = r["constexprs"], r.get("build") or {}
        mode = "w4a4" if cx.get("W4A4") or "native" in r["kernel"] else ("w4a16" if "W4A4" in cx else "-")
        shape = f"{cx.get('H', '-')}, {cx.get('I', '-')}"
        if b:
            pct = 100.0 * b["shared_bytes"] / r["smem_limit"] if r["smem_limit"] else 0
            smem = f"{b['shared_bytes']:,} ({pct:.0f} %)"
            spill = f"{_fmt_int(b['spill_store_bytes'])}/{_fmt_int(b['spill_load_bytes'])}"
            ins = b["instructions"]
            mma = ", ".join(f"{k} x{v}" for k, v in sorted({**ins["mma"], **ins["fp4_native"]}.items())) or "-"
            cvt = str(ins["cvt_e4m3x2_f16x2"])
            regs = _fmt_int(b["registers"])
        else:
            smem = spill = mma = cvt = regs = "-"
        status = "ok" if r["ok"] else "**" + "; ".join(r["problems"]) + "**"
        if r.get("waived"):
            status += " (" + "; ".join(r["waived"]) + ": waived)"
        if r.get("error"):
            status += f" ({r['error'][:80]})"
        lines.append(
            f"| {r['kernel'].replace('moe_', '').replace('_kernel', '')} | {_sched(cx, r['kernel'])} | {_tile(cx)} | "
            f"{r['num_warps']}/{r['num_stages']} | {shape} | {mode} | {smem} | {regs} | {spill} | {r.get('intended') or '-'} | {mma} | {cvt} | "
            f"{status} | {_origins(r['origins'])} |"
        )
    return lines


def _cfg_str(c: dict) -> str:
    keys = ("bn", "bm", "bk", "num_warps", "num_stages")
    return "(" + ", ".join(f"{k}={c[k]}" for k in keys if k in c) + ")"


def floors_table(floors: list[dict], gpu_name: str, alt: list[str]) -> list[str]:
    bms = sorted({int(b) for f in floors for b in f["compute_floor_us_by_bm"]})
    head = ["TP", "T", "experts", "MB moved", f"BW floor µs ({gpu_name})"]
    head += [f"BW floor µs ({a})" for a in alt]
    head += ["plan (sched, gemm1, gemm2, split)", "programs g1/g2", "MMA GFLOP (padded)", "compute floor µs",
             *[f"compute µs @bm={b}" for b in bms], "FP4-MMA floor µs", "bound µs", "limiter"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in floors:
        g1, g2 = f["gemm1"], f["gemm2"]
        plan = f"{f['schedule']}, {_cfg_str(g1)}, {_cfg_str(g2)}, {f['gemm2_n_split']}"
        cells = [f"TP{f['tp']}", str(f["tokens"]), f"{f['experts_touched']:.1f}", f"{f['bytes_needed'] / 1e6:.1f}",
                 f"{f['bandwidth_floor_us']:.1f}"]
        cells += [f"{f['bandwidth_floor_us_alt'].get(a, float('nan')):.1f}" for a in alt]
        cells += [plan, f"{f['programs_gemm1']:.0f}/{f['programs_gemm2']:.0f}", f"{f['mma_gflop']:.2f}",
                  f"{f['compute_floor_us']:.1f}"]
        cells += [f"{f['compute_floor_us_by_bm'][str(b)]:.1f}" if str(b) in f["compute_floor_us_by_bm"] else "-" for b in bms]
        fp4 = f["fp4_mma_floor_us"]
        cells += ["-" if fp4 is None else f"{fp4:.2f}", f"{f['bound_us']:.1f}", f["limiter"]]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _selection(meta: dict) -> str:
    """What the run compiled (meta's candidates / opt_ins flags; runs before 2026-12-06 have no opt_ins: all)."""
    if meta.get("candidates", True):
        return ("Every kernel the backend may launch - the picker's plan for each batch size, the opt-in forms and "
                "every config of the per-arch candidate lists (`glm5_fp4/kernels/configs.py`)")
    if meta.get("opt_ins", True):
        return "The picker's plan for each batch size and the opt-in forms (`glm5_fp4/kernels/configs.py`), no candidate lists"
    return ("The default kernels only - the picker's plan for each batch size (`glm5_fp4/kernels/configs.py`), no "
            "candidate lists, no opt-in forms")


def _and(items) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def markdown(result: dict) -> str:
    """The whole report from the JSON dict (``MatrixResult.to_dict()`` plus optional ``floors``)."""
    meta, limits, rows = result["meta"], result["limits"], result["rows"]
    archs = [f"sm_{a[2:]}" for a in meta.get("archs") or ("sm120", "sm100", "sm90")]
    modes = [m.upper() for m in meta.get("modes") or ("w4a16", "w4a4")]
    sha = str(meta.get("git_sha") or "?")
    sha = sha[:12] + ("-dirty" if sha.endswith("-dirty") else "")  # short, but a dirty tree still says so
    lines = [
        f"# Compile matrix: fused NVFP4 MoE kernels for {_and(archs)}",
        "",
        f"Triton {meta['triton']} (CPU machine, no GPU), {meta['date']}, git {sha}. "
        + _selection(meta) + f", {_and(modes)}, shapes "
        + ", ".join(f"{s['name']} (E={s['num_experts']}, k={s['top_k']}, H={s['hidden']}, I={s['intermediate']})" for s in meta["shapes"])
        + " - specialised by Triton's own JIT binder and compiled ahead of time for each target. "
        f"{meta['distinct_kernels']} distinct kernels in {meta['elapsed_s']:.0f} s "
        f"({'fresh Triton cache' if meta['fresh_cache'] else 'Triton cache reused'}, {meta['cpu_count']} CPU cores).",
        "",
        "Shared memory is Triton's figure for the launch; registers and spills are ptxas's report for the same PTX "
        "(checked against the cubin's resource table); MMA and `cvt.rn.f16x2.e4m3x2` are counted in the PTX. "
        "Limits (opt-in shared memory per block, from `glm5_fp4/data/hardware.yaml`): "
        + ", ".join(f"{a}: {v:,} B" for a, v in limits.items())
        + ".",
        "",
        "## Verdict",
        "",
        "| target | kernels | ok | failing | failing GEMM configs (configs.py entries) |",
        "|---|---|---|---|---|",
    ]
    for arch in meta["archs"]:
        ar = [r for r in rows if r["arch"] == arch]
        bad = [r for r in ar if not r["ok"]]
        cfgs = result.get("failing_configs", {}).get(arch, [])
        desc = "; ".join(
            f"{c['config']['role']} {_cfg_str(c['config'])}{' (picker default)' if c.get('picked') else ''}: "
            + ", ".join(sorted({p.split(' (')[0].split(' ')[0] for w in c["where"] for p in w["problems"]}))
            for c in cfgs
        ) or "none"
        lines.append(f"| {ARCH_TITLE.get(arch, arch)} | {len(ar)} | {len(ar) - len(bad)} | {len(bad)} | {desc} |")
    lines.append("")
    for arch in meta["archs"]:
        for c in result.get("failing_configs", {}).get(arch, []):
            sel = "selected by the picker" if c.get("picked") else "candidate list only"
            lines.append(f"- **{arch}** {c['config']['role']} {_cfg_str(c['config'])} ({sel}):")
            for w in c["where"]:
                lines.append(f"  - {w['kernel']} ({w['schedule']}{', picked' if w.get('picked') else ''}), shapes "
                             f"{', '.join(w['shapes'])}, modes {', '.join(w['modes'])}: {'; '.join(w['problems'])}")
    waived = {}
    for r in rows:
        if r.get("waived"):
            waived.setdefault((r["arch"], r["kernel"], r["waiver_why"]), []).extend(r["waived"])
    if waived:
        lines += ["", "Spills waived (`configs.SPILL_WAIVERS`: shipped on that arch anyway, and why):"]
        for (arch, kernel, why), spills in sorted(waived.items()):
            lines.append(f"- **{arch}** {kernel}, {len(spills)} kernels ({', '.join(sorted(set(spills)))}): {why}")
    lines.append("")
    lines.append("Native FP4 MMAs (`mma.sync ... kind::mxf4nvf4.block_scale` on sm_120, `tcgen05.mma kind::mxf4nvf4` on "
                 "sm_100): " + _fp4_summary(rows) + ".")
    lines.append("")
    for arch in meta["archs"]:
        ar = [r for r in rows if r["arch"] == arch]
        lines += [f"## {ARCH_TITLE.get(arch, arch)}", ""]
        lines += matrix_table(ar)
        lines.append("")
    if result.get("floors"):
        fl = result["floors"]
        lines += [
            f"## Predicted floors on {fl['gpu_display']} ({fl['arch']}), GLM-5 routed experts per MoE layer",
            "",
            f"Bandwidth {fl['bandwidth_gbs']:.0f} GB/s (datasheet), dense 16-bit tensor peak {fl['peak_bf16_tflops']} "
            f"TFLOP/s, dense NVFP4 {fl['peak_nvfp4_tflops']} TFLOP/s, {fl['sm_count']} SMs (hardware table). "
            "Experts touched = E(1-(1-k/E)^T) under uniform routing; bytes = their NVFP4 weights + x read + output "
            "written (as `benchmarks/moe_kernel.py` counts). Compute floor = the MMA FLOPs the picker's plan issues "
            "(tokens padded to bm per expert; slot schedule: one bm block per routing slot) at the 16-bit peak; the "
            "`@bm` columns give it for each token tile of the sm_120 candidate lists (the floors of a config depend on "
            "its bm and schedule only). FP4-MMA floor = the opt-in native FP4 path's MMA FLOPs (padded to its bm) at "
            "the NVFP4 peak. Floors are lower bounds, not predictions: the same kernels reach a fraction of their floor "
            "on H200, and nothing here ran on an SM120 GPU.",
            "",
        ]
        lines += floors_table(fl["rows"], fl["gpu"], fl.get("alt", []))
        lines.append("")
    return "\n".join(lines) + "\n"


def _fp4_summary(rows: list[dict]) -> str:
    found = {}
    for r in rows:
        for form, n in ((r.get("build") or {}).get("instructions", {}).get("fp4_native", {}) or {}).items():
            found.setdefault(r["arch"], set()).add(form)
    if not found:
        return "none in any kernel - no native FP4 path was compiled (W4A4 mode emulates FP4 activations and runs fp16 MMAs)"
    kernels = sorted({r["kernel"] for r in rows if (r.get("build") or {}).get("instructions", {}).get("fp4_native")})
    return ("; ".join(f"{a}: {', '.join(sorted(f))}" for a, f in found.items())
            + f" (in {', '.join(kernels)}: the opt-in native path, GLM5_FP4_NATIVE_FP4=1; compiled here, never run on such a GPU)")
