"""`glm5-fp4 plan`: memory per GPU and a roofline decode step time for a launch profile, layouts side by side.

    glm5-fp4 plan --profile launch/tp8.yaml [--gpu rtx-pro-6000-ws] [--concurrency 512] [--context 2048]
                  [--layouts tp8,tp4pp2,tp8ep8,dp8ep8] [--expert-skew 0.2] [--config DIR/config.json] [--json]

Layouts: ``tpN`` (tensor parallel), ``tpNppM`` (+ pipeline stages), ``tpNepN`` (attention TP, experts split whole
over the GPUs), ``dpNepN`` (data-parallel attention: each GPU its own sequences and KV, experts split whole, tokens
dispatched to their experts' GPUs by all-to-all, DeepEP-style), ``dpNepNagrs`` (the same with every GPU's tokens
all-gathered before the MoE and the partial sums reduce-scattered after it: what vLLM and SGLang run with our MoE
over PCIe, and what a dpNepN profile is planned with). By default the profile's own layout is shown next to TP8 and
TP4+PP2. Every assumption is printed under the numbers; the formulas are in glm5_fp4/cost_model.py (the model
`profile analyze` uses for its ceilings).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from glm5_fp4.argtypes import ranged, fraction, nonneg_float, positive_float, positive_int
from glm5_fp4.errors import Glm5Fp4Error

DEFAULT_LAYOUTS = ("tp8", "tp4pp2")


# GiB held back per GPU: anything past a GPU's memory is a typo, and 1e300 overflowed the planner's integer bytes
_reserve_gib = ranged("reserve_gib", float, lambda v: 0 <= v <= 4096, "between 0 and 4096 (GiB)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default=None, help="launch profile YAML, or a packaged one by name (tp8, "
                        "tp4pp2, ...; default: GLM-5 on vLLM, TP8, c512)")
    parser.add_argument("--gpu", default="rtx-pro-6000-ws", help="GPU from the hardware table (glm5_fp4/data/hardware.yaml)")
    parser.add_argument("--concurrency", type=positive_int, default=None, help="running sequences (default: max_concurrency)")
    parser.add_argument("--context", type=positive_int, default=2048, help="tokens of context per sequence (default 2048)")
    parser.add_argument("--layouts", default=None,
                        help="comma-separated, e.g. tp8,tp4pp2,tp8ep8,dp8ep8,dp8ep8agrs "
                             "(default: the profile's, tp8, tp4pp2)")
    parser.add_argument("--config", default=None,
                        help="model config.json (default: the profile's model dir if it has one, else GLM-5's)")
    parser.add_argument("--mem-util", type=fraction, default=0.90, help="fraction of GPU memory the engine may use")
    parser.add_argument("--reserve-gib", type=_reserve_gib, default=2.0,
                        help="GiB kept for activations, CUDA graphs and NCCL buffers")
    parser.add_argument("--efficiency", type=fraction, default=1.0, help="fraction of peak bandwidth/FLOPS reached")
    parser.add_argument("--kv-cache-dtype", default=None,
                        help="the engine's KV-cache dtype (default: the profile's, else auto: what the engine makes "
                             "of it on the GPU, FP8 DSA rows on an RTX PRO 6000, BF16 on an H200)")
    parser.add_argument("--expert-math", choices=("nvfp4", "bf16"), default=None,
                        help="roof for expert GEMMs: nvfp4 (W4A4) or bf16 (W4A16); default nvfp4 where the GPU has it")
    parser.add_argument("--expert-dtype", choices=("nvfp4", "fp8", "bf16"), default=None,
                        help="storage of the routed experts (default: the --config/profile checkpoint's quantization "
                             "config, else nvfp4)")
    parser.add_argument("--dense-dtype", choices=("nvfp4", "fp8", "bf16"), default=None,
                        help="storage of the shared experts and dense MLPs (default: the --config/profile "
                             "checkpoint's quantization config, else as the routed experts, as in "
                             "nvidia/GLM-5-NVFP4; GLM-5.1/5.2-NVFP4 keep them bf16)")
    parser.add_argument("--expert-skew", type=nonneg_float, default=0.0,
                        help="expert parallelism: the hottest GPU's token-slots over the mean, minus 1 (default 0)")
    parser.add_argument("--dispatch-dtype", choices=("bf16", "fp8"), default="bf16",
                        help="all-to-all dispatch precision for DP-attention + EP layouts (combine is BF16)")
    parser.add_argument("--allreduce-gbs", type=positive_float, default=None, help="all-reduce bus bandwidth override (GB/s)")
    parser.add_argument("--allreduce-latency-us", type=nonneg_float, default=None, help="all-reduce latency override (us)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the table")


LAYOUT = re.compile(r"\s*(tp|dp)(\d+)(?:\s*[+x]?\s*ep(\d+))?(?:\s*[+x]?\s*pp(\d+))?(?:\s*[+x-]?\s*(a2a|agrs))?\s*")
LayoutTuple = tuple[int, int, int, int, str]  # GPUs per stage, stages, dp, ep, ep_comm (glm5_fp4.cost_model.Layout)


def parse_layout(text: str, flag: str = "--layouts") -> LayoutTuple:
    """``tp8`` / ``tp4pp2`` / ``tp8ep8`` / ``dp8ep8`` / ``dp8ep8agrs`` -> (GPUs per stage, stages, dp, ep, ep_comm)."""
    m = LAYOUT.fullmatch(text.lower())
    n = [int(g) if g else None for g in m.groups()[1:4]] if m else []
    if not m or any(v is not None and v < 1 for v in n):
        raise Glm5Fp4Error(f"{flag}: {text!r} is not a layout like tp8, tp4pp2, tp8ep8, dp8ep8 or dp8ep8agrs")
    gpus, ep, pp = n[0], n[1] or 1, n[2] or 1
    return gpus, pp, gpus if m.group(1) == "dp" else 1, ep, m.group(5) or "a2a"


def profile_layout(profile) -> LayoutTuple:
    """The layout a launch profile's command runs, as :func:`parse_layout` spells it (behind data-parallel
    attention, the MoE communication the engine is given: glm5_fp4.launch.commands.ep_communication)."""
    from glm5_fp4.launch.commands import ep_communication

    comm = ep_communication(profile)
    return (profile.stage_gpus, profile.pipeline_parallel, profile.data_parallel, profile.ep_size,
            comm[1] if comm else "a2a")


def _layout_name(layout: LayoutTuple) -> str:
    """A parsed layout as --layouts spells it."""
    gpus, pp, dp, ep, comm = layout
    name = ("dp" if dp > 1 else "tp") + str(gpus) + (f"ep{ep}" if ep > 1 else "") + (f"pp{pp}" if pp > 1 else "")
    return name + ("agrs" if dp > 1 and comm == "agrs" else "")


WEIGHT_ONLY_BACKENDS = ("marlin", "humming", "experimental_sgl_marlin")


def _weight_only_math(profile) -> str | None:
    """``bf16`` when the profile's MoE backend computes W4A16 (weights dequantized to BF16 MMA), else None."""
    if profile.moe_backend in WEIGHT_ONLY_BACKENDS or (profile.uses_ours and profile.glm5_fp4.mode == "w4a16"):
        return "bf16"
    return None


