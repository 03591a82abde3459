"""Per-layer GPU timers that survive CUDA-graph capture and torch.compile.

Host-side hooks, NVTX ranges and Python timers do not run when a CUDA graph is replayed, which is how
engines run decode. Here every timing point is a one-thread kernel that writes the GPU's ``%globaltimer``
(nanoseconds, the same clock for all SMs) into a fixed slot of a preallocated int64 device buffer. The
kernel is launched through a torch custom op (``glm5_fp4::timer_stamp``, with a fake implementation), so
capture records it like any other kernel, every replay writes fresh stamps, and torch.compile keeps it.
After a step, :meth:`LayerTimer.collect` reads the buffer once and turns stamps into region durations.
On CPU the same op stores ``time.perf_counter_ns()`` eagerly.

Two ways to delimit regions, which can be mixed and nested:

* ``timer.mark("layer.3")`` starts region ``layer.3`` and ends the previous mark's region; ``timer.stop()``
  ends the last one. Regions follow each other.
* ``with timer.range("layer.3/attention"):`` (or ``begin``/``end``) times one region; ranges may nest.
  :func:`wrap_module_forward` puts a range around a module's forward with hooks.

Slots are assigned per name on first use and stay fixed, so a captured graph and later eager calls agree.
A stamp costs one tiny kernel (about 1-3 µs of GPU time per stamp inside a graph, more eagerly); keep to a
few per layer. ``glm5-fp4 profile timers FILE`` aggregates the JSON-lines dumps (median, p90; JSON,
markdown, PNG).

Wiring into an engine plugin (enabled by ``GLM5_FP4_LAYER_TIMERS=1``):

    timer = timer_from_env(device, rank)            # NullTimer when the variable is unset: zero cost
    for i, layer in enumerate(model.layers):        # before warm-up and graph capture
        wrap_module_forward(layer, f"layer{i:02d}", timer)
        wrap_module_forward(layer.self_attn, f"layer{i:02d}/attention", timer)
        wrap_module_forward(layer.mlp, f"layer{i:02d}/moe", timer)
    timer.reset()                                   # after capture: drop the warm-up stamps
    ...                                             # after every decode step (graph replay):
    timer.collect()                                 # synchronises; the sampled-token copy already did

Every captured graph (one per batch size) writes the same slots, so whichever one replays is what is read.
The vLLM and SGLang plugins do this for the model they load: :mod:`glm5_fp4.engines.layer_timers`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from pathlib import Path

import statistics
from typing import Optional

import torch

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.outputs import output_dir, save_figure, write_text_atomic

ENV_ENABLE = "GLM5_FP4_LAYER_TIMERS"
ENV_OUT = "GLM5_FP4_LAYER_TIMERS_OUT"
DEFAULT_OUT_DIR = "layer-timers"
DEFAULT_CAPACITY = 4096
_STOP = "\x00stop"

# -- the stamp op ------------------------------------------------------------------------------------
try:  # Triton resolves `tl` from the kernel's module globals, so the kernel lives at module level
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the CPU path needs no kernel
    triton = None

if triton is not None:
    # one compiled variant for every slot (Triton would otherwise specialise on slot == 1, slot % 16 == 0)
    @triton.jit(do_not_specialize=["slot"])
    def glm5_fp4_timer_stamp_kernel(buf_ptr, slot):
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(buf_ptr + slot, t)


def _globaltimer_kernel():
    if triton is None:
        raise Glm5Fp4Error("GPU layer timers need Triton (it ships with CUDA builds of torch)")
    return glm5_fp4_timer_stamp_kernel


@torch.library.custom_op("glm5_fp4::timer_stamp", mutates_args=("buf",))
def timer_stamp(buf: torch.Tensor, slot: int, after: Optional[torch.Tensor] = None) -> None:
    """Write the current time (ns) into ``buf[slot]``: GPU globaltimer on CUDA, perf_counter_ns on CPU.

    ``after`` is not read: it only makes the stamp depend on that tensor, so a compiler that reorders
    independent ops (Inductor) cannot move the stamp ahead of the work that produced it.
    """
    if buf.is_cuda:
        _globaltimer_kernel()[(1,)](buf, slot, num_warps=1)
    else:
        buf[slot] = time.perf_counter_ns()


@timer_stamp.register_fake
def _timer_stamp_fake(buf: torch.Tensor, slot: int, after: Optional[torch.Tensor] = None) -> None:
    return None


# -- the timer -------------------------------------------------------------------------------------------
class LayerTimer:
    """Named timing points in a device buffer; :meth:`collect` turns them into per-region durations (µs)."""

    enabled = True

    def __init__(self, device: str | torch.device | None = None, capacity: int = DEFAULT_CAPACITY, dump_path: str | Path | None = None):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.capacity = capacity
        self.buf = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self._slot: dict[tuple[str, str], int] = {}
        self.stats = TimerStats()
        self.dump_path = Path(dump_path) if dump_path else None
        self._steps = 0

    # slots are fixed per (kind, name): a captured graph writes the same slots on every replay
    def _slot_for(self, kind: str, name: str) -> int:
        key = (kind, name)
        slot = self._slot.get(key)
        if slot is None:
            slot = len(self._slot)
            if slot >= self.capacity:
                raise Glm5Fp4Error(f"LayerTimer: more than {self.capacity} timing points; raise capacity=")
            self._slot[key] = slot
        return slot

    def _stamp(self, kind: str, name: str, after: torch.Tensor | None) -> None:
        slot = self._slot_for(kind, name)
        if self.device.type == "cpu" and not torch.compiler.is_compiling():
            # eager CPU: what the op does, without its dispatch (~2 µs instead of ~18 µs per stamp)
            self.buf[slot] = time.perf_counter_ns()
        else:
            torch.ops.glm5_fp4.timer_stamp(self.buf, slot, after)

    # ``after``: a tensor the stamp must follow (the layer's input or output); only needed under torch.compile
    def mark(self, name: str, after: torch.Tensor | None = None) -> None:
        """Start region ``name``; ends the region of the previous mark."""
        if name == _STOP:
            raise Glm5Fp4Error("LayerTimer.mark: reserved name")
        self._stamp("mark", name, after)

    def stop(self, after: torch.Tensor | None = None) -> None:
        """End the last mark's region."""
        self._stamp("mark", _STOP, after)

    def begin(self, name: str, after: torch.Tensor | None = None) -> None:
        self._stamp("begin", name, after)

    def end(self, name: str, after: torch.Tensor | None = None) -> None:
        self._stamp("end", name, after)

    @contextlib.contextmanager
    def range(self, name: str, after: torch.Tensor | None = None):
        self.begin(name, after)
        try:
            yield
        finally:
            self.end(name)

    def reset(self) -> None:
        """Forget stamps and statistics (e.g. those of warm-up and graph-capture passes); slots stay."""
        self.buf.zero_()
        self.stats = TimerStats()

    def read(self, synchronize: bool = True) -> dict[str, float]:
        """This step's region durations (µs), clearing the buffer; no statistics, no dump (engine wiring)."""
        n = len(self._slot)
        if n == 0:
            return {}
        if synchronize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stamps = self.buf[:n].tolist()
        self.buf[:n].zero_()
        return regions_from_stamps(self._slot, stamps)

    def collect(self, synchronize: bool = True) -> dict[str, float]:
        """Durations (µs) of this step's regions, in time order; clears the buffer and adds to ``stats``.

        Call after the step (after the graph replay); stamps of regions that did not run are ignored.
        """
        if not self._slot:
            return {}
        regions = self.read(synchronize)
        self.stats.add(regions)
        self._steps += 1
        if self.dump_path is not None:
            with self.dump_path.open("a") as fh:
                fh.write(json.dumps({"step": self._steps, "regions_us": regions}) + "\n")
        return regions


