"""Shared by run_tiny.py and run_true_dims.py: output folder, deadline, log evidence, result bundling."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MAX_FILE_BYTES = 15 << 20  # $OUT takes files of at most 16 MiB
# What a server log says about the path it took (first matches kept).
EVIDENCE = {
    "ours": r"glm5_fp4: .*(run on backend|cannot serve|falling back).*",
    "moe_backend": r"(Using \S+ MoE backend|NvFp4 MoE backend|Selected .*MoE.*|Using .*Experts.*).*",
    "linear_kernel": r"Using \S+ for NVFP4 GEMM.*",
    "attention": r"(Using \S+ (attention )?backend|Using AttentionBackendEnum\.\S+|attention backend).*",
    "quantization": r"Detected ModelOpt NVFP4 checkpoint.*",
    "compile": r"(torch\.compile takes|Compiling a graph|compile range).*",
    "cuda_graphs": r"(Graph capturing finished|Capturing CUDA graphs).*",
    "kv_cache": r"(GPU KV cache size|KV cache|Available KV cache memory).*",
    "layer_timers": r"glm5_fp4: layer timers.*",
    "errors": r"(Traceback|\w+Error: |ERROR ).*",
}


class Run:
    """One device script's output folder and time budget; ``finish`` bundles it into <= 8 files of <= 16 MiB."""

    def __init__(self, name: str, out: Path | None, deadline_s: float):
        from glm5_fp4.bench.meta import git_sha
        from glm5_fp4.errors import Glm5Fp4Error

        try:  # before any device time: a bad GLM5_FP4_GIT_SHA left the whole run's results without a commit
            git_sha()
        except Glm5Fp4Error as exc:
            raise SystemExit(f"{name}: {exc}") from None
        out_path = Path(out or os.environ.get("OUT") or f"/tmp/{name}")
        if out_path.exists() and not out_path.is_dir():
            raise SystemExit(f"{name}: --out {out_path} is a file, not a folder")
        self.t0 = time.monotonic()
        self.deadline_s = deadline_s
        self.out = Path(out or os.environ.get("OUT") or f"/tmp/{name}")
        self.work = self.out / name  # bundled into name.tar.gz at the end
        self.work.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.summary: dict = {"run": name, "started_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "phases": {}, "problems": [], "skipped": []}

    def left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.t0)

    def phase(self, name: str, t0: float, **info) -> None:
        self.summary["phases"][name] = {"s": round(time.monotonic() - t0, 1), **info}
        print(f"[{self.name}] {name}: {self.summary['phases'][name]}", flush=True)
        self.save()

    def problem(self, text: str) -> None:
        self.summary["problems"].append(text)
        print(f"[{self.name}] PROBLEM: {text}", flush=True)

    def skip(self, what: str, needed_s: float) -> bool:
        """True (and recorded) when fewer than ``needed_s`` seconds are left."""
        if self.left() >= needed_s:
            return False
        self.summary["skipped"].append(f"{what}: {self.left():.0f} s left, needs ~{needed_s:.0f} s")
        print(f"[{self.name}] SKIP {what}", flush=True)
        return True

    def save(self) -> None:
        self.summary["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        (self.out / f"{self.name}_summary.json").write_text(json.dumps(self.summary, indent=1, default=str))

    def finish(self) -> int:
        self.save()
        (self.work / "summary.json").write_text(json.dumps(self.summary, indent=1, default=str))
        bundle(self.work, self.out / f"{self.name}.tar.gz")
        print(json.dumps({k: self.summary[k] for k in ("problems", "skipped", "elapsed_s")}, indent=1))
        return 1 if self.summary["problems"] else 0


def bundle(folder: Path, archive: Path, limit: int = MAX_FILE_BYTES) -> None:
    """``folder`` as a tar.gz; the largest files are left out (named in LEFT_OUT.txt) until it fits ``limit``."""
    files = sorted((f for f in folder.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    left_out: list[str] = []
    while True:
        with tarfile.open(archive, "w:gz") as tar:
            for f in files:
                tar.add(f, arcname=f"{folder.name}/{f.relative_to(folder)}")
            if left_out:
                note = folder / "LEFT_OUT.txt"
                note.write_text("left out to fit $OUT's 16 MiB per file:\n" + "\n".join(left_out) + "\n")
                tar.add(note, arcname=f"{folder.name}/LEFT_OUT.txt")
        if archive.stat().st_size <= limit or not files:
            return
        biggest = files.pop()
        left_out.append(f"{biggest.relative_to(folder)} ({biggest.stat().st_size} bytes)")


def evidence(log: Path, keep: int = 4) -> dict[str, list[str]]:
    """First ``keep`` lines matching each EVIDENCE pattern (and the last error lines) of a server log."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    out: dict[str, list[str]] = {}
    for key, pattern in EVIDENCE.items():
        rx = re.compile(pattern)
        hits = [ln.strip()[:300] for ln in lines if rx.search(ln)]
        if hits:
            out[key] = hits[-keep:] if key == "errors" else hits[:keep]
    return out


def traceback_summary(log: Path, lines: int = 25) -> str:
    """The last traceback of a log, shortened: what a write-up quotes when vLLM itself fails."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    start = max((i for i, ln in enumerate(text) if "Traceback" in ln), default=max(0, len(text) - lines))
    return "\n".join(text[start:start + lines * 4][-lines:])


def env_versions() -> dict:
    info = {"python": sys.version.split()[0]}
    for mod in ("torch", "triton", "vllm", "sglang", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001 - a missing module is a fact to record
            info[mod] = f"unavailable ({type(exc).__name__})"
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
            # Less than the whole card free at the start: servers of an earlier call still hold it.
            free, total = torch.cuda.mem_get_info(0)
            info["gpu_free_gib_at_start"] = round(free / 2**30, 1)
            info["gpu_total_gib"] = round(total / 2**30, 1)
    except Exception:  # noqa: BLE001
        pass
    try:
        from glm5_fp4.bench.meta import result_metadata

        info["meta"] = result_metadata()
        # The device gets a copy of the working tree without .git: the command line names the commit.
        info["meta"]["git_sha"] = info["meta"].get("git_sha") or os.environ.get("GLM5_FP4_GIT_SHA")
    except Exception as exc:  # noqa: BLE001
        info["meta"] = f"unavailable ({exc})"
    return info
