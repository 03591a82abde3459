"""CPU cost of the telemetry sampler at 8 GPUs, measured with the fake NVML (no GPU needed).

    .venv/bin/python benchmarks/telemetry_overhead.py [--gpus 8] [--interval 0.1] [--seconds 10] [--out FILE]

Counts the sampler thread's own CPU time (time.thread_time inside the thread) and, as a cross
check, the whole process's CPU time while the main thread sleeps. The fake answers in Python, so
this measures the sampler's own work (reading, JSON lines, columns, file writes), not the
driver's; benchmarks/gpu_telemetry.py reports the same number with real NVML on a GPU machine.
Exits 1 when the sampler costs 1 % of one core or more.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glm5_fp4.telemetry import TelemetrySampler  # noqa: E402
from glm5_fp4.telemetry.fake_nvml import FakeNvml  # noqa: E402

LIMIT = 0.01  # fraction of one core


def measure(gpus: int, interval_s: float, seconds: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        fake = FakeNvml(n_gpus=gpus)
        proc0, wall0 = time.process_time(), time.monotonic()
        with TelemetrySampler(tmp, interval_s=interval_s, nvml=fake) as sampler:
            time.sleep(seconds)
        proc_cpu, wall = time.process_time() - proc0, time.monotonic() - wall0
        summary = sampler.summary()
        lines = sum(1 for _ in open(Path(tmp) / "telemetry.jsonl"))
        size = (Path(tmp) / "telemetry.jsonl").stat().st_size
    s = summary["sampler"]
    return {
        "gpus": gpus,
        "interval_s": interval_s,
        "wall_s": round(wall, 3),
        "ticks": s["ticks"],
        "late_ticks": s["late_ticks"],
        "samples_written": lines,
        "bytes_per_sample": round(size / max(lines, 1), 1),
        "sampler_thread_cpu_s": s["cpu_s"],
        "sampler_cpu_pct_of_one_core": round(100 * s["cpu_fraction_of_one_core"], 3),
        "process_cpu_pct_of_one_core": round(100 * proc_cpu / wall, 3),  # includes start/stop and summary
        "per_tick_ms": round(1000 * s["cpu_s"] / max(s["ticks"], 1), 4),
        "limit_pct": 100 * LIMIT,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", help="also write the result JSON here")
    args = ap.parse_args()
    result = measure(args.gpus, args.interval, args.seconds)
    result["ok"] = result["sampler_cpu_pct_of_one_core"] < 100 * LIMIT
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
