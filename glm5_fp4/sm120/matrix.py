"""The compile matrix: every distinct kernel the backend may launch, compiled for each target, with verdicts.

A row is one distinct compiled kernel (launches that specialise identically share a row and list every
origin: shape, mode, schedule, config, batch size). Verdicts per row:

* ``smem``: shared memory per block above the target's opt-in limit (hardware table) - the launch fails,
* ``spill``: ptxas spilled registers to local memory (slow on every GPU: such a config ships only where
  ``configs.SPILL_WAIVERS`` says why, within its bytes; the row then lists it under ``waived``, not ``problems``),
* ``no_mma``: a kernel written with ``tl.dot`` came out without tensor-core MMAs,
* ``no_cvt``: the inline-PTX decode (``USE_ASM``) is missing its ``cvt.rn.f16x2.e4m3x2``,
* ``wrong_fp4``: a native FP4 MMA that is not the target's form (SM120 ``mma.sync kind::mxf4nvf4``, SM100
  ``tcgen05.mma kind::mxf4nvf4``); ``no_fp4_mma``: a ``tl.dot_scaled`` kernel (the native FP4 path) that
  did not lower to that form,
* ``error``: the compiler failed.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field

from glm5_fp4.bench.meta import git_sha
from glm5_fp4.sm120 import launches as L
from glm5_fp4.sm120.build import Build, compile_specialized, specialize

# The GPU whose limits and peaks stand for each target (glm5_fp4/data/hardware.yaml).
TARGET_GPU = {"sm120": "rtx-pro-6000-ws", "sm100": "b200", "sm90": "h200"}
# What tensor-core form a 16-bit ``tl.dot`` may take on each target.
MMA_FORMS = {
    "sm120": ("mma.sync",),  # no wgmma / tcgen05 on SM120
    "sm100": ("tcgen05.mma", "mma.sync"),
    "sm90": ("wgmma", "mma.sync"),
}
NATIVE_FP4_FORM = {"sm120": "mma.sync m16n8k64 kind::mxf4nvf4", "sm100": "tcgen05.mma kind::mxf4nvf4"}
GEMM_CONFIG_FIELDS = {"gemm1": "gemm1", "gemm2": "gemm2"}


def smem_limit(arch: str) -> int:
    from glm5_fp4.hardware import get_gpu

    return get_gpu(TARGET_GPU[arch]).smem_per_block_bytes


@dataclass
class Row:
    arch: str
    kernel: str
    constexprs: dict
    num_warps: int
    num_stages: int
    origins: list[str] = field(default_factory=list)
    configs: list[dict] = field(default_factory=list)  # the GEMM configs (as in configs.py) this kernel realises
    shapes: list[str] = field(default_factory=list)
    modes: list[str] = field(default_factory=list)
    build: dict | None = None
    intended: str = ""  # the instructions the kernel is meant to use on this target
    smem_limit: int = 0
    problems: list[str] = field(default_factory=list)
    error: str | None = None
    waived: list[str] = field(default_factory=list)  # spill problems a configs.SPILL_WAIVERS entry covers ...
    waiver_why: str = ""  # ... and that entry's why

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def _role(kernel: str) -> str | None:
    if "gemm1" in kernel:
        return "gemm1"
    if "gemm2" in kernel:
        return "gemm2"
    return None


def _config_dict(sel: L.Selection, launch) -> dict | None:
    role = _role(launch.name)
    if role is None:
        return None
    cfg = getattr(sel.plan, role)
    d = {"role": role, "schedule": sel.plan.schedule, **asdict(cfg)}
    if role == "gemm2":
        d["n_split"] = launch.kwargs.get("N_SPLIT", sel.plan.gemm2_n_split)
    return d


def verdicts(arch: str, kernel_src: str, constexprs: dict, b: Build, limit: int) -> list[str]:
    """Problems of one compiled kernel (empty: fits, no spills, intended instructions)."""
    out = []
    if b.shared_bytes > limit:
        out.append(f"smem {b.shared_bytes} B > {limit} B")
    if (b.spill_store_bytes or 0) + (b.spill_load_bytes or 0) > 0:
        out.append(f"spill {b.spill_store_bytes} B stores / {b.spill_load_bytes} B loads")
    if b.spill_store_bytes is None:
        out.append("spill unknown (no ptxas report)")
    ins = b.instructions
    forms, cvt = _expected_mma(arch, kernel_src, constexprs)
    if forms and not any(m.startswith(forms) for m in ins.mma) and not ins.fp4_native:
        out.append(f"no_mma (expected {' or '.join(forms)})")
    if cvt and ins.cvt_e4m3x2_f16x2 == 0:
        out.append("no_cvt (PTX decode without cvt.rn.f16x2.e4m3x2)")
    if "dot_scaled" in kernel_src and arch in NATIVE_FP4_FORM:
        want = NATIVE_FP4_FORM[arch].split(" kind")[0]
        if not any(f.startswith(want) and "mxf4nvf4" in f for f in ins.fp4_native):
            out.append(f"no_fp4_mma (tl.dot_scaled did not lower to {NATIVE_FP4_FORM[arch]})")
    for form in ins.fp4_native:
        if arch in NATIVE_FP4_FORM and not form.startswith(NATIVE_FP4_FORM[arch].split(" kind")[0]):
            out.append(f"wrong_fp4 ({form}; expected {NATIVE_FP4_FORM[arch]})")
    return out


def _kernel_source(fn) -> str:
    """The kernel's source plus everything it reaches in its module: @triton.jit helpers (transitively)
    and constexpr strings such as an inline-PTX body."""
    import re

    module_vars = fn.fn.__globals__
    seen, stack, parts = set(), [fn.src], []
    while stack:
        src = stack.pop()
        parts.append(src)
        for name in set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", src)):
            if name in seen or name not in module_vars:
                continue
            seen.add(name)
            val = module_vars[name]
            if hasattr(val, "src"):
                stack.append(val.src)
            elif isinstance(getattr(val, "value", None), str):
                parts.append(val.value)
    return "\n".join(parts)


@dataclass
class MatrixResult:
    meta: dict
    limits: dict
    rows: list[Row]

    def failures(self, arch: str | None = None) -> list[Row]:
        return [r for r in self.rows if not r.ok and (arch is None or r.arch == arch)]

    def failing_configs(self, arch: str) -> list[dict]:
        """Each GEMM config (as written in configs.py) with a failing kernel on ``arch``: where, why, and
        whether the picker selects it (``picked``) or only the candidate sweep may."""
        out: dict[tuple, dict] = {}
        for r in self.failures(arch):
            for cfg in r.configs:
                plain = {k: v for k, v in cfg.items() if k not in ("schedule", "n_split")}
                ent = out.setdefault(tuple(sorted(plain.items())), {"config": plain, "picked": False, "where": []})
                picked = any("picked" in o for o in r.origins)
                ent["picked"] = ent["picked"] or picked
                for w in ent["where"]:  # kernels differing only in N_SPLIT collapse into one entry
                    if (w["kernel"], w["schedule"], w["problems"]) == (r.kernel, cfg["schedule"], r.problems):
                        w["shapes"] = sorted(set(w["shapes"]) | set(r.shapes))
                        w["modes"] = sorted(set(w["modes"]) | set(r.modes))
                        w["picked"] = w["picked"] or picked
                        break
                else:
                    ent["where"].append({"kernel": r.kernel, "schedule": cfg["schedule"], "shapes": list(r.shapes),
                                         "modes": list(r.modes), "problems": r.problems, "picked": picked})
        return list(out.values())

    def to_dict(self) -> dict:
        return {"meta": self.meta, "limits": self.limits, "rows": [r.to_dict() for r in self.rows],
                "failing_configs": {a: self.failing_configs(a) for a in self.meta["archs"]}}


def plan_rows(archs, shapes=None, modes=("w4a16", "w4a4"), tokens=None, candidates=True, use_asm=True,
              opt_ins=True):
    """Distinct kernels per arch, each with its origins, and the specialisation to compile it with."""
    tokens = tokens or (L.DECODE_TOKENS + L.PREFILL_TOKENS)
    todo: dict[tuple, tuple[Row, object]] = {}
    for arch in archs:
        cc = L.CAPABILITY[arch]
        for sel in L.selections(arch, shapes, modes, tokens, candidates, use_asm, opt_ins):
            for launch in L.record(sel):
                sp = specialize(launch, cc)
                key = sp.key()
                if key not in todo:
                    cx = sp.constexpr_values()
                    todo[key] = (Row(arch, launch.name, cx, int(sp.options.num_warps), int(sp.options.num_stages)), sp)
                row = todo[key][0]
                row.origins.append(f"{sel.shape.name} {sel.mode} {sel.origin}")
                for lst, v in ((row.shapes, sel.shape.name), (row.modes, sel.mode)):
                    if v not in lst:
                        lst.append(v)
                cfg = _config_dict(sel, launch)
                if cfg is not None and cfg not in row.configs:
                    row.configs.append(cfg)
    return list(todo.values())


def _compile_row(row: Row, sp) -> Row:
    limit = smem_limit(row.arch)
    row.smem_limit = limit
    try:
        b = compile_specialized(sp)
    except Exception as exc:  # noqa: BLE001 - a compiler failure is a row verdict, not a crash
        row.error = f"{type(exc).__name__}: {str(exc)[:500]}"
        row.problems = ["error"]
        return row
    row.build = b.to_dict()
    src = _kernel_source(sp.fn)
    row.intended = intended(row.arch, src, row.constexprs)
    row.problems = verdicts(row.arch, src, row.constexprs, b, limit)
    waiver = spill_waiver(row, b)
    if waiver is not None:
        row.waived = [p for p in row.problems if p.startswith("spill ")]
        row.waiver_why = waiver.why
        row.problems = [p for p in row.problems if not p.startswith("spill ")]
    return row


def spill_waiver(row: Row, b: Build):
    """The configs.SPILL_WAIVERS entry covering this row's spill, if one does: same arch and kernel, every origin's
    mode among its modes, every GEMM1 config of the row its config, its hidden size, and no more spilled bytes."""
    from glm5_fp4.kernels import configs as C

    spilled = max(b.spill_store_bytes or 0, b.spill_load_bytes or 0)
    if not spilled:
        return None
    g1 = [{k: v for k, v in c.items() if k != "schedule"} for c in row.configs if c.get("role") == "gemm1"]
    for w in C.SPILL_WAIVERS:
        want = None if w.gemm1 is None else {"role": "gemm1", **asdict(w.gemm1)}
        if (w.arch == row.arch and w.kernel == row.kernel and set(row.modes) <= set(w.modes)
                and (w.hidden is None or row.constexprs.get("H") == w.hidden) and spilled <= w.max_bytes
                and ((want is None and not g1) or (want is not None and g1 and all(c == want for c in g1)))):
            return w
    return None


def _expected_mma(arch: str, kernel_src: str, constexprs: dict) -> tuple[tuple[str, ...], bool]:
    """(MMA forms the kernel must lower to, or none; whether its decode must use cvt.rn.f16x2.e4m3x2). A Triton
    kernel's tl.dot may take any of the arch's forms and decodes by PTX where USE_ASM; a Gluon kernel
    (kernels/gluon_moe.py) names the wgmma itself and always decodes by PTX."""
    gluon = "warpgroup_mma" in kernel_src
    forms = ("wgmma",) if gluon else (MMA_FORMS[arch] if "tl.dot" in kernel_src else ())
    cvt = (gluon or bool(constexprs.get("USE_ASM"))) and "cvt.rn.f16x2.e4m3x2" in kernel_src
    return forms, cvt


def intended(arch: str, kernel_src: str, constexprs: dict) -> str:
    """What the kernel should lower to on ``arch`` (for the report and the tests)."""
    if "dot_scaled" in kernel_src:
        return NATIVE_FP4_FORM.get(arch, "block-scaled MMA")
    forms, cvt = _expected_mma(arch, kernel_src, constexprs)
    if forms:
        return " or ".join(f"{f} f16" for f in forms) + (" + cvt.rn.f16x2.e4m3x2" if cvt else "")
    return "-"


_FORKED_TODO: list = []


def _compile_index(i: int) -> Row:
    row, sp = _FORKED_TODO[i]
    return _compile_row(row, sp)


def _compile_all(todo, jobs: int, progress=None) -> list[Row]:
    """Compile serially, or in ``jobs`` forked workers that inherit ``todo`` (JIT functions do not pickle)."""
    if jobs <= 1 or len(todo) < 2:
        rows = []
        for n, (row, sp) in enumerate(todo, 1):
            rows.append(_compile_row(row, sp))
            if progress:
                progress(n, len(todo), rows[-1])
        return rows
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    _FORKED_TODO[:] = todo
    try:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("fork")) as pool:
            rows = []
            for n, row in enumerate(pool.map(_compile_index, range(len(todo))), 1):
                rows.append(row)
                if progress:
                    progress(n, len(todo), row)
            return rows
    finally:
        _FORKED_TODO.clear()


def run_matrix(
    archs=L.ARCHS,
    shapes=None,
    modes=("w4a16", "w4a4"),
    tokens=None,
    candidates: bool = True,
    use_asm: bool = True,
    fresh_cache: bool = True,
    jobs: int = 1,
    progress=None,
    opt_ins: bool = True,
) -> MatrixResult:
    """Compile every distinct kernel for ``archs``. ``fresh_cache`` compiles into an empty Triton cache
    (honest compile times, every kernel really built); otherwise Triton's cache is reused."""
    import torch
    import triton
    from triton import knobs

    t0 = time.perf_counter()
    todo = plan_rows(archs, shapes, modes, tokens, candidates, use_asm, opt_ins)
    t_plan = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="glm5fp4-matrix-") as tmp, knobs.cache.scope():
        if fresh_cache:
            knobs.cache.dir = tmp  # (sets TRITON_CACHE_DIR too, so forked workers use it)
        rows = _compile_all(todo, jobs, progress)
    elapsed = time.perf_counter() - t0
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "git_sha": git_sha(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "jobs": jobs,
        "archs": list(archs),
        "shapes": [asdict(s) for s in (shapes or L.shape_classes())],
        "modes": list(modes),
        "tokens": list(tokens or (L.DECODE_TOKENS + L.PREFILL_TOKENS)),
        "candidates": candidates,
        "opt_ins": opt_ins,
        "use_asm": use_asm,
        "fresh_cache": fresh_cache,
        "distinct_kernels": len(rows),
        "plan_s": round(t_plan, 2),
        "elapsed_s": round(elapsed, 1),
        "compile_s_sum": round(sum((r.build or {}).get("compile_s", 0.0) for r in rows), 1),
    }
    return MatrixResult(meta, {a: smem_limit(a) for a in archs}, rows)
