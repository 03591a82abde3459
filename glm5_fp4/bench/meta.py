"""The metadata block every committed benchmark result carries (machine, versions, date and git SHA), and how a
result is written (JSON with everything, markdown next to it)."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import subprocess
from pathlib import Path


def git_sha(path: str | Path | None = None) -> str | None:
    """The checkout's HEAD (with ``-dirty`` when tracked files changed), or None outside a git checkout (without
    ``path``: outside glm5-fp4's own, where the package is the checkout's top-level ``glm5_fp4``).

    ``GLM5_FP4_GIT_SHA`` overrides it: on a machine that received a copy of the working tree (the lent GPUs)
    the copy's ``.git`` is stale, and the caller knows the commit it sent. That copy may not know the commit, so a
    full 40-hex SHA (``git rev-parse HEAD`` where it was sent from, ``-dirty`` allowed) stands as given; a shorter
    value must name a commit this checkout knows (it is recorded in full); anything else is refused (a Glm5Fp4Error
    naming the value): results would record a commit no one can check out."""
    package = Path(__file__).resolve().parents[1]
    cwd = Path(path) if path else package
    override = os.environ.get("GLM5_FP4_GIT_SHA")
    if override:
        return _override_sha(override, cwd)
    try:
        if path is None:  # an install inside someone's repository (a project's .venv) is not our checkout
            top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=cwd, capture_output=True, text=True,
                                 timeout=10)
            if top.returncode != 0 or Path(top.stdout.strip()).resolve() != package.parent:
                return None
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _override_sha(value: str, cwd: Path) -> str:
    from glm5_fp4.errors import Glm5Fp4Error

    m = re.fullmatch(r"([0-9a-fA-F]{4,40})(-dirty)?", value)
    if m and len(m.group(1)) == 40:
        return m.group(1).lower() + (m.group(2) or "")
    if m:
        try:
            full = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{m.group(1)}^{{commit}}"], cwd=cwd,
                                  capture_output=True, text=True, timeout=10)
            if full.returncode == 0:
                return full.stdout.strip() + (m.group(2) or "")
        except (OSError, subprocess.SubprocessError):
            pass
    raise Glm5Fp4Error(f"GLM5_FP4_GIT_SHA={value!r}: not a commit; give the full 40-hex SHA of the commit the run "
                       "measures (git rev-parse HEAD), or a short one this checkout knows")


def _versions(packages: tuple[str, ...] = ()) -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "triton", "vllm", "sglang", *packages):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "?")
        except Exception:  # noqa: BLE001 - an absent or broken optional package is just not recorded
            pass
    return out


def _gpus() -> list[dict]:
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        out = []
        for d in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(d)
            out.append({"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                        "memory_gib": round(p.total_memory / 2**30, 1)})
        return out
    except Exception:  # noqa: BLE001
        return []


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.split("\n")[0].strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def result_metadata(packages: tuple[str, ...] = (), **extra) -> dict:
    """``{"date", "git_sha", "host", "platform", "cpus", "gpus", "gpu", "driver", "versions", ...extra}`` for a
    result file; ``packages``: more distributions whose versions the result depends on (e.g. aiohttp)."""
    gpus = _gpus()
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "gpus": gpus,
        "gpu": gpus[0]["name"] if gpus else None,
        "driver": _driver() if gpus else None,
        "versions": _versions(tuple(packages)),
    }
    meta.update(extra)
    return meta


def write_result(out_dir: str | Path, stem: str, result: dict, markdown: str) -> tuple[Path, Path]:
    """``out_dir/stem.json`` (everything; unknown types as strings) and ``out_dir/stem.md``; returns both paths."""
    from glm5_fp4.outputs import output_dir, write_text_atomic

    out_dir = output_dir(out_dir)
    js, md = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    write_text_atomic(js, json.dumps(result, indent=1, default=str) + "\n")
    write_text_atomic(md, markdown)
    return js, md
