"""GPU check of the telemetry sampler: idle -> heavy matmul -> PCIe copies -> idle, on every visible GPU.

    python benchmarks/gpu_telemetry.py [--out DIR] [--idle 8] [--load 20] [--pcie 3] [--tail 10] [--interval 0.1]

Needs torch with CUDA and `pynvml` (wheel nvidia_ml_py-*.whl; no engine, no other package).
Writes into DIR (default $OUT, else out/gpu_telemetry): gpu_telemetry.json with the checks below,
and the sampler's telemetry.jsonl / telemetry_meta.json / telemetry_summary.json / telemetry.md /
telemetry.png (the PNG only where matplotlib is installed). Checks, per GPU:
  power_rises_and_falls  median power in the load phase > 1.5x the median of each idle phase
  clock_responds_to_load median SM clock in the load phase differs by > 5 % from the median of
                         each idle phase, in the same direction for both; where it falls (an H200
                         under a heavy matmul drops from 1980 to ~1485 MHz at its 700 W cap), a
                         power or thermal clock limit must have been recorded during the load phase
  energy_matches_counter energy integrated from power samples within 5 % of NVML's energy counter
and sampler_cpu: the sampler thread's CPU with 1 and with all GPUs at --interval, fitted as a + b*n
and extrapolated to 8 GPUs, < 1 % of one core.
Reported, not checked:
  pcie      per copy phase, NVML's rate (the median of the sampler's samples that lie wholly inside
            the phase, and the mean from a probe reading the byte counters every 5 ms, which cannot
            alias) next to torch's copy rate, as NVML/torch ratios; the counters' value type and
            largest raw value (is the wrap at 2**32?)
  nvml_costs CPU and wall time per NVML call, by call and by field id (with NVML's own latencyUsec),
            nvmlDeviceGetSamples' buffered samples per type (count, spacing, CPU per call), and what
            the sampler's schedule costs at 8 GPUs from these numbers, at --interval and with "auto"
  sampler_cpu.auto  the sampler with interval_s="auto" on all GPUs: interval chosen, CPU measured
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

from glm5_fp4.bench.meta import result_metadata  # noqa: E402

ENERGY_TOLERANCE = 0.05
POWER_RATIO = 1.5
CLOCK_CHANGE = 0.05  # the SM clock must move by more than this against both idle phases
LIMIT_REASONS = ("sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")
CPU_LIMIT = 0.01
PHASES = ("idle-before", "load", "pcie-h2d", "pcie-d2h", "idle-after")
PROBE_S = 0.005  # the PCIe probe's read period: 4 GiB per 5 ms is 860 GB/s, beyond any PCIe link

# Field ids (nvml.h) timed one by one in nvml_costs; 74/75 are the power/thermal clock-limit time
# counters and 82 the memory temperature, candidates for the every-tick field read.
FIELD_NAMES = {
    83: "total_energy",
    185: "power_average",
    186: "power_instant",
    197: "pcie_tx_bytes",
    198: "pcie_rx_bytes",
    74: "perf_policy_power",
    75: "perf_policy_thermal",
    82: "memory_temp",
}
SAMPLE_TYPES = {0: "total_power", 1: "gpu_util", 2: "memory_util", 5: "sm_clock", 6: "memory_clock"}


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


class PcieProbe:
    """Reads the PCIe byte-counter fields of each GPU every PROBE_S in a thread, tagged with the
    current phase: rates from it cannot alias, whatever the sampler's interval."""

    def __init__(self, nv, handles: list):
        self.nv, self.handles = nv, handles
        self.phase: str | None = None
        self.rows: list[tuple[str, int, int, int, int]] = []  # phase, gpu position, stamp µs, tx, rx
        self.value_types: set[int] = set()
        self.max_raw = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pcie-probe", daemon=True)

    def start(self) -> PcieProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        from glm5_fp4.telemetry.nvml_reader import FI_PCIE_RX_BYTES, FI_PCIE_TX_BYTES, FieldBatch

        try:
            batches = [FieldBatch(self.nv, h, [FI_PCIE_TX_BYTES, FI_PCIE_RX_BYTES]) for h in self.handles]
            while not self._stop.wait(PROBE_S):
                phase = self.phase
                if phase is None:
                    continue
                for pos, batch in enumerate(batches):
                    raw = batch._call()
                    got = batch.read_values(raw)
                    if len(got) == 2:
                        (tx, stamp), (rx, _) = got[FI_PCIE_TX_BYTES], got[FI_PCIE_RX_BYTES]
                        stamp = stamp if stamp > 0 else int(time.time() * 1e6)
                        self.rows.append((phase, pos, stamp, int(tx), int(rx)))
                        self.max_raw = max(self.max_raw, int(tx), int(rx))
                        self.value_types.update(int(v.valueType) for v in raw)
        except Exception as exc:  # a report, never a crash of the check
            self.error = f"{type(exc).__name__}: {exc}"

    def rates(self, phase: str, pos: int, trim: float = 0.15) -> dict[str, float | None]:
        """TX/RX MB/s over the middle of the phase (the first and last `trim` dropped: ramps): all bytes
        counted there over the time they took, so it holds however coarsely the driver updates them."""
        from glm5_fp4.telemetry.nvml_reader import PCIE_COUNTER_WRAP

        rows = [r for r in self.rows if r[0] == phase and r[1] == pos]
        cut = int(len(rows) * trim)
        rows = rows[cut : len(rows) - cut] if len(rows) > 2 * cut + 1 else rows
        out: dict[str, float | None] = {}
        for key, col in (("pcie_tx_mbs", 3), ("pcie_rx_mbs", 4)):
            moved = sum((b[col] - a[col]) % PCIE_COUNTER_WRAP for a, b in zip(rows, rows[1:]))
            span_us = rows[-1][2] - rows[0][2] if len(rows) > 1 else 0
            out[key] = moved / span_us if span_us > 0 else None  # bytes per µs = MB/s
        return out


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
    ap.add_argument("--cost-reps", type=int, default=40, help="calls per NVML call kind in nvml_costs")
    ap.add_argument("--fake", type=int, metavar="N", help="dry run on the CPU: N fake GPUs, sleep instead of work")
    return ap.parse_args()