def _spec_for(profile, config: str | None):
    from glm5_fp4.spec import Glm5Spec

    if config:
        return Glm5Spec.from_config_json(config), f"{config}"
    if profile is not None and (Path(profile.model) / "config.json").is_file():
        return Glm5Spec.from_config_json(profile.model), f"{profile.model}/config.json"
    return Glm5Spec(), "built-in defaults = zai-org/GLM-5 config.json"


def build_plans(args: argparse.Namespace):
    from glm5_fp4.hardware import get_gpu
    from glm5_fp4.launch.plan import PlanInputs, make_plan
    from glm5_fp4.launch.profile import load_profile, resolve_profile

    if args.profile:
        args.profile = str(resolve_profile(args.profile))  # every message names the file read
    profile = load_profile(args.profile) if args.profile else None
    spec, spec_origin = _spec_for(profile, args.config)
    if profile is not None and args.layouts is None:  # its layout is planned: named by file and field if it can't run
        from glm5_fp4.launch.profile import check_fits_model

        check_fits_model(profile, args.profile, spec.num_attention_heads, spec.num_layers, spec_origin,
                         "--config" if args.config else None)
    gpu = get_gpu(args.gpu)
    engine = profile.engine if profile else "vllm"
    kv = args.kv_cache_dtype or (profile.kv_cache_dtype if profile else "auto")
    concurrency = args.concurrency if args.concurrency is not None else (profile.max_concurrency if profile else 512)
    if args.layouts is not None:
        layouts = [parse_layout(t) for t in args.layouts.split(",") if t.strip()]
        if not layouts:
            raise Glm5Fp4Error(f"--layouts {args.layouts!r} names no layout; e.g. tp8,tp4pp2,tp8ep8,dp8ep8")
    else:
        layouts = [profile_layout(profile)] if profile else []
    defaults = [] if args.layouts is not None else [parse_layout(t) for t in DEFAULT_LAYOUTS]
    defaults = [d for d in dict.fromkeys(defaults) if d not in layouts]
    expert_math = args.expert_math or (_weight_only_math(profile) if profile else None)
    from glm5_fp4.checkpoint.inspect import resolve_mlp_dtypes

    local = args.config or (profile.model if profile is not None and (Path(profile.model) / "config.json").is_file()
                            else None)
    experts, dense, dtypes_said = resolve_mlp_dtypes(local, args.expert_dtype, args.dense_dtype)
    def plan(layout):
        tp, pp, dp, ep, ep_comm = layout
        return make_plan(spec, gpu, PlanInputs(tp, pp, concurrency, args.context, engine, kv, args.mem_util,
                                               args.reserve_gib, args.efficiency, expert_math,
                                               args.allreduce_gbs, args.allreduce_latency_us, dp, ep,
                                               args.expert_skew, args.dispatch_dtype, ep_comm, dense, experts))

    def cannot_split(layout) -> str | None:
        """Why the model cannot be spread this way (heads, layers, experts), if it cannot; any other error of a plan
        (a --context past the model's longest, a KV dtype) is the flag's, whatever the layout."""
        from glm5_fp4.cost_model import Layout

        try:
            Layout(*layout).validate(spec)
        except Glm5Fp4Error as exc:
            return str(exc)
        return None

    plans = []
    for layout in dict.fromkeys(layouts):  # asked for: an error naming who asked if the model can't run it
        why = cannot_split(layout)
        if why:
            asker = f"--layouts {_layout_name(layout)}" if args.layouts is not None else f"{args.profile}: layout"
            raise Glm5Fp4Error(f"{asker}: {why}")
        plans.append(plan(layout))
    left_out = []
    for layout in defaults:  # shown beside it for comparison: left out, said, where the model can't run it
        why = cannot_split(layout)
        if why:
            left_out.append(f"{_layout_name(layout)} left out: {why}")
        else:
            plans.append(plan(layout))
    if not plans:
        raise Glm5Fp4Error(f"none of the default layouts ({', '.join(DEFAULT_LAYOUTS)}) can run {spec_origin}: "
                           + "; ".join(left_out) + "; pass --layouts (e.g. tp1)")
    for p in plans:
        p.assumptions[:0] = [dtypes_said, *left_out]
    return plans, spec_origin, profile


