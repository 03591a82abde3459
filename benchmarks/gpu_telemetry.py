"""GPU check of the telemetry sampler: idle -> heavy matmul -> PCIe copies -> idle, on every visible GPU.

    python benchmarks/gpu_telemetry.py [--out DIR] [--idle 8] [--load 20] [--pcie 3] [--tail 10] [--interval 0.1]

Needs torch with CUDA and `pynvml` (wheel nvidia_ml_py-*.whl; no engine, no other package).
Writes into DIR (default $OUT, else out/gpu_telemetry): gpu_telemetry.json with the checks below,
and the sampler's telemetry.jsonl / telemetry_meta.json / telemetry_summary.json / telemetry.md /
telemetry.png (the PNG only where matplotlib is installed). Checks, per GPU:
  power_rises_and_falls  median power in the load phase > 1.5x the median of each idle phase
  clock_rises_and_falls  median SM clock in the load phase > 1.1x the median of each idle phase
  energy_matches_counter energy integrated from power samples within 5 % of NVML's energy counter
and sampler_cpu: the sampler thread's CPU with 1 and with all GPUs, fitted as a + b*n and
extrapolated to 8 GPUs, < 1 % of one core.
The PCIe phases (host->device, then device->host copies) are reported, not checked: they show
whether NVML's PCIe readings track the copy rate torch measured.
Exit status 0 when every check passes, 1 when one fails, 2 when it cannot run here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ENERGY_TOLERANCE = 0.05
POWER_RATIO = 1.5
CLOCK_RATIO = 1.1
CPU_LIMIT = 0.01
PHASES = ("idle-before", "load", "pcie-h2d", "pcie-d2h", "idle-after")


def _burn(device: int, a, b, c, stop_at: float, counts: list[int]) -> None:
    import torch

    torch.cuda.set_device(device)
    n = 0
    while time.monotonic() < stop_at:
        for _ in range(8):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize(device)
        n += 8
    counts[device] = n


def _copy(device: int, host, dev, to_device: bool, stop_at: float, rates: list[float]) -> None:
    import torch

    torch.cuda.set_device(device)
    moved, t0 = 0, time.monotonic()
    while time.monotonic() < stop_at:
        for _ in range(4):
            (dev.copy_(host, non_blocking=True) if to_device else host.copy_(dev, non_blocking=True))
        torch.cuda.synchronize(device)
        moved += 4 * host.numel() * host.element_size()
    rates[device] = moved / (time.monotonic() - t0) / 1e6  # MB/s


def _run_threads(target, per_device_args: list[tuple]) -> None:
    threads = [threading.Thread(target=target, args=args) for args in per_device_args]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def _counter_step_s(t: list[float], energy: list[float]) -> float | None:
    """Median time between changes of NVML's energy counter: how fine-grained it is."""
    changes = [t[i] for i in range(1, len(t)) if energy[i] == energy[i] and energy[i] != energy[i - 1]]
    gaps = [b - a for a, b in zip(changes, changes[1:])]
    return statistics.median(gaps) if gaps else None


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="output directory (default $OUT, else out/gpu_telemetry)")
    ap.add_argument("--idle", type=float, default=8.0, help="idle seconds before the load")
    ap.add_argument("--load", type=float, default=20.0, help="seconds of matmul load")
    ap.add_argument("--pcie", type=float, default=3.0, help="seconds of host->device and of device->host copies")
    ap.add_argument("--tail", type=float, default=10.0, help="idle seconds after the load")
    ap.add_argument("--interval", type=float, default=0.1, help="sampling interval in seconds")
    ap.add_argument("--size", type=int, default=8192, help="square bf16 matmul size")
    ap.add_argument("--copy-mib", type=int, default=256, help="pinned buffer per GPU for the PCIe phases")
    ap.add_argument("--cpu-seconds", type=float, default=5.0, help="idle seconds per sampler-CPU measurement")
    ap.add_argument("--fake", type=int, metavar="N", help="dry run on the CPU: N fake GPUs, sleep instead of work")
    return ap.parse_args()


