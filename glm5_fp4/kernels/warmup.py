"""Compile every MoE kernel variant a layer can launch when its weights are loaded, not at the first request
that needs it.

Triton compiles a kernel the first time it sees a new specialisation: the plan's constexprs (tiles, schedule,
split counts: a handful of regimes over the token count) and, for integer arguments, whether a value is 1,
divisible by 16, and fits 32 bits. Served on the H200 (SGLang 0.5.15, GLM-5 true dimensions, 2026-12-01),
requests that brought a batch shape for the first time waited ~0.4 s for their first token (p99 TTFT 446 ms at
1 stream against a median of 15 ms; 501 ms against 98 ms at 32 streams), while stock Marlin, built ahead of
time, did not. The engines' CUDA-graph capture compiles the decode sizes it captures; eager prefill sizes were
left to the first request.

:func:`warmup_token_counts` picks one token count per distinct launch signature up to the engine's largest
batch (checked against every count by tests/test_kernels_warmup.py); :func:`warm_up` runs the layer once at
each of them, under the expert map its calls will carry (SGLang passes one on every call; vLLM under expert
parallelism: the map is a constexpr of the align and slot kernels, and it changes the plan), once per process
and shape. ``GLM5_FP4_WARMUP=0`` skips it (faster start; compiles at first use).

On the H200 the next run (2026-12-01) compiled 32 counts up to 16,384 in 10.5 s at load and nothing afterwards
(tests/gpu/test_warmup_gpu.py), yet first-token stalls of a few hundred ms remained in both engines: they have
another cause, which :mod:`glm5_fp4.kernels.slow_calls` is there to name.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from glm5_fp4 import envvars
from glm5_fp4.kernels.slow_calls import WATCH

ENV = "GLM5_FP4_WARMUP"
_LOG = logging.getLogger("glm5_fp4")
_DONE: set[tuple] = set()
_LOCK = threading.Lock()


def _int_class(v: int) -> tuple[bool, bool, bool]:
    # what Triton keys an integer argument on
    return v == 1, v % 16 == 0, -(2**31) <= v < 2**31


def signature(launches) -> tuple:
    """What decides which compiled kernels a call needs: each launch's kernel, constexprs and options, and the
    specialisation class of its integer arguments (tensors are always 16-byte aligned here, ids int32)."""
    out = []
    for launch in launches:
        ints = tuple(_int_class(a) for a in launch.args if isinstance(a, int) and not isinstance(a, bool))
        consts = tuple(sorted((k, v) for k, v in launch.kwargs.items() if isinstance(v, (bool, int, str, float))))
        out.append((launch.name, consts, ints))
    return tuple(out)


def meta_launches(prepared_meta, top_k: int, tokens: int, mode: str, x_dtype: torch.dtype, arch: str,
                  sm_count: int, use_asm: bool = True, map_size: int | None = None) -> list:
    """The launches one call of ``tokens`` makes (with an expert map of ``map_size`` entries if given), on meta
    tensors: nothing runs or is allocated."""
    from glm5_fp4.kernels.launch import MoECall, launches
    from glm5_fp4.kernels.moe import Workspace, plan_for

    meta = torch.device("meta")
    e, h, i = prepared_meta.num_experts, prepared_meta.hidden_size, prepared_meta.intermediate_size
    x = torch.empty(tokens, h, dtype=x_dtype, device=meta)
    tw = torch.empty(tokens, top_k, dtype=torch.float32, device=meta)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=meta)
    emap = None if map_size is None else torch.empty(map_size, dtype=torch.int32, device=meta)
    ws = Workspace(meta, e, top_k, h, i, tokens)
    call = MoECall(x, tw, ids, prepared_meta, mode, torch.empty_like(x), ws, emap, use_asm=use_asm)
    return launches(plan_for(arch, sm_count, tokens, top_k, prepared_meta, mode, emap), call)


def _candidates(prepared_meta, top_k: int, max_tokens: int, mode: str, arch: str, sm_count: int,
                map_size: int | None) -> list[int]:
    # Regions where the plan and the align kernel's block stay the same; inside one, a signature depends only on
    # the integer classes, which repeat with the count modulo 16 (and differ at 1). 16 consecutive counts from
    # each region's start see every class the region has: a superset of the signature changes (the test checks
    # the claim against every count). Counts past the kernels' 32-bit limit are refused by the launcher anyway.
    from glm5_fp4.kernels.launch import MAX_TOKENS_X_HIDDEN, align_block
    from glm5_fp4.kernels.moe import plan_for

    emap = None if map_size is None else torch.empty(map_size, device="meta")
    top = min(max_tokens, (MAX_TOKENS_X_HIDDEN - 1) // prepared_meta.hidden_size)
    starts, prev = {1, 2}, None
    for t in range(1, top + 1):
        key = (plan_for(arch, sm_count, t, top_k, prepared_meta, mode, emap), align_block(t * top_k))
        if key != prev:
            starts.add(t)
            prev = key
    return sorted({t + d for t in starts for d in range(16) if 1 <= t + d <= top})


def warmup_token_counts(prepared_meta, top_k: int, max_tokens: int, mode: str, x_dtype: torch.dtype, arch: str,
                        sm_count: int, use_asm: bool = True, map_size: int | None = None) -> list[int]:
    """One token count per distinct launch signature among 1..``max_tokens``."""
    seen: dict[tuple, int] = {}
    for t in _candidates(prepared_meta, top_k, max_tokens, mode, arch, sm_count, map_size):
        sig = signature(meta_launches(prepared_meta, top_k, t, mode, x_dtype, arch, sm_count, use_asm, map_size))
        seen.setdefault(sig, t)
    return sorted(seen.values())


def _meta_like(prepared):
    return type(prepared)(**{n: (None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta"))
                             for n, t in prepared.tensors().items()}, layout=prepared.layout)


def enabled() -> bool:
    return envvars.flag(ENV)


def _compiles_here(device: torch.device) -> bool:
    from glm5_fp4.kernels import moe

    return device.type == "cuda" and not moe._interpreting()


def warm_up(prepared, mode: str, top_k: int, max_tokens: int, x_dtype: torch.dtype = torch.bfloat16,
            expert_map: torch.Tensor | None = None, run: Callable | None = None) -> list[int]:
    """Run the layer once at each count of :func:`warmup_token_counts` (first layer of each shape only), with
    ``expert_map`` as its calls will pass it.

    Returns the counts run ([] when skipped: disabled, not on a CUDA GPU, or this shape already warmed). A
    warm-up that fails leaves the shape to the next layer's try."""
    from glm5_fp4.kernels import moe

    device = prepared.device
    if not enabled() or not _compiles_here(device):
        return []
    map_size = None if expert_map is None else int(expert_map.numel())
    key = (str(device), prepared.num_experts, top_k, prepared.hidden_size, prepared.intermediate_size, mode,
           prepared.layout, x_dtype, max_tokens, map_size)
    with _LOCK:
        if key in _DONE:
            return []
        _DONE.add(key)
    try:
        arch, sms = moe.device_arch(device)
        t0 = time.monotonic()
        counts = warmup_token_counts(_meta_like(prepared), top_k, max_tokens, mode, x_dtype, arch, sms,
                                     moe._use_asm(device), map_size)
        run = run or moe.fused_moe
        e = prepared.num_experts
        # compiling is the point here: not reported as slow calls, and the compile snapshot is retaken after
        with WATCH.quiet():
            for t in counts:
                x = torch.zeros(t, prepared.hidden_size, dtype=x_dtype, device=device)
                # distinct experts per row, as a router gives; the values do not matter, only the shapes
                ids = ((torch.arange(t, device=device)[:, None] * top_k + torch.arange(top_k, device=device)) % e)
                w = torch.full((t, top_k), 1.0 / top_k, dtype=torch.float32, device=device)
                run(x, w, ids.to(torch.int32), prepared, mode, expert_map=expert_map)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        WATCH.warmed_up()
    except BaseException:
        with _LOCK:
            _DONE.discard(key)
        raise
    _LOG.info("glm5_fp4: compiled the MoE kernels for %d token counts up to %d in %.1f s (%s=0 skips this)",
              len(counts), max_tokens, time.monotonic() - t0, ENV)
    return counts