def _record_gpu(args: argparse.Namespace, out: Path) -> dict | int:
    """Run the phases on the real GPUs; what torch measured, or an exit code."""
    try:
        import pynvml
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

    pynvml.nvmlInit()  # refcounted: the sampler's own init/shutdown do not close it under the probe
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n_dev)]  # NVML order taken as CUDA's
        probe = PcieProbe(pynvml, handles).start()
        counts = [0] * n_dev
        h2d, d2h = [0.0] * n_dev, [0.0] * n_dev
        with TelemetrySampler(out, interval_s=args.interval) as sampler:
            if not sampler.available:
                print(f"gpu_telemetry: no GPU telemetry: {sampler.reason}", file=sys.stderr)
                probe.stop()
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
                probe.phase = "pcie-h2d"
                stop_at = time.monotonic() + args.pcie
                _run_threads(_copy, [(d, *bufs[d], True, stop_at, h2d) for d in range(n_dev)])
                sampler.mark("pcie-d2h")
                probe.phase = "pcie-d2h"
                stop_at = time.monotonic() + args.pcie
                _run_threads(_copy, [(d, *bufs[d], False, stop_at, d2h) for d in range(n_dev)])
                probe.phase = None
            sampler.mark("idle-after")
            time.sleep(args.tail)
        probe.stop()
        costs = nvml_costs(pynvml, handles[0], args.cost_reps)
    finally:
        pynvml.nvmlShutdown()
    return {
        "load_s": load_s,
        "matmul_tflops_per_torch_device": [n * 2 * args.size**3 / load_s / 1e12 for n in counts],
        "h2d_mbs_per_torch_device": h2d if args.pcie > 0 else None,
        "d2h_mbs_per_torch_device": d2h if args.pcie > 0 else None,
        "_probe": probe,
        "_costs": costs,
    }


