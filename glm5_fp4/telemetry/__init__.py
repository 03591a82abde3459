"""GPU telemetry (NVML): power, clocks, utilisation, memory, temperature, throttling, energy.

    from glm5_fp4.telemetry import TelemetrySampler, energy_per_token
    with TelemetrySampler(out_dir) as s:
        s.mark("measure"); ...
    summary = s.summary(tokens=n)           # JSON-ready dict; {"available": False, ...} without GPUs
    energy_per_token(summary, n)            # J/token, or None without telemetry

Nothing here imports pynvml or matplotlib until a sampler starts or a plot is drawn.
"""

from glm5_fp4.telemetry.sampler import TelemetrySampler
from glm5_fp4.telemetry.series import NO_TELEMETRY, TelemetryRun, load_run
from glm5_fp4.telemetry.summary import energy_per_token, summarize

__all__ = ["NO_TELEMETRY", "TelemetryRun", "TelemetrySampler", "energy_per_token", "load_run", "summarize"]
