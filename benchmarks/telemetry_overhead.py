"""CPU cost of the telemetry sampler, and NVML calls per GPU per tick, without a GPU.

    .venv/bin/python benchmarks/telemetry_overhead.py [--gpus 8] [--interval 0.1] [--seconds 10]
        [--call-cost-us 360] [--field-cost-us 0] [--out FILE]

Four scenarios, each a real TelemetrySampler run counting its own thread's CPU (time.thread_time):
  python        FakeNvml answering in pure Python: the sampler's own work (reads, JSON lines, columns)
  pynvml_stub   the real pynvml over a stub libnvidia-ml.so compiled here with `cc` (skipped without
                one): pynvml's ctypes path as the GPU machines run it, minus the driver
  driver_model  FakeNvml burning --call-cost-us of CPU per NVML call, the driver's share measured on
                the H200 (first run: 3.24 ms per GPU per tick over 9 calls = 360 µs a call): what the
                sampler should cost on that machine at --interval
  auto          the same model with interval_s="auto": the interval the sampler picks and its cost
NVML calls per GPU per tick are counted by the fake (and the stub) during the sampling window. The
first version made 9 per tick (one per metric group plus one field read; counted on commit 2a0e463);
with the driver model that is 9 x 360 µs = 3.24 ms per GPU per tick, 26 % of a core at 8 GPUs and
0.1 s, which is what the H200 showed. benchmarks/gpu_telemetry.py measures the real per-call costs.
Exits 1 when the python, stub or auto scenario costs 1 % of one core or more.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glm5_fp4.bench.meta import result_metadata  # noqa: E402
from glm5_fp4.telemetry import TelemetrySampler  # noqa: E402
from glm5_fp4.telemetry.fake_nvml import FakeNvml  # noqa: E402

LIMIT = 0.01  # fraction of one core
# the first version, per GPU per tick: power, SM clock, memory clock, utilisation, memory, temperature,
# clock-event reasons, energy, and one field read (instant power, PCIe)
CALLS_PER_GPU_TICK_BEFORE = 9
H200_CALL_COST_US = 360.0

READS = (
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetPcieThroughput",
)

# A libnvidia-ml.so stand-in: every entry point the sampler reaches through pynvml, answering at once
# (plus STUB_CALL_COST_US of busy CPU per call, 0 by default) and counting its calls.
STUB_C = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef struct { unsigned fieldId, scopeId; long long timestamp, latencyUsec; unsigned valueType, nvmlReturn;
                 union { double d; unsigned ui; unsigned long ul; unsigned long long ull; long long sll; } value;
               } fv_t;
static unsigned long long calls[16], energy_mj = 1000000, pcie[2] = {4294000000ull, 1000ull};
static double cost_us = -1;
static void query(int kind) {
  calls[kind]++;
  if (cost_us < 0) { const char *e = getenv("STUB_CALL_COST_US"); cost_us = e ? atof(e) : 0; }
  if (cost_us > 0) {
    struct timespec a, b; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
    do clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
    while ((b.tv_sec - a.tv_sec) * 1e6 + (b.tv_nsec - a.tv_nsec) / 1e3 < cost_us);
  }
}
unsigned long long stub_calls(int kind) { return calls[kind]; }
int nvmlInitWithFlags(unsigned f) { return 0; }
int nvmlShutdown(void) { return 0; }
const char *nvmlErrorString(int r) { return "stub error"; }
int nvmlSystemGetDriverVersion(char *b, unsigned n) { strncpy(b, "000.00-stub", n); return 0; }
int nvmlDeviceGetCount_v2(unsigned *c) { *c = 8; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **h) { *h = (void *)(uintptr_t)(i + 1); return 0; }
int nvmlDeviceGetName(void *h, char *b, unsigned n) { strncpy(b, "Stub GPU", n); return 0; }
int nvmlDeviceGetUUID(void *h, char *b, unsigned n) { strncpy(b, "GPU-stub", n); return 0; }
int nvmlDeviceGetPowerUsage(void *h, unsigned *p) { query(1); *p = 250000; return 0; }
int nvmlDeviceGetTotalEnergyConsumption(void *h, unsigned long long *e) { query(2); *e = energy_mj += 25; return 0; }
int nvmlDeviceGetUtilizationRates(void *h, unsigned *u) { query(3); u[0] = 97; u[1] = 41; return 0; }
int nvmlDeviceGetClockInfo(void *h, unsigned k, unsigned *c) { query(4); *c = k == 1 ? 1980 : 2619; return 0; }
int nvmlDeviceGetMemoryInfo(void *h, unsigned long long *m) {
  query(5); m[0] = 141ull << 30; m[2] = 3ull << 30; m[1] = m[0] - m[2]; return 0;
}
int nvmlDeviceGetTemperature(void *h, unsigned s, unsigned *t) { query(6); *t = 54; return 0; }
int nvmlDeviceGetCurrentClocksEventReasons(void *h, unsigned long long *r) { query(7); *r = 4; return 0; }
int nvmlDeviceGetPcieThroughput(void *h, unsigned c, unsigned *v) { query(8); return 3; }
int nvmlDeviceGetFieldValues(void *h, int n, fv_t *v) {
  struct timespec now; clock_gettime(CLOCK_REALTIME, &now); query(0);
  energy_mj += 25; pcie[0] = (pcie[0] + 3000000) & 0xffffffffull; pcie[1] = (pcie[1] + 1000000) & 0xffffffffull;
  for (int i = 0; i < n; i++) {
    v[i].timestamp = now.tv_sec * 1000000ll + now.tv_nsec / 1000; v[i].nvmlReturn = 0; v[i].valueType = 3;
    switch (v[i].fieldId) {
      case 83: v[i].value.ull = energy_mj; break;
      case 185: case 186: v[i].valueType = 1; v[i].value.ui = 250000; break;
      case 197: case 198: v[i].value.ull = pcie[v[i].fieldId - 197]; break;
      default: v[i].nvmlReturn = 3;
    }
  }
  return 0;
}
"""