def _record_fake(args: argparse.Namespace, out: Path) -> dict:
    """The same phases against FakeNvml, whose power switches up to its cap during the load and whose
    clock then falls, as the H200's did: checks this script."""
    from glm5_fp4.telemetry import TelemetrySampler
    from glm5_fp4.telemetry.fake_nvml import FakeNvml, SwitchedPower

    curves = [SwitchedPower(idle_w=90.0, load_w=690.0) for _ in range(args.fake)]
    fake = FakeNvml(n_gpus=args.fake, curves=curves, name="Fake H200", clock_model="power_capped")
    probe = PcieProbe(fake, list(range(args.fake))).start()
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
            probe.phase = "pcie-h2d"
            time.sleep(args.pcie)
            sampler.mark("pcie-d2h")
            probe.phase = "pcie-d2h"
            time.sleep(args.pcie)
            probe.phase = None
        sampler.mark("idle-after")
        time.sleep(args.tail)
    probe.stop()
    rates = [r / 1e6 for r in fake.pcie_bytes_per_s]  # what the fake's counters move, as "torch" would see
    return {
        "load_s": args.load,
        "matmul_tflops_per_torch_device": None,
        "h2d_mbs_per_torch_device": [rates[1]] * args.fake if args.pcie > 0 else None,
        "d2h_mbs_per_torch_device": [rates[0]] * args.fake if args.pcie > 0 else None,
        "_probe": probe,
        "_costs": nvml_costs(fake, 0, args.cost_reps),
    }


# -- NVML call costs ---------------------------------------------------------------------------------


def _time_calls(fn, reps: int) -> dict:
    """CPU (this thread) and wall µs per call of fn(), the mean over `reps` calls."""
    try:
        fn()  # first call outside the timing: lazy initialisation inside NVML
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        for _ in range(reps):
            fn()
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"cpu_us": round(1e6 * cpu / reps, 1), "wall_us": round(1e6 * wall / reps, 1), "reps": reps}


def nvml_costs(nv, handle, reps: int) -> dict:
    """What each NVML call costs this process, per call, on one GPU; and the driver's sample buffers."""
    from glm5_fp4.telemetry import nvml_reader as r

    sampler_ids = [r.FI_POWER_AVERAGE, r.FI_POWER_INSTANT, r.FI_TOTAL_ENERGY, r.FI_PCIE_TX_BYTES, r.FI_PCIE_RX_BYTES]
    batch = r.FieldBatch(nv, handle, sampler_ids)
    calls = {
        "field_values_sampler_set": batch.read,
        "utilization_rates": lambda: nv.nvmlDeviceGetUtilizationRates(handle),
        "clock_sm": lambda: nv.nvmlDeviceGetClockInfo(handle, r.NVML_CLOCK_SM),
        "clock_mem": lambda: nv.nvmlDeviceGetClockInfo(handle, r.NVML_CLOCK_MEM),
        "memory_info": lambda: nv.nvmlDeviceGetMemoryInfo(handle),
        "temperature": lambda: nv.nvmlDeviceGetTemperature(handle, r.NVML_TEMPERATURE_GPU),
        "clocks_event_reasons": lambda: nv.nvmlDeviceGetCurrentClocksEventReasons(handle),
        "power_usage": lambda: nv.nvmlDeviceGetPowerUsage(handle),
        "total_energy": lambda: nv.nvmlDeviceGetTotalEnergyConsumption(handle),
    }
    per_call = {name: _time_calls(fn, reps) for name, fn in calls.items()}
    per_call["pcie_throughput_legacy"] = _time_calls(
        lambda: nv.nvmlDeviceGetPcieThroughput(handle, r.NVML_PCIE_UTIL_TX_BYTES), 3
    )
    per_field = {}
    for fid, name in FIELD_NAMES.items():
        one = r.FieldBatch(nv, handle, [fid])
        try:
            (v,) = list(one._call())
            status = {"nvml_return": int(v.nvmlReturn), "value_type": int(v.valueType),
                      "latency_us_nvml": int(getattr(v, "latencyUsec", 0))}
        except Exception as exc:
            status = {"error": f"{type(exc).__name__}: {exc}"}
        per_field[f"{fid}_{name}"] = {**status, **_time_calls(one.read, reps)}
    try:  # NVML's own latencyUsec for each field of the sampler's batch, as served together
        per_call["field_values_sampler_set"]["latency_us_nvml"] = {
            FIELD_NAMES[int(v.fieldId)]: int(getattr(v, "latencyUsec", 0)) for v in batch._call()
        }
    except Exception:
        pass
    return {"gpu_position": 0, "per_call": per_call, "per_field": per_field, "buffered_samples": _buffered(nv, handle)}


