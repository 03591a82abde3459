"""The self-test report: one JSON (everything) and one markdown (for a bug report or a quick read)."""

from __future__ import annotations

from pathlib import Path


def verdict(result: dict) -> str:
    """'pass' when every gating correctness case passed and the benchmark, where it ran, ran whole; 'partial' when
    the cases passed but the benchmark failed or lost rows (its numbers inform, so it does not fail the backend,
    but the run did not do all it was asked: a non-zero exit); 'fail' otherwise."""
    c = result.get("correctness") or {}
    if not c.get("cases") or c.get("failed", 1) != 0:
        return "fail"
    bench = result.get("benchmark")
    return "partial" if bench is not None and bench.get("status") != "ok" else "pass"


def summary_line(result: dict, md, js) -> str:
    """The console's last line: the verdict, the gating cases (informational ones apart) and the benchmark."""
    c = result.get("correctness") or {}
    gating = c.get("passed", 0) + c.get("failed", 0)
    info = c.get("informational_passed", 0) + c.get("informational_failed", 0)
    bench = result.get("benchmark")
    said = [f"{c.get('passed', 0)}/{gating} correctness cases passed"]
    if info:
        said.append(f"{info} informational ({c.get('informational_passed', 0)} passed)")
    said.append("benchmark not run" if bench is None else f"benchmark {bench.get('status')}"
                + (f": {bench['error']}" if bench.get("error") else ""))
    return f"verdict: {result['verdict'].upper()} ({'; '.join(said)}); report: {md} and {js}"


def _f(v, fmt="{:.1f}") -> str:
    return "—" if v is None or isinstance(v, str) else fmt.format(v)


def _cfg(d: dict | None) -> str:
    if not d:
        return "—"
    regs = f" r{d['maxnreg']}" if d.get("maxnreg") else ""  # a register cap (Gemm1Config.maxnreg)
    tma = " tma" if d.get("tma") else ""  # weight tiles by TMA (Gemm1Config.tma)
    stacked = " gate+up" if d.get("stacked") else ""  # gate and up rows as one tile (Gemm1Config.stacked)
    return "/".join(str(d[k]) for k in ("bn", "bm", "bk", "num_warps", "num_stages") if k in d) + regs + tma + stacked


def _tolerance(tol) -> str:
    """One bound, or one per mode (``{"w4a16": 4e-3, "w4a4": 1e-2}``)."""
    if isinstance(tol, dict):
        return ", ".join(f"{v:g} in {k.upper()}" for k, v in tol.items())
    return "—" if tol is None else f"{tol:g}"


def _experts_shape() -> str:
    """The MoE shape the benchmark runs (selftest.bench times Glm5Spec()'s experts)."""
    from glm5_fp4.spec import Glm5Spec

    spec = Glm5Spec()
    return (f"{spec.name} experts E={spec.n_routed_experts}, H={spec.hidden_size}, top-{spec.num_experts_per_tok}")