def _count_window(sampler: TelemetrySampler, counts, seconds: float) -> tuple[dict[str, int], int, float]:
    """Calls (by name), ticks and thread CPU between now and `seconds` later, inside a running sampler."""
    before, ticks0, cpu0 = counts(), sampler._ticks, sampler._cpu_s
    time.sleep(seconds)
    after, ticks1, cpu1 = counts(), sampler._ticks, sampler._cpu_s
    return {k: after[k] - before[k] for k in after}, ticks1 - ticks0, cpu1 - cpu0


def run_scenario(name: str, gpus: int, interval, seconds: float, nvml, counts) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc0, wall0 = time.process_time(), time.monotonic()
        with TelemetrySampler(tmp, interval_s=interval, gpus=list(range(gpus)), nvml=nvml) as sampler:
            time.sleep(min(1.0, seconds / 4))  # the sampling thread's first tick and cpu counter
            calls, ticks, cpu = _count_window(sampler, counts, seconds)
        proc_cpu, wall = time.process_time() - proc0, time.monotonic() - wall0
        lines = sum(1 for _ in open(Path(tmp) / "telemetry.jsonl"))
        size = (Path(tmp) / "telemetry.jsonl").stat().st_size
    s = sampler.summary()["sampler"]
    window_s = ticks * sampler.interval_s
    per_gpu_tick = {k: round(v / (ticks * gpus), 3) for k, v in sorted(calls.items()) if v}
    return {
        "scenario": name,
        "gpus": gpus,
        "interval_s": sampler.interval_s,
        "auto_interval": s.get("auto_interval"),
        "ticks_measured": ticks,
        "late_ticks": s["late_ticks"],
        "nvml_calls_per_gpu_tick": round(sum(calls.values()) / (ticks * gpus), 3),
        "nvml_calls_per_gpu_tick_by_call": per_gpu_tick,
        "nvml_calls_per_gpu_tick_before": CALLS_PER_GPU_TICK_BEFORE,
        "sampler_cpu_ms_per_tick": round(1e3 * cpu / ticks, 4),
        "sampler_cpu_ms_per_gpu_tick": round(1e3 * cpu / ticks / gpus, 4),
        "sampler_cpu_pct_of_one_core": round(100 * cpu / window_s, 3),
        "process_cpu_pct_of_one_core": round(100 * proc_cpu / wall, 3),  # includes start/stop and summary
        "bytes_per_sample": round(size / max(lines, 1), 1),
    }