def _buffered(nv, handle) -> dict:
    """nvmlDeviceGetSamples: how many samples the driver keeps per type, how far apart, what a call costs,
    and how many new ones arrive in 1 s: whether one call per second could replace ten polls."""
    fn = getattr(nv, "nvmlDeviceGetSamples", None)
    if fn is None:
        return {"error": "nvmlDeviceGetSamples missing from this binding"}
    out, last = {}, {}
    for kind, name in SAMPLE_TYPES.items():
        try:
            cpu0 = time.thread_time()
            _, samples = fn(handle, kind, 0)
            cpu = time.thread_time() - cpu0
            stamps = [int(s.timeStamp) for s in samples]
            gaps = [b - a for a, b in zip(stamps, stamps[1:])]
            out[name] = {
                "samples": len(stamps),
                "span_s": (stamps[-1] - stamps[0]) / 1e6 if len(stamps) > 1 else 0.0,
                "median_spacing_ms": statistics.median(gaps) / 1e3 if gaps else None,
                "cpu_us_per_call": round(1e6 * cpu, 1),  # pynvml's wrapper makes two C calls
            }
            last[kind] = stamps[-1] if stamps else 0
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    time.sleep(1.0)
    for kind, name in SAMPLE_TYPES.items():
        if kind in last:
            try:
                out[name]["new_in_1s"] = len(fn(handle, kind, last[kind])[1])
            except Exception as exc:  # NVML_ERROR_NOT_FOUND: nothing new
                out[name]["new_in_1s"] = 0 if "Not Found" in str(exc) else f"{type(exc).__name__}: {exc}"
    return out


def _projection(costs: dict, interval: float) -> dict | None:
    """The sampler's schedule priced with the measured per-call CPU: per GPU per tick, and at 8 GPUs."""
    from glm5_fp4.telemetry.sampler import PY_SAMPLE_S, PY_TICK_S, pick_interval, slow_every

    pc = costs["per_call"]
    fast_names = ("field_values_sampler_set", "utilization_rates", "clock_sm")
    slow_names = ("clock_mem", "memory_info", "temperature", "clocks_event_reasons")
    if any("cpu_us" not in pc[n] for n in fast_names + slow_names):
        return None
    fast = sum(pc[n]["cpu_us"] for n in fast_names) * 1e-6
    slow = sum(pc[n]["cpu_us"] for n in slow_names) * 1e-6
    every = slow_every(interval)
    per_gpu_tick = fast + PY_SAMPLE_S + slow / every
    at_8 = (PY_TICK_S + 8 * per_gpu_tick) / interval
    auto = pick_interval(PY_TICK_S + 8 * (fast + PY_SAMPLE_S), 8 * slow)
    auto_cost = (PY_TICK_S + 8 * (fast + PY_SAMPLE_S)) / auto + 8 * slow / (slow_every(auto) * auto)
    first_version = sum(
        pc[n]["cpu_us"]
        for n in ("power_usage", "clock_sm", "clock_mem", "utilization_rates", "memory_info", "temperature",
                  "clocks_event_reasons", "total_energy")
    ) * 1e-6 + pc["field_values_sampler_set"]["cpu_us"] * 1e-6
    return {
        "fast_cpu_ms_per_gpu_tick": round(1e3 * fast, 3),
        "slow_cpu_ms_per_gpu_round": round(1e3 * slow, 3),
        "cpu_ms_per_gpu_tick": round(1e3 * per_gpu_tick, 3),
        "cpu_pct_at_8_gpus": round(100 * at_8, 2),
        "auto_interval_s_at_8_gpus": auto,
        "auto_cpu_pct_at_8_gpus": round(100 * auto_cost, 3),
        "first_version_cpu_ms_per_gpu_tick": round(1e3 * first_version, 3),
        "interval_s": interval,
    }


# -- analysis ----------------------------------------------------------------------------------------