def _record_gpu(args: argparse.Namespace, out: Path) -> dict | int:
    """Run the phases on the real GPUs; what torch measured, or an exit code."""
    try:
        import pynvml  # noqa: F401
    except ImportError:
        print(
            "gpu_telemetry: pynvml is missing. Install the nvidia-ml-py wheel first, e.g.\n"
            "  pip install --no-index .whl/nvidia_ml_py-13.615.71-py3-none-any.whl\n"
            "or put the (pure-Python) wheel on the path:\n"
            "  PYTHONPATH=.whl/nvidia_ml_py-13.615.71-py3-none-any.whl python benchmarks/gpu_telemetry.py",
            file=sys.stderr,
        )
        return 2
    try:
        import torch
    except ImportError:
        print("gpu_telemetry: torch is not installed; this check needs torch with CUDA", file=sys.stderr)
        return 2

    if not torch.cuda.is_available():
        print("gpu_telemetry: torch sees no CUDA GPU; nothing to check", file=sys.stderr)
        return 2
    from glm5_fp4.telemetry import TelemetrySampler

    n_dev = torch.cuda.device_count()
    mats, bufs = [], []
    for d in range(n_dev):
        with torch.cuda.device(d):
            a = torch.randn(args.size, args.size, device=d, dtype=torch.bfloat16)
            b = torch.randn(args.size, args.size, device=d, dtype=torch.bfloat16)
            c = torch.empty_like(a)
            torch.matmul(a, b, out=c)  # cuBLAS init and first-call costs stay out of the measured phases
            host = torch.empty(args.copy_mib * 2**20, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty_like(host, device=d)
            dev.copy_(host)
            torch.cuda.synchronize(d)
        mats.append((a, b, c))
        bufs.append((host, dev))

    counts = [0] * n_dev
    h2d, d2h = [0.0] * n_dev, [0.0] * n_dev
    with TelemetrySampler(out, interval_s=args.interval) as sampler:
        if not sampler.available:
            print(f"gpu_telemetry: no GPU telemetry: {sampler.reason}", file=sys.stderr)
            return 2
        sampler.mark("idle-before")
        time.sleep(args.idle)
        sampler.mark("load")
        t_load = time.monotonic()
        stop_at = t_load + args.load
        _run_threads(_burn, [(d, *mats[d], stop_at, counts) for d in range(n_dev)])
        load_s = time.monotonic() - t_load
        if args.pcie > 0:
            sampler.mark("pcie-h2d")
            stop_at = time.monotonic() + args.pcie
            _run_threads(_copy, [(d, *bufs[d], True, stop_at, h2d) for d in range(n_dev)])
            sampler.mark("pcie-d2h")
            stop_at = time.monotonic() + args.pcie
            _run_threads(_copy, [(d, *bufs[d], False, stop_at, d2h) for d in range(n_dev)])
        sampler.mark("idle-after")
        time.sleep(args.tail)
    return {
        "load_s": load_s,
        "matmul_tflops_per_torch_device": [n * 2 * args.size**3 / load_s / 1e12 for n in counts],
        "h2d_mbs_per_torch_device": h2d if args.pcie > 0 else None,
        "d2h_mbs_per_torch_device": d2h if args.pcie > 0 else None,
    }


def _record_fake(args: argparse.Namespace, out: Path) -> dict:
    """The same phases against FakeNvml, whose power switches up during the load: checks this script."""
    from glm5_fp4.telemetry import TelemetrySampler
    from glm5_fp4.telemetry.fake_nvml import FakeNvml, SwitchedPower

    curves = [SwitchedPower(idle_w=90.0, load_w=650.0) for _ in range(args.fake)]
    fake = FakeNvml(n_gpus=args.fake, curves=curves, name="Fake H200")
    with TelemetrySampler(out, interval_s=args.interval, nvml=fake) as sampler:
        sampler.mark("idle-before")
        time.sleep(args.idle)
        sampler.mark("load")
        for c in curves:
            c.switch(True, fake.elapsed())
        time.sleep(args.load)
        for c in curves:
            c.switch(False, fake.elapsed())
        if args.pcie > 0:
            sampler.mark("pcie-h2d")
            time.sleep(args.pcie)
            sampler.mark("pcie-d2h")
            time.sleep(args.pcie)
        sampler.mark("idle-after")
        time.sleep(args.tail)
    return {"load_s": args.load, "matmul_tflops_per_torch_device": None,
            "h2d_mbs_per_torch_device": None, "d2h_mbs_per_torch_device": None}


def _cpu_scaling(args: argparse.Namespace, indices: list[int], nvml=None) -> dict:
    """Sampler CPU with one GPU and with all of them, fitted as a + b*n and extrapolated to 8 GPUs.

    The per-tick wake-up is a fixed cost, so scaling the all-GPU figure by 8/n would overstate it.
    """
    import tempfile

    from glm5_fp4.telemetry import TelemetrySampler

    measured = {}
    for gpus in ([indices[0]], indices):
        with tempfile.TemporaryDirectory() as tmp:
            with TelemetrySampler(tmp, interval_s=args.interval, gpus=gpus, nvml=nvml) as sampler:
                time.sleep(args.cpu_seconds)
            measured[len(gpus)] = sampler.summary()["sampler"]["cpu_fraction_of_one_core"]
    n = len(indices)
    if n > 1:
        per_gpu = (measured[n] - measured[1]) / (n - 1)
        at_8 = measured[1] + 7 * max(per_gpu, 0.0)
    else:
        at_8 = 8 * measured[1]  # no second point: scale linearly, an upper bound
    return {"cpu_fraction_by_gpus": measured, "cpu_fraction_at_8_gpus": at_8}


def _phase_median(series, key: str, start: float, end: float) -> float | None:
    vals = [v for t, v in zip(series.t, series.values[key]) if start <= t < end and v == v]
    return statistics.median(vals) if vals else None


def _analyse(args: argparse.Namespace, out: Path, measured: dict) -> dict:
    from glm5_fp4.telemetry import load_run
    from glm5_fp4.telemetry.report import render_report

    files = render_report(out)
    summary = files.summary
    run = load_run(out)
    phases = {p["name"]: p for p in summary["phases"]}
    names = ("idle-before", "load", "idle-after")
    spans = {p["name"]: (p["start_s"], p["end_s"]) for p in summary["phases"]}
    per_gpu = []
    checks: dict[str, bool] = {}
    for i, g in enumerate(summary["gpus"]):
        rows = {name: next(x for x in phases[name]["gpus"] if x["index"] == g["index"]) for name in names}
        med_p = {name: rows[name]["median_power_w"] for name in names}
        med_c = {name: rows[name]["median_sm_mhz"] for name in names}
        e = g["energy_j"]
        rel = abs(e["trapezoid"] - e["counter"]) / e["counter"] if e["counter"] else None
        rel_inst = (
            abs(e["trapezoid_instant_power"] - e["counter"]) / e["counter"]
            if e["counter"] and e["trapezoid_instant_power"] is not None
            else None
        )
        series = run.gpus[i]
        power_ok = all(v is not None for v in med_p.values()) and med_p["load"] > POWER_RATIO * max(
            med_p["idle-before"], med_p["idle-after"]
        )
        clock_ok = all(v is not None for v in med_c.values()) and med_c["load"] > CLOCK_RATIO * max(
            med_c["idle-before"], med_c["idle-after"]
        )
        checks[f"gpu{g['index']}_power_rises_and_falls"] = power_ok
        checks[f"gpu{g['index']}_clock_rises_and_falls"] = clock_ok
        checks[f"gpu{g['index']}_energy_matches_counter"] = rel is not None and rel <= ENERGY_TOLERANCE
        per_gpu.append(
            {
                "index": g["index"],
                "name": g["name"],
                "median_power_w": med_p,
                "median_sm_mhz": med_c,
                "energy_trapezoid_j": e["trapezoid"],
                "energy_trapezoid_instant_power_j": e["trapezoid_instant_power"],
                "energy_counter_j": e["counter"],
                "energy_rel_diff": rel,
                "energy_rel_diff_instant_power": rel_inst,
                "energy_counter_step_s": _counter_step_s(list(series.t), list(series.values["energy_j"])),
                # NVML's view of the copy phases, next to what torch measured on the same-numbered device
                "pcie_mbs_in_copy_phases": {
                    name: {key: _phase_median(series, key, *spans[name]) for key in ("pcie_tx_mbs", "pcie_rx_mbs")}
                    for name in ("pcie-h2d", "pcie-d2h")
                    if name in spans
                },
                "throttle_fraction": g["throttle_fraction"],
                "unsupported_metrics": g["unsupported"],
            }
        )
    n_gpus = len(summary["gpus"])
    nvml = None
    if args.fake:
        from glm5_fp4.telemetry.fake_nvml import FakeNvml

        nvml = FakeNvml(n_gpus=args.fake)
    cpu = _cpu_scaling(args, [g["index"] for g in summary["gpus"]], nvml=nvml)
    cpu_8 = cpu["cpu_fraction_at_8_gpus"]
    checks["sampler_cpu_below_1pct_at_8_gpus"] = cpu_8 is not None and cpu_8 < CPU_LIMIT
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "fake": bool(args.fake),
        "gpus": per_gpu,
        "nvml_gpus": n_gpus,
        "driver": summary["driver"],
        "torch_measured": measured,  # per torch device; NVML order is assumed to match CUDA's
        "phases_s": {name: round(b - a, 3) for name, (a, b) in spans.items()},
        "interval_s": args.interval,
        "sampler": summary["sampler"],
        "sampler_cpu": cpu,
        "sampler_cpu_pct_scaled_to_8_gpus": None if cpu_8 is None else 100 * cpu_8,
        "energy_j_total": summary["energy_j"],
        "energy_trapezoid_j_total": summary["energy_trapezoid_j"],
        "png": str(files.png_path) if files.png_path else files.note,
        "markdown": str(files.markdown_path),
    }


def main() -> int:
    args = _parse()
    out = Path(args.out or os.environ.get("OUT") or "out/gpu_telemetry")
    out.mkdir(parents=True, exist_ok=True)
    recorded = _record_fake(args, out) if args.fake else _record_gpu(args, out)
    if isinstance(recorded, int):
        return recorded
    result = _analyse(args, out, recorded)
    (out / "gpu_telemetry.json").write_text(json.dumps(result, indent=2) + "\n")
    print((out / "telemetry.md").read_text())
    print(json.dumps({k: result[k] for k in ("ok", "checks", "sampler_cpu_pct_scaled_to_8_gpus")}, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