class NullTimer:
    """Same API, does nothing: what the plugins hold when the timers are off."""

    enabled = False
    stats = None

    def mark(self, name: str, after=None) -> None: ...
    def stop(self, after=None) -> None: ...
    def begin(self, name: str, after=None) -> None: ...
    def end(self, name: str, after=None) -> None: ...

    @contextlib.contextmanager
    def range(self, name: str, after=None):
        yield

    def read(self, synchronize: bool = True) -> dict[str, float]:
        return {}

    def collect(self, synchronize: bool = True) -> dict[str, float]:
        return {}

    def reset(self) -> None: ...


def regions_from_stamps(slots: dict[tuple[str, str], int], stamps: list[int]) -> dict[str, float]:
    """Region durations (µs) from raw stamps (ns; 0 = not written this step), ordered by start time."""
    starts: dict[str, float] = {}
    out: dict[str, float] = {}
    marks = sorted((stamps[s], s, name) for (kind, name), s in slots.items() if kind == "mark" and stamps[s])
    for (t0, _, name), (t1, _, _) in zip(marks, marks[1:]):
        if name != _STOP:
            out[name] = out.get(name, 0.0) + (t1 - t0) / 1000.0
            starts.setdefault(name, t0)
    for (kind, name), s in slots.items():
        if kind != "begin" or not stamps[s]:
            continue
        e = slots.get(("end", name))
        if e is not None and stamps[e] >= stamps[s]:
            key = name if name not in out else f"{name} (range)"
            out[key] = (stamps[e] - stamps[s]) / 1000.0
            starts[key] = stamps[s]
    return dict(sorted(out.items(), key=lambda kv: starts[kv[0]]))