CATEGORY_LABELS = {
    "expert_gemm": "expert GEMM (routed)",
    "attention": "attention (MLA + DSA indexer)",
    "other_gemm": "other GEMM (projections, shared expert, dense MLP, router, lm_head)",
    "allreduce": "communication (all-reduce, all-to-all or all-gather + reduce-scatter, PP send/recv)",
}


def _names(plans, pick) -> list[str]:
    """Component names in model order, across every plan (stages differ: lm_head only on the last)."""
    return list(dict.fromkeys(c.name for p in plans for s in p.stages for c in s.components if pick(c)))


def _rows(plans) -> list[tuple[str, list[str]]]:
    from glm5_fp4.cost_model import CATEGORIES

    gb = 1e9
    rows: list[tuple[str, list[str]]] = [("Memory per GPU (GB = 1e9 B; heaviest stage)", [])]
    for name in _names(plans, lambda c: c.weights):
        rows.append((f"  {name}", [f"{p.heaviest.weights.get(name, 0.0) / gb:.2f}" for p in plans]))
    rows += [
        ("  weights total", [f"{p.heaviest.weights_total / gb:.2f}" for p in plans]),
        ("  usable for weights + KV", [f"{p.usable_bytes / gb:.2f}" for p in plans]),
        ("  KV bytes / token / GPU", [f"{p.heaviest.kv_bytes_per_token:,.0f}" for p in plans]),
        ("  KV capacity (tokens per GPU)", [f"{p.kv_capacity_tokens():,}" for p in plans]),
        ("  KV needed per GPU: its sequences x context", [f"{p.kv_tokens_needed:,}" for p in plans]),
        (f"  sequences that fit at context {plans[0].inputs.context} (all GPUs)",
         [f"{p.max_sequences():,}" for p in plans]),
        ("  fits (weights and KV)", ["yes" if p.fits() else ("NO: KV" if p.weights_fit() else "NO: weights")
                                     for p in plans]),
        (f"Decode step at concurrency {plans[0].inputs.concurrency} (ms; bottleneck stage x PP)", []),
    ]
    for cat in CATEGORIES:
        rows.append((f"  {CATEGORY_LABELS[cat]}", [f"{p.per_step(cat) * 1e3:.2f} {p.bottleneck.category(cat).bound[:3]}"
                                                    if cat != "allreduce" else f"{p.per_step(cat) * 1e3:.2f}"
                                                    for p in plans]))
        for name in _names(plans, lambda c, cat=cat: c.category == cat):
            rows.append((f"    {name}", [f"{p.component_per_step(name) * 1e3:.2f}" for p in plans]))
        if cat == "expert_gemm":
            rows.append(("    routed-expert bytes / GPU / step (GB)",
                         [f"{p.routed_expert_bytes_per_step / gb:.2f}" for p in plans]))
        elif cat == "attention":
            rows.append(("    latent KV + indexer keys read / GPU / step (GB)",
                         [f"{p.kv_read_bytes_per_step / gb:.2f}" for p in plans]))
        elif cat == "allreduce":
            rows.append(("    all-reduce calls per step x time per call (us)",
                         [f"{p.component_per_step('all-reduce', 'calls'):.0f} x {p.allreduce_one_s * 1e6:.0f}"
                          for p in plans]))
    rows += [
        ("  step time (TPOT floor)", [f"{p.step_s * 1e3:.2f}" for p in plans]),
        ("  output tokens/s (ceiling)", [f"{p.tokens_per_s:,.0f}" for p in plans]),
    ]
    return rows