def _cpu_scaling(args: argparse.Namespace, indices: list[int], nvml_factory=None) -> dict:
    """Sampler CPU with one GPU and with all of them at --interval, fitted as a + b*n and extrapolated
    to 8 GPUs; then once more on all GPUs with interval "auto" (reported, not checked).

    The per-tick wake-up is a fixed cost, so scaling the all-GPU figure by 8/n would overstate it.
    """
    import tempfile

    from glm5_fp4.telemetry import TelemetrySampler

    measured, calls = {}, {}
    for gpus in ([indices[0]], indices):
        with tempfile.TemporaryDirectory() as tmp:
            nvml = nvml_factory() if nvml_factory else None
            with TelemetrySampler(tmp, interval_s=args.interval, gpus=gpus, nvml=nvml) as sampler:
                time.sleep(args.cpu_seconds)
            s = sampler.summary()["sampler"]
            measured[len(gpus)] = s["cpu_fraction_of_one_core"]
            calls[len(gpus)] = s["nvml_calls_per_gpu_tick"]
    n = len(indices)
    if n > 1:
        per_gpu = (measured[n] - measured[1]) / (n - 1)
        at_8 = measured[1] + 7 * max(per_gpu, 0.0)
    else:
        at_8 = 8 * measured[1]  # no second point: scale linearly, an upper bound
    with tempfile.TemporaryDirectory() as tmp:
        nvml = nvml_factory() if nvml_factory else None
        with TelemetrySampler(tmp, interval_s="auto", gpus=indices, nvml=nvml) as sampler:
            time.sleep(max(args.cpu_seconds, 3 * sampler.interval_s))
        s = sampler.summary()["sampler"]
    auto = {
        "gpus": n,
        "interval_s": s["interval_s"],
        "cpu_fraction_of_one_core": s["cpu_fraction_of_one_core"],
        "calibration": s.get("auto_interval"),
    }
    return {
        "interval_s": args.interval,
        "cpu_fraction_by_gpus": measured,
        "nvml_calls_per_gpu_tick": calls,
        "cpu_fraction_at_8_gpus": at_8,
        "auto": auto,
    }


def _phase_median(series, key: str, start: float, end: float, interval: float = 0.0) -> float | None:
    """Median of the samples in [start, end); with `interval`, only those whose whole interval lies in it
    (a rate sample covers the interval before its time stamp, so the first one after a mark is a ramp)."""
    vals = [v for t, v in zip(series.t, series.values[key]) if start + interval <= t < end and v == v]
    return statistics.median(vals) if vals else None


def clock_check(med_c: dict, limits_in_load: dict) -> dict:
    """SM clock in the load phase against both idle phases: it must move by > CLOCK_CHANGE in one
    direction; if it falls, a power/thermal clock limit must show in the load phase's samples."""
    idle = [med_c.get("idle-before"), med_c.get("idle-after")]
    load = med_c.get("load")
    if load is None or any(v is None or v <= 0 for v in idle):
        return {"ok": False, "direction": None, "change_vs_idle": None, "load_limit_reasons": limits_in_load}
    changes = [(load - v) / v for v in idle]
    rises = all(c > CLOCK_CHANGE for c in changes)
    falls = all(c < -CLOCK_CHANGE for c in changes)
    limited = {k: v for k, v in limits_in_load.items() if k in LIMIT_REASONS and v > 0}
    return {
        "ok": rises or (falls and bool(limited)),
        "direction": "rises" if rises else "falls" if falls else "no clear change",
        "change_vs_idle": [round(c, 4) for c in changes],
        "load_limit_reasons": limited,
    }