def wrap_module_forward(module: torch.nn.Module, name: str, timer: LayerTimer | NullTimer) -> list:
    """Time ``module``'s forward as range ``name`` (forward pre/post hooks); returns the hook handles."""
    if not timer.enabled:
        return []
    pre = module.register_forward_pre_hook(lambda _m, args: timer.begin(name, first_tensor(args)))
    post = module.register_forward_hook(lambda _m, _args, out: timer.end(name, first_tensor(out)))
    return [pre, post]


def first_tensor(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


def enabled_by_env() -> bool:
    from glm5_fp4 import envvars

    return envvars.flag(ENV_ENABLE)


def dump_path_from_env(rank: int = 0) -> Path:
    """Where rank ``rank`` appends its JSON lines: ``GLM5_FP4_LAYER_TIMERS_OUT`` is a directory (default
    ``layer-timers``; file ``rank<r>.jsonl`` inside) or, ending in ``.jsonl``, a file (``{rank}`` is filled in)."""
    out = os.environ.get(ENV_OUT) or DEFAULT_OUT_DIR
    if out.endswith(".jsonl"):
        return Path(out.format(rank=rank) if "{rank}" in out else out)
    return Path(out) / f"rank{rank}.jsonl"


def timer_from_env(device: str | torch.device | None = None, rank: int = 0) -> LayerTimer | NullTimer:
    """A LayerTimer when ``GLM5_FP4_LAYER_TIMERS=1`` (dumping to :func:`dump_path_from_env`), else a NullTimer."""
    if not enabled_by_env():
        return NullTimer()
    path = dump_path_from_env(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    return LayerTimer(device=device, dump_path=path)


# -- aggregation and reports ------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), without numpy: the GPU boxes may lack it."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class TimerStats:
    """Region durations over many steps: median, p90, mean."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}

    def add(self, regions: dict[str, float]) -> None:
        for name, us in regions.items():
            self.samples.setdefault(name, []).append(float(us))

    @property
    def steps(self) -> int:
        return max((len(v) for v in self.samples.values()), default=0)

    def summary(self) -> list[dict]:
        rows = []
        for name, values in self.samples.items():
            rows.append(
                {"region": name, "n": len(values), "median_us": statistics.median(values), "p90_us": percentile(values, 90),
                 "mean_us": statistics.fmean(values), "min_us": min(values), "max_us": max(values)}
            )
        return rows

    def table(self, skip: tuple[str, ...] = ()) -> list[str]:
        lines = ["| region | n | median (µs) | p90 (µs) | mean (µs) | min (µs) | max (µs) |",
                 "|---|---:|---:|---:|---:|---:|---:|"]
        for r in self.summary():
            if r["region"] in skip:
                continue
            lines.append(f"| {r['region']} | {r['n']} | {r['median_us']:.1f} | {r['p90_us']:.1f} | {r['mean_us']:.1f} | "
                         f"{r['min_us']:.1f} | {r['max_us']:.1f} |")
        return lines

    def header(self, title: str, counted: str | None = None) -> list[str]:
        """``counted``: how the steps were counted, where not simply ``self.steps`` of one dump."""
        return [f"# {title}", "", f"{counted or f'{self.steps} step(s)'}; GPU %globaltimer stamps (CPU: perf_counter) "
                "per region.", ""]

    def to_markdown(self, title: str = "Per-layer timers") -> str:
        return "\n".join(self.header(title) + self.table()) + "\n"

    def plot(self, path: Path, title: str = "Per-layer timers", skip: tuple[str, ...] = (),
             steps: int | None = None) -> Path:
        """``skip``: regions the tables leave out (a pooled total of different stages); ``steps``: steps per dump
        where several dumps (ranks) are pooled here, each rank's step being one step."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [r for r in self.summary() if r["region"] not in skip]
        names = [r["region"] for r in rows]
        med = [r["median_us"] for r in rows]
        p90 = [r["p90_us"] - r["median_us"] for r in rows]
        fig, ax = plt.subplots(figsize=(9, 0.28 * len(rows) + 1.6))
        ax.barh(names, med, xerr=[[0] * len(rows), p90], color="#1f77b4", ecolor="#555", capsize=2)
        ax.invert_yaxis()
        ax.set_xlabel("µs per step (bar: median, whisker: p90)")
        ax.set_title(f"{title} ({self.steps if steps is None else steps} steps)", fontsize=10)
        ax.tick_params(axis="y", labelsize=7)
        fig.tight_layout()
        save_figure(fig, path)
        plt.close(fig)
        return path


# What a step's layer time depends on is the tokens its layers processed: a prefill chunk of 8,192 tokens and a
# decode step of 512 streams differ ~8x, so pooling them gives a median of neither. Dumps since 2026-12-01 carry
# ``tokens`` (rows the decoder layers ran); older ones only ``rows`` (the engine's batch size / sampled rows).
# SGLang adds ``phase`` (its forward mode): a DECODE step of 512 streams and a 512-token EXTEND chunk have the same
# token count but not the same attention, so the phase is part of a group too.
GROUP_KEYS = ("tokens", "rows")
GROUP_TABLES = 6  # per-batch tables in the markdown (the groups with the most steps); the JSON has all
# Why a step can lack the count the report groups by, said where such steps are kept apart.
UNCOUNTED_WHY = {
    "tokens": "vLLM's full CUDA graphs replay decode steps without the forward pre-hook that counts the tokens, "
              "while prefill steps run it",
    "rows": "the engine did not say its batch size for them",
}


def _counted(steps: list[int]) -> str:
    """How many steps several dumps (ranks) hold: per dump, since each rank of a step dumps it once."""
    if len(steps) == 1:
        return f"{steps[0]} step(s)"
    return (f"{steps[0]} step(s) in each of {len(steps)} dumps" if len(set(steps)) == 1
            else f"{len(steps)} dumps of {', '.join(map(str, steps))} steps")


def _spans(layers: set[str], order: list[str]) -> str:
    """``layers`` as runs over ``order`` (every dump's layers, sorted): 'layer00-layer02', or 'layer00, layer02'
    where a dump lacks layer01 (shown as one run, the gap was hidden)."""
    runs: list[list[str]] = []
    prev = None
    for i, name in enumerate(order):
        if name not in layers:
            continue
        if prev is not None and prev == i - 1:
            runs[-1].append(name)
        else:
            runs.append([name])
        prev = i
    return ", ".join(r[0] if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) or "-"


def _dump_rows(by_dump: dict[str, TimerStats]) -> list[dict]:
    out = []
    order = sorted(set().union(*(_layers(s) for s in by_dump.values())))
    for name, s in by_dump.items():
        total = s.samples.get("all layers")
        out.append({"file": name, "steps": s.steps, "layers": _spans(_layers(s), order),
                    "all_layers_median_us": statistics.median(total) if total else None,
                    "all_layers_p90_us": percentile(total, 90) if total else None})
    return out


class StepGroup:
    """The steps of one phase and batch size: pooled over the dumps (region tables; a region is one layer's, so
    ranks of one stage agree) and per dump (step counts, and `all layers`, which is one stage's)."""

    def __init__(self, phase: str | None, value: int | None) -> None:
        self.phase, self.value = phase, value
        self.pooled = TimerStats()
        self.by_dump: dict[str, TimerStats] = {}

    def add(self, regions: dict, dump: str) -> None:
        self.pooled.add(regions)
        self.by_dump.setdefault(dump, TimerStats()).add(regions)

    @property
    def steps(self) -> int:
        return max(s.steps for s in self.by_dump.values())

    def steps_per_dump(self) -> dict[str, int]:
        return {name: s.steps for name, s in self.by_dump.items()}

    def counted(self) -> str:
        steps = list(self.steps_per_dump().values())
        return f"{steps[0]} steps" if len(steps) == 1 else _counted(steps)


class TimerReport:
    """Every step pooled (:attr:`pooled`) and the steps grouped by phase and batch size (:attr:`groups`, most
    steps first); :attr:`notes` says what was skipped or set apart, and why."""

    def __init__(self) -> None:
        self.pooled = TimerStats()
        # per group key: (phase, value or None where the step lacks the key) -> its steps
        self.by_key: dict[str, dict[tuple, StepGroup]] = {k: {} for k in GROUP_KEYS}
        self.by_dump: dict[str, TimerStats] = {}  # one dump per rank (or run): its own steps
        self.notes: list[str] = []
        self.timed_nothing = 0  # records without a region, left out

    def add(self, record: dict, dump: str = "") -> None:
        regions = record["regions_us"]
        self.pooled.add(regions)
        self.by_dump.setdefault(dump, TimerStats()).add(regions)
        phase = record.get("phase")
        phase = phase if isinstance(phase, str) and phase else None
        for key in GROUP_KEYS:
            value = record.get(key)
            value = value if isinstance(value, int) and not isinstance(value, bool) else None
            group = self.by_key[key].get((phase, value))
            if group is None:
                group = self.by_key[key][(phase, value)] = StepGroup(phase, value)
            group.add(regions, dump)

    # TimerStats' interface, on the pooled steps (what callers used before the groups existed)
    @property
    def samples(self) -> dict[str, list[float]]:
        return self.pooled.samples

    @property
    def steps(self) -> int:
        """Steps per dump (the most of any dump): ranks of one step each dump it."""
        return max((s.steps for s in self.by_dump.values()), default=0)

    def summary(self) -> list[dict]:
        return self.pooled.summary()

    @property
    def group_by(self) -> str | None:
        """``tokens`` when any step has it, else ``rows`` when any step has that, else None (phases only)."""
        for key in GROUP_KEYS:
            if any(v is not None for _, v in self.by_key[key]):
                return key
        return None

    @property
    def groups(self) -> list[StepGroup]:
        """Steps lacking the ``group_by`` count form a group of their own (value None), never pooled with counted
        ones."""
        groups = list(self.by_key[self.group_by or GROUP_KEYS[0]].values())
        if len(groups) == 1 and groups[0].phase is None and groups[0].value is None:
            return []
        return sorted(groups, key=lambda g: (-g.steps, g.phase or "", g.value is None, g.value or 0))

    def _label(self, g: StepGroup) -> str:
        parts = [g.phase] if g.phase else []
        if self.group_by:
            parts.append(f"no {'token' if self.group_by == 'tokens' else 'row'} count" if g.value is None
                         else f"{g.value} {self.group_by} per step")
        return ", ".join(parts)

    def _group_notes(self) -> list[str]:
        key = self.group_by
        uncounted = [g for g in self.groups if g.value is None] if key else []
        if not uncounted:
            return []
        steps = sum(g.steps for g in uncounted)
        return [f"{steps} step(s) have no `{key}`: {UNCOUNTED_WHY[key]}. They are kept apart as "
                f"`{self._label(uncounted[0])}`{' (per phase)' if len(uncounted) > 1 else ''}, not pooled with the "
                "counted steps."]

    def all_notes(self) -> list[str]:
        return self.notes + self._group_notes() + self._gap_notes()

    def _layer_sets(self) -> list[frozenset[str]]:
        return list(dict.fromkeys(frozenset(_layers(s)) for s in self.by_dump.values()))

    @property
    def stages_differ(self) -> bool:
        """Whether the dumps time different layers: then a pooled `all layers` mixes them."""
        return len(self._layer_sets()) > 1

    @property
    def pipeline_stages(self) -> bool:
        """Whether the dumps' layers are pipeline stages: sets that differ and share no layer (a set that overlaps
        another but lacks some of its layers is a gap, :meth:`_gap_notes`)."""
        sets = self._layer_sets()
        return len(sets) > 1 and all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1:])

    def _gap_notes(self) -> list[str]:
        if not self.stages_differ or self.pipeline_stages:
            return []
        notes = []
        layers = {name: _layers(s) for name, s in self.by_dump.items()}
        for name, mine in layers.items():
            # the layers of the dumps that overlap this one (its stage) that it does not time
            lacks = sorted(set().union(*(o for o in layers.values() if o & mine)) - mine)
            if lacks:
                notes.append(f"{name} lacks {', '.join(lacks)}, which other dumps of its layers time: a layer whose "
                             "timer did not fire on this rank, or dumps of different models; its `all layers` is "
                             "not comparable with theirs")
        return notes

    def dumps(self) -> list[dict]:
        return _dump_rows(self.by_dump)

    def _counted(self) -> str | None:
        if len(self.by_dump) < 2:
            return None
        steps = [s.steps for s in self.by_dump.values()]
        return _counted(steps) + " (a region's n below counts its samples in every dump)"

    def _dump_lines(self) -> list[str]:
        """A table per dump, for dumps that time different layers (:attr:`stages_differ`)."""
        why = ("The dumps time different layers (pipeline stages): `all layers` is one stage's, so the tables below "
               "leave it out (pooled, it would mix the stages); a step of the model spans every stage."
               if self.pipeline_stages else
               "The dumps time different sets of layers (some lack layers that others time, see the notes): the "
               "tables below leave `all layers` out (pooled, it would mix different sums).")
        lines = ["## Per dump", "", why, "",
                 "| dump | steps | layers | median `all layers` (µs) | p90 (µs) |", "|---|---:|---|---:|---:|"]
        for r in self.dumps():
            lines.append(f"| {r['file']} | {r['steps']} | {r['layers']} | {_us(r['all_layers_median_us'])} | "
                         f"{_us(r['all_layers_p90_us'])} |")
        return lines + [""]

    def _group_lines(self, groups: list[StepGroup], mixed: tuple[str, ...]) -> list[str]:
        """One row per group; where the dumps are different stages, one per group and dump, since a stage's
        `all layers` is not the model's and two stages' pooled are neither."""
        phased = any(g.phase for g in groups)
        key = self.group_by
        cols = (["phase"] if phased else []) + ([key] if key else []) + (["dump"] if mixed else [])
        lines = [f"## Steps by {'phase and ' if phased and key else 'phase' if phased else ''}"
                 f"{'batch size (' + key + ')' if key else ''}", "",
                 f"| {' | '.join(cols)} | steps{' per dump' if len(self.by_dump) > 1 and not mixed else ''} | "
                 "median `all layers` (µs) | p90 (µs) |", "|" + "---:|" * (len(cols) + 3)]
        for g in groups:
            head = ([g.phase or "-"] if phased else []) + (["-" if g.value is None else str(g.value)] if key else [])
            per = list(g.by_dump.items()) if mixed else [(None, g.pooled)]
            for name, s in per:
                vals = s.samples.get("all layers")
                med = f"{statistics.median(vals):.1f} | {percentile(vals, 90):.1f}" if vals else "- | -"
                steps = s.steps if mixed else g.steps
                lines.append(f"| {' | '.join(head + ([name] if mixed else []))} | {steps} | {med} |")
        return lines + [""]

    def to_markdown(self, title: str = "Per-layer timers") -> str:
        mixed = self._mixed()
        lines = self.pooled.header(title, self._counted())
        notes = self.all_notes()
        if notes:
            lines += ["## Notes", "", *(f"- {n}" for n in notes), ""]
        lines += self._dump_lines() if mixed else []
        groups = self.groups
        if len(groups) > 1:
            lines += self._group_lines(groups, mixed)
            for g in groups[:GROUP_TABLES]:
                lines += [f"## {self._label(g)} ({g.counted()})", "", *g.pooled.table(mixed), ""]
            if len(groups) > GROUP_TABLES:
                lines += [f"({len(groups) - GROUP_TABLES} more batch sizes in the JSON.)", ""]
            lines += ["## All steps pooled", "",
                      f"This table pools {len(groups)} batch sizes (prefill chunks and decode steps alike): its "
                      "medians describe none of them; read the tables above.", ""]
        lines += self.pooled.table(mixed)
        return "\n".join(lines) + "\n"

    def _mixed(self) -> tuple[str, ...]:
        """Regions whose pooled figures mix dumps of different layers."""
        return ("all layers",) if self.stages_differ else ()

    def write(self, out: Path, title: str = "Per-layer timers", png: bool = True) -> dict[str, Path]:
        out = output_dir(out)
        paths = {"json": out / "layer_timers.json", "markdown": out / "layer_timers.md"}
        mixed = self._mixed()
        doc = {"steps": self.steps, "dumps": self.dumps(), "stages_differ": bool(mixed), "notes": self.all_notes(),
               "regions": [r for r in self.summary() if r["region"] not in mixed], "group_by": self.group_by,
               "groups": [{"phase": g.phase, "value": g.value, "steps": g.steps, "steps_per_dump": g.steps_per_dump(),
                           "dumps": _dump_rows(g.by_dump),
                           "regions": [r for r in g.pooled.summary() if r["region"] not in mixed]}
                          for g in self.groups]}
        write_text_atomic(paths["json"], json.dumps(doc, indent=1) + "\n")
        write_text_atomic(paths["markdown"], self.to_markdown(title))
        if png:
            # the batch size with the most steps (the decode steps of a load wave), or all steps when ungrouped
            groups = self.groups
            stats, label, steps = ((groups[0].pooled, f"{title}: {self._label(groups[0])}", groups[0].steps) if groups
                                   else (self.pooled, title, self.steps))
            try:
                paths["png"] = stats.plot(out / "layer_timers.png", label, skip=mixed, steps=steps)
            except ImportError:
                pass
        return paths


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _check_regions(regions: dict, where: str) -> None:
    """LayerTimer writes only finite durations >= 0 (an end stamped before its begin is dropped), so anything
    else is a corrupt or foreign file; summarising it would print negative or NaN medians as if measured."""
    for name, us in regions.items():
        if isinstance(us, bool) or not isinstance(us, (int, float)):
            raise Glm5Fp4Error(f"{where}: region {name!r} is {us!r}, expected a number of µs")
        # the bounds first: math.isfinite converts to float, which overflows on a huge JSON integer
        if us < 0 or us > MAX_REGION_US or not math.isfinite(us):
            shown = us if isinstance(us, float) or abs(us) < 10**30 else f"an integer of {len(str(abs(us)))} digits"
            raise Glm5Fp4Error(f"{where}: region {name!r} is {shown} µs; a duration is finite, >= 0 and under a day "
                               "(one step's region)")