def fake_scenario(name, gpus, interval, seconds, call_cost_us=0.0, field_cost_us=0.0) -> dict:
    fake = FakeNvml(n_gpus=gpus, call_cost_s=call_cost_us * 1e-6, field_cost_s=field_cost_us * 1e-6)
    out = run_scenario(name, gpus, interval, seconds, fake, lambda: Counter({k: fake.calls[k] for k in READS}))
    out["modelled_call_cost_us"] = call_cost_us
    out["modelled_field_cost_us"] = field_cost_us
    return out


def stub_scenario(gpus, interval, seconds) -> dict | None:
    """The sampler through the real pynvml over a compiled stub library; None without pynvml or cc."""
    try:
        import pynvml
    except ImportError:
        return None
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, lib_path = Path(tmp) / "stub.c", Path(tmp) / "libnvidia-ml-stub.so"
        src.write_text(STUB_C)
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib_path), str(src)], check=True)
        lib = ctypes.CDLL(str(lib_path))
        lib.stub_calls.restype = ctypes.c_ulonglong
        saved = pynvml.nvmlLib, dict(pynvml._nvmlGetFunctionPointer_cache)
        pynvml.nvmlLib = lib
        pynvml._nvmlGetFunctionPointer_cache.clear()
        try:

            def counts():
                return Counter({name: lib.stub_calls(i) for i, name in enumerate(
                    ["nvmlDeviceGetFieldValues", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption",
                     "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetClockInfo", "nvmlDeviceGetMemoryInfo",
                     "nvmlDeviceGetTemperature", "nvmlDeviceGetCurrentClocksEventReasons",
                     "nvmlDeviceGetPcieThroughput"])})

            out = run_scenario("pynvml_stub", gpus, interval, seconds, None, counts)
        finally:
            pynvml.nvmlLib = saved[0]
            pynvml._nvmlGetFunctionPointer_cache.clear()
            pynvml._nvmlGetFunctionPointer_cache.update(saved[1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per scenario")
    ap.add_argument("--call-cost-us", type=float, default=H200_CALL_COST_US, help="modelled driver CPU per NVML call")
    ap.add_argument("--field-cost-us", type=float, default=0.0, help="modelled extra CPU per field id of a field read")
    ap.add_argument("--out", help="also write the result JSON here")
    args = ap.parse_args()
    if not 1 <= args.gpus <= 8:
        ap.error("--gpus must be 1..8 (the stub library has 8 GPUs)")

    scenarios = [fake_scenario("python", args.gpus, args.interval, args.seconds)]
    stub = stub_scenario(args.gpus, args.interval, args.seconds)
    if stub is not None:
        scenarios.append(stub)
    cost = (args.call_cost_us, args.field_cost_us)
    scenarios.append(fake_scenario("driver_model", args.gpus, args.interval, args.seconds, *cost))
    scenarios.append(fake_scenario("auto", args.gpus, "auto", max(args.seconds, 20.0), *cost))
    before_ms = CALLS_PER_GPU_TICK_BEFORE * args.call_cost_us / 1e3
    result = {
        **result_metadata(benchmark="telemetry_overhead"),
        "gpus_modelled": args.gpus,
        "interval_s": args.interval,
        "scenarios": scenarios,
        "before": {
            "nvml_calls_per_gpu_tick": CALLS_PER_GPU_TICK_BEFORE,
            "modelled_cpu_ms_per_gpu_tick": before_ms,
            "modelled_cpu_pct_of_one_core": round(100 * before_ms * args.gpus / 1e3 / args.interval, 2),
        },
        "limit_pct": 100 * LIMIT,
    }
    checked = [s for s in scenarios if s["scenario"] in ("python", "pynvml_stub", "auto")]
    result["ok"] = all(s["sampler_cpu_pct_of_one_core"] < 100 * LIMIT for s in checked)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
