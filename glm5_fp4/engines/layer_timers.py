"""Per-layer timers inside vLLM and SGLang: the decoder layers of the model a worker loads, timed every forward.

Switched on by ``GLM5_FP4_LAYER_TIMERS=1`` (both plugins); each worker appends one JSON line per model forward
to ``GLM5_FP4_LAYER_TIMERS_OUT`` (a directory, default ``./layer-timers``, file ``rank<r>.jsonl``). Report:
``glm5-fp4 profile timers layer-timers/*.jsonl --out DIR`` or :func:`glm5_fp4.profiling.layer_timers.report_dir`
(JSON + markdown + PNG, median and p90 per region).

Regions. Two marks per decoder layer tile the forward without gaps (a mark ends the previous region):

* ``layerNN/attention``: from ``self_attn``'s start to ``mlp``'s start (attention + post-attention norm);
* ``layerNN/moe`` (``/mlp`` on dense layers): from ``mlp``'s start to the next layer's ``self_attn`` start
  (experts + router + shared expert + the next layer's input norm); the last layer's ends with that layer;
* ``layerNN`` = the two added up, and ``all layers`` = every layer, computed on the host when a step is dumped.

Two stamps per layer, not four: on a GPU each stamp is a one-thread kernel of about 1-3 µs inside a graph, and
GLM-5 has 78 layers. The stamps are :func:`glm5_fp4.profiling.layer_timers.timer_stamp` custom ops placed by
forward pre-hooks; the hooks are installed at the model's first forward (vLLM's memory-profiling or first real
step), before torch.compile traces the model and before CUDA graphs are captured, so compiled code and every
graph replay carry the stamps while the hooks themselves no longer run.

Step boundary (where the host reads the buffer, which synchronises the device):

* vLLM: a pre-hook on the model's ``logits_processor``. ``compute_logits`` runs on the host after every forward
  in eager, piecewise and full-CUDA-graph modes alike (it is never inside a captured graph), once per step.
  Pipeline-parallel ranks other than the last compute no logits and so dump nothing.
* SGLang: an AFTER hook on ``ModelRunner.forward`` (SGLang's HookRegistry), which returns after the replay.

Reading the buffer synchronises once per step; with async scheduling that costs the overlap of the next step's
host work, so keep the timers off when measuring throughput.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path

import torch

from glm5_fp4.profiling.layer_timers import LayerTimer, dump_path_from_env, enabled_by_env, first_tensor

logger = logging.getLogger("glm5_fp4.layer_timers")
ALL_LAYERS = "all layers"
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)$")


# -- the model side: which modules, which regions ------------------------------------------------------------------
def decoder_layers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(index, module) of each decoder layer: ``...layers.<i>`` modules with ``self_attn`` and ``mlp``
    (vLLM's and SGLang's DeepSeek-V2/GLM-5 and GLM-4.5 models; pipeline stand-ins for other ranks have neither)."""
    found = []
    for name, module in model.named_modules():
        m = _LAYER_NAME.search(name)
        if m and isinstance(getattr(module, "self_attn", None), torch.nn.Module) \
                and isinstance(getattr(module, "mlp", None), torch.nn.Module):
            found.append((int(m.group(1)), module))
    return sorted(found, key=lambda item: item[0])


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor a stamp is ordered after: the sublayer's hidden states, which the previous sublayer produced.

    Only floating-point tensors qualify: vLLM's DeepSeek-V2/GLM-5 layer calls ``self_attn(positions, hidden_states,
    ...)`` positionally, and a stamp anchored on ``positions`` (int64, ready from the step's start) let Inductor
    hoist the next layer's attention mark above the MoE (H200, vLLM 0.26, 2026-12-01: ``layer03/moe`` measured
    ~1 µs and ``layer04/attention`` took layer 3's experts)."""
    named = kwargs.get("hidden_states")
    if isinstance(named, torch.Tensor):
        return named
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    return next((t for t in tensors if t.is_floating_point()), tensors[0] if tensors else None)


def instrument(layers: list[tuple[int, torch.nn.Module]], timer: LayerTimer) -> list:
    """Put the two marks per layer (and the final stop) on ``layers``; returns the hook handles.

    Every timing point is stamped once here, outside any compile or capture: slots get assigned (a traced
    graph then only looks them up) and on a GPU the stamp kernel is compiled now, not during graph capture.
    """
    if not layers:
        return []
    width = max(2, len(str(layers[-1][0])))
    handles = []
    for idx, layer in layers:
        sub = "moe" if hasattr(layer.mlp, "experts") else "mlp"
        for module, region in ((layer.self_attn, f"layer{idx:0{width}d}/attention"),
                               (layer.mlp, f"layer{idx:0{width}d}/{sub}")):
            timer.mark(region)
            handles.append(module.register_forward_pre_hook(
                lambda _m, args, kwargs, region=region: timer.mark(region, _hidden(args, kwargs)), with_kwargs=True))
    timer.stop()
    handles.append(layers[-1][1].register_forward_hook(lambda _m, _args, out: timer.stop(first_tensor(out))))
    timer.reset()
    return handles


def with_layer_totals(regions: dict[str, float]) -> dict[str, float]:
    """Add ``layerNN`` (sum of its sub-regions) before each layer's sub-regions, and ``all layers`` at the end."""
    out: dict[str, float] = {}
    total = 0.0
    for name, us in regions.items():
        layer, sep, _ = name.partition("/")
        if sep:
            out[layer] = out.get(layer, 0.0) + us
            total += us
        out[name] = us
    if total:
        out[ALL_LAYERS] = total
    return out


class StepRecorder:
    """The timer of one worker's model and its dump file: :meth:`step` after every forward."""

    def __init__(self, timer: LayerTimer, path: Path, n_layers: int) -> None:
        self.timer = timer
        self.path = path
        self.n_layers = n_layers
        self.steps = 0
        self.skipped = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = path.open("a", buffering=1)  # line-buffered: a killed server still leaves whole lines

    def step(self, rows: int | None = None, record: bool = True, tokens: int | None = None,
             phase: str | None = None) -> dict[str, float]:
        """Read this forward's stamps (synchronises); append them as one JSON line unless ``record`` is False.

        ``rows``: the engine's batch size (SGLang) or the rows it samples (vLLM); ``tokens``: the rows the decoder
        layers ran (what their time depends on; the report groups steps by it); ``phase``: the engine's name for
        the forward (SGLang's forward mode), when it has one."""
        regions = self.timer.read()
        if not record or not regions:
            self.skipped += 1
            return {}
        self.steps += 1
        regions = with_layer_totals(regions)
        line = {"step": self.steps, "rows": rows}
        if tokens is not None:
            line["tokens"] = tokens
        if phase is not None:
            line["phase"] = phase
        self._fh.write(json.dumps({**line, "regions_us": regions}) + "\n")
        return regions


def attach(model: torch.nn.Module, rank: int | None = None, path: Path | None = None) -> StepRecorder | None:
    """Instrument ``model``'s decoder layers with a fresh timer on the model's device; None if it has none."""
    layers = decoder_layers(model)
    if not layers:
        logger.warning("glm5_fp4: layer timers: no decoder layers (modules 'layers.<i>' with self_attn and mlp) "
                       "in %s; nothing is timed", type(model).__name__)
        return None
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    rank = _rank() if rank is None else rank
    timer = LayerTimer(device=device)
    instrument(layers, timer)
    recorder = StepRecorder(timer, path or dump_path_from_env(rank), len(layers))
    logger.warning("glm5_fp4: layer timers on: %d decoder layers of %s on %s, dumping to %s", len(layers),
                   type(model).__name__, device, recorder.path)
    return recorder


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


# -- vLLM ----------------------------------------------------------------------------------------------------------
# Frames of vLLM's warm-up passes (memory profiling, sampler warm-up, graph capture) that also run compute_logits.
VLLM_WARMUP_FRAMES = frozenset({"_dummy_sampler_run", "_dummy_run", "profile_run", "capture_model"})


def _called_from(names: frozenset[str], skip: int = 2, depth: int = 16) -> bool:
    frame = sys._getframe(skip)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name in names:
            return True
        frame = frame.f_back
    return False


def _is_vllm_model(module: torch.nn.Module) -> bool:
    return callable(getattr(module, "compute_logits", None)) and \
        isinstance(getattr(module, "logits_processor", None), torch.nn.Module)


class _VllmInstaller:
    """A global forward pre-hook that attaches the timers to the first vLLM model called, then removes itself.

    What: ``torch.nn.modules.module.register_module_forward_pre_hook`` (public torch API; nothing in vLLM is
      patched). The first module called that has ``compute_logits`` and a ``logits_processor`` is the model the
      worker loaded; its decoder layers get the marks and its ``logits_processor`` the step hook.
    Why: vLLM has no plugin hook that sees the loaded model before warm-up, and the quantization config only
      sees leaf layers (linears, experts) while the parent decoder layers are still being built.
    How: while installed, every module call first checks two attributes (only in processes with the timers on,
      only until the model's first forward: vLLM's memory-profiling run, or the first step in eager mode).
    Upstream: none filed; vLLM 0.32 (CPU) and 0.33 both call the model before compiling or capturing it.
    Remove when: vLLM offers a post-load model hook to general plugins.

    Warm-up passes also call ``compute_logits`` (the sampler warm-up after memory profiling); their stamps are
    read and dropped, recognised by vLLM's warm-up functions on the call stack (``VLLM_WARMUP_FRAMES``;
    renamed upstream, they would show up as one or two extra steps in the dump, not as an error).
    """

    def __init__(self) -> None:
        self.handle = None
        self.recorder: StepRecorder | None = None
        self.tokens: int | None = None

    def install(self) -> None:
        if self.handle is None:
            self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self._first_forward)

    def uninstall(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _first_forward(self, module: torch.nn.Module, _args) -> None:
        if not _is_vllm_model(module):
            return None
        self.uninstall()
        self.recorder = attach(module)
        if self.recorder is not None:
            module.logits_processor.register_forward_pre_hook(self._before_logits)
            # The model's own forward runs in Python every step under piecewise graphs and eager (not under a
            # full-graph replay: the step then records no token count rather than a stale one).
            module.register_forward_pre_hook(self._before_forward, with_kwargs=True)
            self._before_forward(module, _args, {})  # this first call too
        return None

    def _before_forward(self, _module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if isinstance(ids, torch.Tensor):
            self.tokens = int(ids.shape[0])
        elif isinstance(pos, torch.Tensor):
            self.tokens = int(pos.shape[-1])  # (3, T) under M-RoPE
        return None

    def _before_logits(self, _module, args) -> None:
        hidden = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        tokens, self.tokens = self.tokens, None
        self.recorder.step(rows=None if hidden is None else int(hidden.shape[0]),
                           record=not _called_from(VLLM_WARMUP_FRAMES), tokens=tokens)
        return None


VLLM_INSTALLER = _VllmInstaller()


def install_vllm() -> bool:
    """Called by the vLLM plugin's ``register()`` in every process; True when the timers are on."""
    if not enabled_by_env():
        return False
    # What: VLLM_DISABLE_COMPILE_CACHE=1 unless the user set it.
    # Why: vLLM's compile cache (and AOT-compiled bytecode) is keyed by config and source files, not by
    #   forward hooks; a cache written without timers would be loaded without stamps, and one written with
    #   timers would put stamps into later runs without them.
    # How: set in this process before vLLM compiles; processes it spawns inherit it.
    # Remove when: the timers put something into vLLM's compile hash (e.g. additional_config).
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    VLLM_INSTALLER.install()
    return True


# -- SGLang --------------------------------------------------------------------------------------------------------
SGLANG_MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"


def sglang_after_load_model(result, runner, *args, **kwargs):
    """AFTER ``ModelRunner.load_model``: instrument ``runner.model`` (before SGLang captures CUDA graphs)."""
    runner._glm5_fp4_layer_timers = attach(runner.model)
    return None


def sglang_after_forward(result, runner, *args, **kwargs):
    """AFTER ``ModelRunner.forward``: one step (the graph replay, if any, has been launched)."""
    recorder = getattr(runner, "_glm5_fp4_layer_timers", None)
    if recorder is not None:
        batch = args[0] if args else kwargs.get("forward_batch")
        ids = getattr(batch, "input_ids", None)
        mode = getattr(batch, "forward_mode", None)
        recorder.step(rows=getattr(batch, "batch_size", None),
                      tokens=int(ids.shape[0]) if isinstance(ids, torch.Tensor) else None,
                      phase=getattr(mode, "name", None))
    return None


def sglang_hooks() -> dict[str, object]:
    """HookRegistry AFTER hooks (target -> function) when the timers are on, else none.

    What: AFTER hooks on ``ModelRunner.load_model`` and ``ModelRunner.forward``.
    Why: per-layer timers need the loaded model before CUDA-graph capture and a host point after every forward.
    How: SGLang's own HookRegistry; both call the original unchanged first.
    Upstream: none (sgl-project/sglang 0.5.23). Remove when: SGLang ships per-layer timing that survives graphs.
    """
    if not enabled_by_env():
        return {}
    return {f"{SGLANG_MODEL_RUNNER}.load_model": sglang_after_load_model,
            f"{SGLANG_MODEL_RUNNER}.forward": sglang_after_forward}