def render(plans, spec_origin: str, profile, profile_path: str | None) -> str:
    gpu = plans[0].gpu
    head = (f"glm5-fp4 plan: {plans[0].spec.name} ({spec_origin}) on {gpu.display_name} ({gpu.name}); "
            f"{plans[0].inputs.engine}, kv_cache_dtype={plans[0].inputs.kv_cache_dtype}, "
            f"concurrency {plans[0].inputs.concurrency}, context {plans[0].inputs.context}")
    if profile_path:
        head += f"\nprofile: {profile_path} ({profile.layout}, cuda_graphs={profile.cuda_graphs}, "
        head += f"moe_backend={profile.moe_backend})"
    rows = _rows(plans)
    w0 = max(len(r[0]) for r in rows)
    widths = [max(len(p.layout), *(len(r[1][i]) for r in rows if r[1])) for i, p in enumerate(plans)]
    lines = [head, "", " " * w0 + "  " + "  ".join(f"{p.layout:>{w}}" for p, w in zip(plans, widths))]
    for label, cells in rows:
        lines.append(label if not cells else f"{label:<{w0}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    lines += ["", "mem/com: which roof bounds the stage (memory bandwidth or compute).", "Assumptions:"]
    seen = []
    for p in plans:
        for a in p.assumptions:
            if a not in seen:
                seen.append(a)
                lines.append(f"  - [{p.layout}] {a}" if sum(a in q.assumptions for q in plans) < len(plans)
                             else f"  - {a}")
    return "\n".join(lines)


def to_json(plans, spec_origin: str) -> dict:
    from glm5_fp4.cost_model import CATEGORIES

    out = {"model": spec_origin, "gpu": plans[0].gpu.name, "layouts": {}}
    for p in plans:
        out["layouts"][p.layout] = {
            "tp": p.inputs.tp, "pp": p.inputs.pp, "dp": p.inputs.dp, "ep": p.inputs.ep,
            "concurrency": p.inputs.concurrency, "context": p.inputs.context, "expert_skew": p.inputs.expert_skew,
            "micro_batch": p.micro_batch, "kv_kind": p.kv_kind,
            "weights_bytes_per_gpu": p.heaviest.weights, "weights_total_bytes": p.heaviest.weights_total,
            "usable_bytes": p.usable_bytes, "kv_bytes_per_token_per_gpu": p.heaviest.kv_bytes_per_token,
            "kv_capacity_tokens": p.kv_capacity_tokens(), "kv_tokens_needed": p.kv_tokens_needed,
            "max_sequences": p.max_sequences(), "ep_comm": p.inputs.ep_comm,
            "weights_fit": p.weights_fit(), "fits": p.fits(),
            # per profiler category (the categories `profile analyze` measures), bottleneck stage x PP
            "step_ms": {**{cat: p.per_step(cat) * 1e3 for cat in CATEGORIES}, "total": p.step_s * 1e3},
            "components_ms": {c.name: p.component_per_step(c.name) * 1e3 for c in p.bottleneck.components
                              if c.category},
            "routed_expert_bytes_per_step": p.routed_expert_bytes_per_step,
            "kv_read_bytes_per_step": p.kv_read_bytes_per_step,
            "allreduce_calls_per_step": p.component_per_step("all-reduce", "calls"),
            "tokens_per_s": p.tokens_per_s,
            "assumptions": p.assumptions,
        }
    return out


def run(args: argparse.Namespace) -> int:
    plans, spec_origin, profile = build_plans(args)
    if args.json:
        print(json.dumps(to_json(plans, spec_origin), indent=2))
    else:
        print(render(plans, spec_origin, profile, args.profile))
    return 0