def _layers(stats: TimerStats) -> set[str]:
    """The layers a dump times (top-level regions but the total)."""
    return {name for name in stats.samples if "/" not in name and name != "all layers"}


# One step's region lasts far less; larger values are corrupt, and 1e308 overflowed the summary's sums.
MAX_REGION_US = 86_400e6
# Why a dump can be empty; vLLM's plugin dumps at compute_logits, which only the last pipeline stage runs.
EMPTY_WHY = ("a pipeline stage before the last (it computes no logits, so vLLM's timers never dump there) or a worker "
             "that died before its first step")


def _records(f: Path, raw: bytes, report: TimerReport) -> list[dict]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Glm5Fp4Error(f"{f}: not a layer-timer dump (not UTF-8 text)") from None
    lines = text.splitlines()
    torn = bool(text) and not text.endswith(("\n", "\r"))  # the writer ends every line; a kill can cut the last
    records: list[dict] = []
    last_step: int | None = None
    empty = 0
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record["regions_us"], dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            if torn and i == len(lines):
                report.notes.append(f"{f}: line {i}, the last, is unterminated and not a record (a worker killed "
                                    "while writing it?); it is left out")
                break
            raise Glm5Fp4Error(f"{f}:{i}: not a layer-timer record (expected JSON with 'regions_us')") from None
        _check_regions(record["regions_us"], f"{f}:{i}")
        for key in GROUP_KEYS:  # the report's groups: a count no step has made a group of its own
            v = record.get(key)
            # 0 is a step: SGLang's idle DP-attention ranks run the model on no token (phase IDLE)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise Glm5Fp4Error(f"{f}:{i}: {key!r} is {v!r}, expected a whole number >= 0 (or no {key!r})")
        if not record["regions_us"]:  # a step in which no timer stamp fired: nothing to count as a step
            empty += 1
            continue
        # the writers append and count from 1 each run: merged, two runs would give a median of neither
        step = record.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            if last_step is not None and step <= last_step:
                raise Glm5Fp4Error(f"{f}:{i}: step {step} follows step {last_step}: a second run appended to this "
                                   f"file? give each run its own {ENV_OUT}")
            last_step = step
        records.append(record)
    if empty:
        report.notes.append(f"{f}: {empty} record(s) time no region (no timer stamp fired in their steps): left out")
        report.timed_nothing += empty
    return records


