"""Which tensor-core instruction Triton gives ``tl.dot``, and how a benchmark or test asks for the other one.

On SM90 Triton lowers the MoE's dots to Hopper's ``wgmma``; sm_120 (RTX PRO 6000) has no wgmma and runs
``mma.sync m16n8k16`` (the compile matrix checks that instruction there). Triton's ``DISABLE_MMA_V3=1`` makes
it choose ``mma.sync`` on SM90 as well, so an H200 runs the instruction selection an SM120 gets for the W4A16
path; with the sm_120 plans (``configs.plan("sm120", ...)``) it runs the very kernels an RTX PRO 6000 would
launch, apart from ptxas's per-target scheduling, the SM count and the memory system.

Triton reads the variable when it compiles (it is one of the variables in its cache key), but its in-memory
kernel cache does not key on it: a process that compiled a kernel without it reuses that kernel. So set it
before the process compiles anything (:func:`force_mma_sync`), and check what was built (:func:`cached_mma`).
"""

from __future__ import annotations

import os
from pathlib import Path

MMA_SYNC_ENV = "DISABLE_MMA_V3"


def mma_sync_forced() -> bool:
    return os.environ.get(MMA_SYNC_ENV, "0") not in ("", "0")


def force_mma_sync(cache_dir: str | Path | None = None) -> Path:
    """Make this process's Triton compile dots to mma.sync, into a cache directory of its own (so that
    :func:`cached_mma` reads only kernels built under the variable); returns that directory."""
    os.environ[MMA_SYNC_ENV] = "1"
    base = cache_dir or os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache"
    own = Path(f"{base}-mma-sync") if not str(base).endswith("-mma-sync") else Path(base)
    os.environ["TRITON_CACHE_DIR"] = str(own)
    return own


def ptx_mma(ptx: str) -> list[str]:
    """The distinct tensor-core instruction forms a PTX module issues (e.g. ``["mma.sync m16n8k16 f16"]``)."""
    from glm5_fp4.sm120.build import scan_ptx

    ins = scan_ptx(ptx)
    return sorted(set(ins.mma) | set(ins.fp4_native))


def cached_mma(cache_dir: str | Path) -> dict[str, list[str]]:
    """Kernel name -> the tensor-core instruction forms of every build of it in a Triton cache directory
    (kernels without a dot are left out)."""
    out: dict[str, set[str]] = {}
    for ptx in Path(cache_dir).glob("*/*.ptx"):
        forms = ptx_mma(ptx.read_text(errors="replace"))
        if forms:
            out.setdefault(ptx.stem, set()).update(forms)
    return {k: sorted(v) for k, v in sorted(out.items())}


def wgmma_kernels(forms: dict[str, list[str]]) -> list[str]:
    """The kernels of :func:`cached_mma` that still use wgmma (none may, where mma.sync was forced)."""
    return [k for k, v in forms.items() if any(f.startswith("wgmma") for f in v)]


def add_standin_arguments(ap) -> None:
    """The two options a benchmark script takes to run another arch's plans with sm_120's instruction."""
    from glm5_fp4.kernels.configs import arch_tables

    ap.add_argument("--plan-arch", choices=arch_tables(), help="make every plan this architecture's (its tables, "
                    "rules and SM count) instead of this GPU's")
    ap.add_argument("--mma-sync", action="store_true", help="compile the dots to mma.sync (sm_120's instruction) "
                    "instead of Hopper's wgmma, in a Triton cache of their own; fails if any kernel still uses wgmma")


def what_was_built(cache_dir: str | Path | None) -> tuple[dict[str, list[str]], list[str]]:
    """(:func:`cached_mma` of ``cache_dir``, the kernels among them still on wgmma); nothing where no mma.sync run
    was asked for (``cache_dir`` None). A Triton that ignores the variable would time wgmma under an mma.sync label:
    callers fail the run when the second part is not empty."""
    if cache_dir is None:
        return {}, []
    forms = cached_mma(cache_dir)
    return forms, wgmma_kernels(forms)