def markdown(result: dict) -> str:
    from glm5_fp4.bench.moe import l2_footnote, l2_mark

    env, meta = result["env"], result["meta"]
    corr = result.get("correctness") or {"cases": [], "passed": 0, "failed": 0, "tolerance": None}
    table = env.get("hardware_table") or {}
    lines = [
        f"# glm5-fp4 selftest: {env['gpu']} ({meta['date']})",
        "",
        f"**Verdict: {result['verdict'].upper()}** - {corr['passed']}/{corr['passed'] + corr['failed']} correctness "
        f"cases passed; benchmark {(result.get('benchmark') or {}).get('status', 'not run')}. "
        f"Mode: {'quick' if meta.get('quick') else 'full'}, {meta.get('elapsed_s', 0):.0f} s.",
        "",
        "## Machine",
        "",
        "| item | value |",
        "|---|---|",
    ]
    items = [
        ("GPU", f"{env['gpu']} (compute capability {env['compute_capability']}, {env['arch']}, {env['sm_count']} SMs, "
                f"{env['memory_gb']} GB; device {env['device_index']} of {env['device_count']})"),
        ("driver", env.get("driver") or "unknown"),
        ("CUDA runtime (torch)", env.get("cuda_runtime") or "unknown"),
        ("torch / triton", f"{env.get('torch')} / {env.get('triton')}"),
        ("glm5-fp4 / python", f"{env.get('glm5_fp4')} / {env.get('python')}"),
        ("engines", ", ".join(f"{k} {v}" for k, v in (env.get("engines") or {}).items() if v) or "none installed"),
        ("hardware table", f"{table['name']}: {table['mem_bandwidth_gbs']:.0f} GB/s datasheet" if table else
         "no entry (add one via GLM5_FP4_HARDWARE to get % of datasheet bandwidth)"),
        ("platform", env.get("platform", "")),
    ]
    lines += [f"| {k} | {v} |" for k, v in items]
    lines += [
        "",
        f"## Correctness (fused MoE vs float64 reference, relative error < {_tolerance(corr['tolerance'])})",
        "",
        "| shape | T | routing | mode | ids | schedule | gemm1 | gemm2 (split) | rel err | tolerance | finite | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in corr["cases"]:
        p = c.get("plan") or {}
        res = "pass" if c.get("passed") else "**FAIL**" + (f" ({c['error'][:120]})" if c.get("error") else "")
        if not c.get("gating", True):
            res += " (native FP4 path, not enabled: informational)"
        lines.append(
            f"| {c['shape']} | {c['tokens']} | {c.get('routing', 'balanced')} | {c['mode']} | {c.get('ids_dtype', '')} | "
            f"{_schedule(p)} | {_cfg(p.get('gemm1'))} | {_cfg(p.get('gemm2'))} ({p.get('gemm2_n_split', '—')}) | "
            f"{_f(c.get('rel_err'), '{:.2e}')} | {_f(c.get('tolerance'), '{:.0e}')} | {c.get('finite', '—')} | {res} |"
        )
    if corr.get("informational_failed") or corr.get("informational_passed"):
        lines += ["", f"Native FP4-MMA path (opt-in, GLM5_FP4_NATIVE_FP4=1; "
                      f"{'enabled' if corr.get('native_fp4_enabled') else 'not enabled'} here): "
                      f"{corr.get('informational_passed', 0)} passed, {corr.get('informational_failed', 0)} failed "
                      "(informational unless enabled)."]
    kernels = result.get("kernels")
    if isinstance(kernels, list) and kernels:
        lines += [
            "",
            "## Kernels compiled on this GPU",
            "",
            "| kernel | constexprs | warps/stages | shared B | registers | spills |",
            "|---|---|---|---|---|---|",
        ]
        for k in kernels:
            cx = ", ".join(f"{a}={b}" for a, b in k["constexprs"].items())
            lines.append(f"| {k['kernel']} | {cx} | {k['num_warps']}/{k.get('num_stages')} | {k['shared_bytes']} | "
                         f"{k.get('registers')} | {k.get('spills')} |")
    elif isinstance(kernels, dict):
        lines += ["", f"Kernel resources unavailable: {kernels.get('error')}"]
    bench = result.get("benchmark")
    lines += ["", f"## Benchmark (CUDA-graph replays, {_experts_shape()})", ""]
    if not bench:
        lines.append("Not run (--no-bench).")
    elif bench.get("status") == "error":
        lines.append(f"Failed: {bench.get('error')}")
    else:
        lines.append(
            f"Same-run device copy bandwidth {_f(bench.get('copy_gbs'), '{:.0f}')} GB/s, dense bf16 GEMM "
            f"{_f(bench.get('bf16_tflops'), '{:.0f}')} TFLOP/s. Floor = bytes needed (NVFP4 weights of the touched "
            "experts + activations) / copy bandwidth. Skew = time / the balanced routing's time at the same shard "
            "and T. Baselines (vLLM's Marlin MoE, torch bf16 / fp8 grouped GEMMs) ran in the same process; "
            f"Marlin: {bench.get('marlin') or 'not run'}."
        )
        lines += [
            "",
            "| shard | T | routing | experts | µs | floor µs | % copy BW | % datasheet BW | TFLOP/s | skew | W4A4 µs | "
            "Marlin µs | × vs Marlin | bf16 µs | × vs bf16 |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in bench.get("rows", []):
            if "error" in r:
                lines.append(f"| {r.get('shard')} | {r.get('tokens')} | {r.get('routing')} | **error**: "
                             f"{r['error'][:150]} |" + " |" * 11)
                continue
            lines.append(
                f"| {r['shard']} | {r['tokens']} | {r['routing']} | {r.get('experts_touched')} | "
                f"{_f(r.get('us'))}{l2_mark(r)} | "
                f"{_f(r.get('floor_us'))} | {_f(r.get('pct_copy_bw'), '{:.0f} %')} | {_f(r.get('pct_table_bw'), '{:.0f} %')} | "
                f"{_f(r.get('tflops'))} | {_f(r.get('skew_ratio'), '{:.2f}')} | {_f(r.get('us_w4a4'))} | "
                f"{_f(r.get('marlin_us'))} | {_f(r.get('speedup_vs_marlin'), '{:.2f}')} | "
                f"{_f(r.get('bf16_grouped_mm_us'))} | {_f(r.get('speedup_vs_bf16'), '{:.2f}')} |"
            )
        lines += l2_footnote(bench.get("rows", []), bench.get("l2_bytes"))
    for entry in (bench or {}).get("former_plans", []):
        lines += ["", f"### Former plans: `{entry['form']}`", "",
                  f"{entry.get('purpose', '')}. This GPU's default plans were picked on another GPU; the same run "
                  "times the former ones (balanced routing). A ratio below 1 means the former plan is faster here: "
                  "please report it with selftest.json.", ""]
        if "error" in entry:
            lines.append(f"Failed: {entry['error']}")
            continue
        lines += ["| shard | T | default µs | former µs | former / default |", "|---|---|---|---|---|"]
        for r in entry["rows"]:
            ratio = f"**error**: {r['error'][:120]}" if "error" in r else _f(r.get("former_over_default"), "{:.2f}")
            lines.append(f"| {r['shard']} | {r['tokens']} | {_f(r.get('default_us'))} | {_f(r.get('former_us'))} | "
                         f"{ratio} |")
    lines += ["", f"Command: `{meta.get('command', 'glm5-fp4 selftest')}`. Attach selftest.json to bug reports.", ""]
    return "\n".join(lines)


def write(result: dict, out_dir: Path) -> tuple[Path, Path]:
    from glm5_fp4.bench.meta import write_result

    return write_result(out_dir, "selftest", result, markdown(result))


def _schedule(p: dict) -> str:
    """The schedule with the plan's form: "slot dedup" (one program group per expert), "K/4" (GEMM1 split-K)."""
    label = p.get("schedule", "—")
    if p.get("slot_dedup"):
        label += " dedup"
    if (p.get("gemm1_split_k") or 1) > 1:
        label += f" K/{p['gemm1_split_k']}"
    return label