def read_dumps(files: list[Path]) -> TimerReport:
    report = TimerReport()
    # The writer names a rank's dump rank<r>.jsonl in the run's folder: one name in two folders is one rank of
    # two runs (their pooled median describes neither run), not two ranks.
    by_name: dict[str, Path] = {}
    for f in files:
        other = by_name.setdefault(Path(f).name, Path(f))
        if other != Path(f) and other.resolve() != Path(f).resolve():
            raise Glm5Fp4Error(f"{other} and {f} are both {Path(f).name}: one rank's dump of two runs (each run "
                               "writes one file per rank); report each run on its own")
    seen: dict[bytes, Path] = {}
    for f in files:
        try:
            raw = f.read_bytes()
        except OSError as exc:
            raise Glm5Fp4Error(f"{f}: cannot read ({exc.strerror})") from None
        records = _records(f, raw, report)
        if not records:
            report.notes.append(f"{f}: no records, skipped; it may be {EMPTY_WHY}")
            continue
        # Each dump is its own steps (one per rank or run); the same one twice would double every count.
        digest = hashlib.sha256(raw).digest()
        if digest in seen:
            same = "given twice" if seen[digest].resolve() == f.resolve() else f"has the same content as {seen[digest]}"
            raise Glm5Fp4Error(f"{f}: {same}; each dump may be counted once")
        seen[digest] = f
        for record in records:
            report.add(record, Path(f).name)
    if not report.samples:
        why = (f"; {report.timed_nothing} record(s) time no region (no timer stamp fired in their steps)"
               if report.timed_nothing else "")
        raise Glm5Fp4Error(f"no layer-timer records in {', '.join(str(f) for f in files)}{why}")
    return report


def report_from_files(files: list[Path], out: Path) -> dict[str, Path]:
    return read_dumps(files).write(out)


def report_dir(dump_dir: str | Path, out: str | Path | None = None) -> dict[str, Path]:
    """Aggregate every ``*.jsonl`` dump in ``dump_dir`` (what the engine plugins write) into
    ``layer_timers.{json,md,png}`` under ``out`` (default: ``dump_dir/report``); returns their paths."""
    dump_dir = Path(dump_dir)
    files = sorted(dump_dir.glob("*.jsonl"))
    if not files:
        raise Glm5Fp4Error(f"{dump_dir}: no layer-timer dumps (*.jsonl); was the server started with {ENV_ENABLE}=1?")
    return report_from_files(files, Path(out) if out is not None else dump_dir / "report")