def _pcie_report(series, spans: dict, interval: float, pos: int, probe, torch_rates: dict) -> dict:
    """Per copy phase: the sampler's steady-sample medians, the probe's, and NVML/torch ratios."""
    out = {}
    for name, key_torch, direction in (("pcie-h2d", "h2d", "pcie_rx_mbs"), ("pcie-d2h", "d2h", "pcie_tx_mbs")):
        if name not in spans:
            continue
        start, end = spans[name]
        torch_mbs = (torch_rates.get(f"{key_torch}_mbs_per_torch_device") or [None] * (pos + 1))[pos]
        sampler = {k: _phase_median(series, k, start, end, interval) for k in ("pcie_tx_mbs", "pcie_rx_mbs")}
        fast = probe.rates(name, pos) if probe is not None else {}

        def ratio(x):
            return round(x / torch_mbs, 4) if x is not None and torch_mbs else None

        out[name] = {
            "direction_checked": direction,  # host->device is the GPU's RX, device->host its TX
            "torch_mbs": torch_mbs,
            "sampler_median_mbs": sampler,
            "probe_mean_mbs": fast,
            "nvml_over_torch_sampler": ratio(sampler.get(direction)),
            "nvml_over_torch_probe": ratio(fast.get(direction)),
        }
    return out


def _analyse(args: argparse.Namespace, out: Path, measured: dict) -> dict:
    from glm5_fp4.telemetry import load_run
    from glm5_fp4.telemetry.report import render_report
    from glm5_fp4.telemetry.summary import summarize

    probe, costs = measured.pop("_probe", None), measured.pop("_costs", None)
    files = render_report(out)
    summary = files.summary
    run = load_run(out)
    load_summary = summarize(run, phase="load")
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
        load_limits = next(x for x in load_summary["gpus"] if x["index"] == g["index"])["throttle_fraction"]
        clock = clock_check(med_c, load_limits)
        checks[f"gpu{g['index']}_power_rises_and_falls"] = power_ok
        checks[f"gpu{g['index']}_clock_responds_to_load"] = clock["ok"]
        checks[f"gpu{g['index']}_energy_matches_counter"] = rel is not None and rel <= ENERGY_TOLERANCE
        per_gpu.append(
            {
                "index": g["index"],
                "name": g["name"],
                "median_power_w": med_p,
                "median_sm_mhz": med_c,
                "sm_clock": clock,
                "energy_trapezoid_j": e["trapezoid"],
                "energy_trapezoid_instant_power_j": e["trapezoid_instant_power"],
                "energy_counter_j": e["counter"],
                "energy_rel_diff": rel,
                "energy_rel_diff_instant_power": rel_inst,
                "energy_counter_step_s": _counter_step_s(list(series.t), list(series.values["energy_j"])),
                # NVML's view of the copy phases, next to what torch measured on the same-numbered device
                "pcie": _pcie_report(series, spans, run.interval_s, i, probe, measured),
                "throttle_fraction": g["throttle_fraction"],
                "throttle_fraction_load": load_limits,
                "unsupported_metrics": g["unsupported"],
            }
        )
    n_gpus = len(summary["gpus"])
    factory = None
    if args.fake:
        from glm5_fp4.telemetry.fake_nvml import FakeNvml

        def factory():
            return FakeNvml(n_gpus=args.fake)

    cpu = _cpu_scaling(args, [g["index"] for g in summary["gpus"]], nvml_factory=factory)
    cpu_8 = cpu["cpu_fraction_at_8_gpus"]
    checks["sampler_cpu_below_1pct_at_8_gpus"] = cpu_8 is not None and cpu_8 < CPU_LIMIT
    if costs is not None:
        costs["projection"] = _projection(costs, args.interval)
    return {
        "meta": result_metadata(benchmark="gpu_telemetry"),  # apart: "gpus" and "driver" here are NVML's
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
        "pcie_probe": None
        if probe is None
        else {
            "period_s": PROBE_S,
            "reads": len(probe.rows),
            "value_types": sorted(probe.value_types),
            "max_raw_value": probe.max_raw,
            "max_raw_below_2_32": probe.max_raw < 2**32,
            "error": probe.error,
        },
        "nvml_costs": costs,
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
    brief = {k: result[k] for k in ("ok", "checks", "sampler_cpu_pct_scaled_to_8_gpus")}
    brief["nvml_calls_per_gpu_tick"] = result["sampler"].get("nvml_calls_per_gpu_tick")
    brief["projection"] = (result["nvml_costs"] or {}).get("projection")
    brief["pcie_nvml_over_torch"] = {
        g["index"]: {ph: (v["nvml_over_torch_sampler"], v["nvml_over_torch_probe"]) for ph, v in g["pcie"].items()}
        for g in result["gpus"]
    }
    print(json.dumps(brief, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
