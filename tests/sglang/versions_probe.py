"""Run by tests/sglang/test_sglang_versions.py in a fresh interpreter whose ``sglang`` is the version under test.

The plugin is loaded the way a scheduler process loads it (``load_plugins()``, limited to ours), the server
arguments are parsed by that version's ServerArgs and published, the MoE layer gets its parameters from that
version's ``ModelOptNvFp4FusedMoEMethod.create_weights`` and its runner from ``create_moe_runner``; the hooked
``apply`` runs on CPU tensors. Prints one JSON line of findings; the test compares them with independent
references. Each step reports instead of stopping the probe (``attempt``), so one failure does not hide the rest.

Usage: ``python tests/sglang/versions_probe.py MODEL_DIR [CASES_JSON]`` (PYTHONPATH chooses the SGLang). CASES_JSON
maps a name to a server argv; each is parsed with this version's ServerArgs and a few resolved fields reported.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback

os.environ["SGLANG_PLUGINS"] = "glm5_fp4"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from glm5_fp4.reference import moe_reference  # noqa: E402
from glm5_fp4.tolerances import rel_error  # noqa: E402
from nvfp4_moe_case import E, H, I, K, dispatch, inputs, make_layer  # noqa: E402 - beside this script

OUT: dict = {"errors": {}}
# What SGLang's server processes import; on a CPU machine some of these stop at a CUDA-only package.
SERVER_MODULES = ("sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
                  "sglang.srt.managers.tokenizer_manager", "sglang.srt.model_executor.model_runner",
                  "sglang.srt.models.glm4_moe", "sglang.srt.models.deepseek_v2",
                  "sglang.srt.layers.moe.fused_moe_triton.layer", "sglang.srt.layers.moe.moe_runner.marlin")


def attempt(key, fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - recorded, the test names it
        OUT["errors"][key] = f"{type(exc).__name__}: {exc}"[:600] + "\n" + traceback.format_exc()[-1500:]
        return None


def imports() -> None:
    def one(name):
        try:
            importlib.import_module(name)
            return "ok"
        except BaseException as exc:  # noqa: BLE001 - SystemExit/RuntimeError from CUDA-only code are facts too
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    OUT["imports"] = {name: one(name) for name in SERVER_MODULES}


def publish(args) -> None:
    """What a scheduler process does before building the model: publish the args, initialise the MoE flags."""
    from sglang.srt.layers.moe import utils

    try:
        from sglang.srt.runtime_context import publish as publish_ctx  # 0.5.23
    except ImportError:
        publish_ctx = None
    if publish_ctx is not None:
        publish_ctx(args, role="scheduler")
        utils.initialize_moe_config()
    else:  # 0.5.15
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(args)
        utils.initialize_moe_config(args)


def _cpu_swizzle() -> None:
    """0.5.15's ``create_weights`` swizzles the (still empty) block scales with ``.cuda()``; our hooks drop
    those copies unread. On this CPU machine the copy stays on the CPU (0.5.23's swizzle never leaves it)."""
    from sglang.srt.layers.quantization import modelopt_quant

    original = modelopt_quant.swizzle_blockscale

    def swizzle(scale):
        try:
            return original(scale)
        except RuntimeError as exc:
            if "NVIDIA driver" not in str(exc):
                raise
            OUT["swizzle_needed_cuda"] = True
            return scale.clone()
    modelopt_quant.swizzle_blockscale = swizzle


def layer_checks() -> None:
    from glm5_fp4.engines.sglang.runner import Glm5Fp4RunnerCore

    os.environ["GLM5_FP4_BACKEND"] = "reference"
    experts, x, logits, weights, ids = inputs(1)
    method, layer = make_layer(experts)
    core = method.runner.runner_core
    OUT["runner"] = {"core": type(core).__name__, "is_ours": isinstance(core, Glm5Fp4RunnerCore),
                     "backend_value": core.runner_backend.value, "fused_func": method.runner.fused_func is not None,
                     "attributes": sorted(vars(method.runner))}
    method.process_weights_after_loading(layer)
    out = method.apply(layer, dispatch(x, weights, ids, logits))
    OUT["apply"] = {"combine_type": type(out).__name__, "shape": list(out.hidden_states.shape),
                    "backend": layer._glm5_fp4.backend.name,
                    "equals_reference": bool(torch.equal(out.hidden_states, moe_reference(x, weights, ids, experts)))}
    dropped = ids.clone()
    dropped[::3, 1] = -1
    kept = weights.clone()
    kept[::3, 1] = 0.0
    got = method.apply(layer, dispatch(x, weights, dropped, logits)).hidden_states
    OUT["apply"]["dropped_slots_equal_reference"] = bool(torch.equal(got, moe_reference(x, kept, ids, experts)))
    os.environ["GLM5_FP4_BACKEND"] = "dequant"
    method2, layer2 = make_layer(experts)
    method2.process_weights_after_loading(layer2)
    got = method2.apply(layer2, dispatch(x, weights, ids, logits)).hidden_states
    OUT["apply"]["dequant_rel_error"] = rel_error(got, moe_reference(x, weights, ids, experts))
    os.environ["GLM5_FP4_BACKEND"] = "reference"


def builtin_runner_attributes() -> None:
    """The attributes SGLang's own MoeRunner sets for a built-in core (what our 0.5.15 stand-in must set)."""
    from sglang.srt.layers.moe.moe_runner import MoeRunner
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    cfg = MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=H, intermediate_size_per_partition=I,
                          layer_id=0, top_k=K, params_dtype=torch.bfloat16)
    OUT["builtin_runner_attributes"] = sorted(vars(MoeRunner(MoeRunnerBackend.TRITON, cfg)))


def other_backend_reaches_sglang() -> None:
    """With another backend cached on the method, the hooks call SGLang's own code, not ours."""
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    from glm5_fp4 import backends

    experts, x, logits, weights, ids = inputs(4)
    method, layer = make_layer(experts)
    method.process_weights_after_loading(layer)
    calls = []
    real = backends.Backend.forward
    backends.Backend.forward = lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
    method._moe_runner_backend = MoeRunnerBackend.TRITON
    try:
        method.apply(layer, dispatch(x, weights, ids, logits))
        raised = None
    except Exception as exc:  # noqa: BLE001 - SGLang's own apply has no CPU path for these
        raised = type(exc).__name__
        frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
    finally:
        backends.Backend.forward = real
    OUT["other_backend"] = {"raised": raised, "our_backend_called": bool(calls),
                            "sglang_apply_frame": raised is not None and frames.count("apply") >= 1}


def init_attributes() -> None:
    """Our __init__ stand-in sets exactly what the original sets on a platform it accepts (Blackwell-like)."""
    from sglang.srt.layers.quantization import modelopt_quant
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod as M

    from glm5_fp4.engines.sglang.hooks import init_without_platform_check

    qc = ModelOptFp4Config(is_checkpoint_nvfp4_serialized=True, group_size=16, exclude_modules=[])
    ours = object.__new__(M)
    init_without_platform_check(ours, qc)
    saved = {n: getattr(modelopt_quant, n) for n in ("get_platform", "is_blackwell_supported") if hasattr(modelopt_quant, n)}
    import types

    if "get_platform" in saved:
        modelopt_quant.get_platform = lambda: types.SimpleNamespace(is_blackwell=True)
    if "is_blackwell_supported" in saved:
        modelopt_quant.is_blackwell_supported = lambda: True
    try:
        original = object.__new__(M)
        M.__init__.__wrapped__(original, qc)
    finally:
        for n, v in saved.items():
            setattr(modelopt_quant, n, v)
    refused = None
    try:
        M.__init__.__wrapped__(object.__new__(M), qc)
    except ValueError as exc:
        refused = str(exc)
    OUT["init"] = {"ours": sorted(vars(ours)), "original": sorted(vars(original)),
                   "equal": {k: repr(v) for k, v in vars(ours).items()} == {k: repr(v) for k, v in vars(original).items()},
                   "hooked_equals_original": sorted(vars(M(qc))) == sorted(vars(original)),
                   "original_refuses_cpu": refused}


def a2a_refusal() -> None:
    from sglang.srt.layers.moe import utils
    from sglang.srt.layers.moe.utils import MoeA2ABackend

    from glm5_fp4.errors import Glm5Fp4Error

    method, layer = make_layer(inputs(8)[0])
    if hasattr(utils, "MOE_A2A_BACKEND"):  # 0.5.15: module globals
        saved, utils.MOE_A2A_BACKEND = utils.MOE_A2A_BACKEND, MoeA2ABackend.DEEPEP
        restore = lambda: setattr(utils, "MOE_A2A_BACKEND", saved)  # noqa: E731
    else:  # 0.5.23: the published flags
        from sglang.srt.runtime_context import get_flags

        saved, get_flags().moe.a2a_backend = get_flags().moe.a2a_backend, MoeA2ABackend.DEEPEP
        restore = lambda: setattr(get_flags().moe, "a2a_backend", saved)  # noqa: E731
    try:
        method.process_weights_after_loading(layer)
        OUT["a2a_refusal"] = None
    except Glm5Fp4Error as exc:
        OUT["a2a_refusal"] = str(exc)
    finally:
        restore()


def parser_choices() -> None:
    import argparse

    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    choices = {a.dest: list(a.choices) for a in p._actions if a.choices}
    OUT["choices"] = {k: choices.get(k) for k in ("moe_runner_backend", "kv_cache_dtype", "quantization",
                                                  "attention_backend", "sampling_backend", "grammar_backend",
                                                  "cuda_graph_backend_decode", "cuda_graph_backend_prefill",
                                                  "fp4_gemm_runner_backend")}
    OUT["options"] = sorted(o for a in p._actions for o in a.option_strings)


def protocol_fields() -> None:
    """The request fields the H200 scripts send: /generate (greedy, teacher-forced logprobs), /start_profile."""
    import dataclasses

    from sglang.srt.managers import io_struct

    def fields(cls):
        if dataclasses.is_dataclass(cls):
            return sorted(f.name for f in dataclasses.fields(cls))
        return sorted(getattr(cls, "__struct_fields__", ()) or getattr(cls, "__annotations__", {}))
    OUT["protocol"] = {"GenerateReqInput": fields(io_struct.GenerateReqInput), "ProfileReq": fields(io_struct.ProfileReq)}


def timer_targets() -> None:
    import pkgutil

    from glm5_fp4.engines.layer_timers import SGLANG_MODEL_RUNNER

    OUT["timer_targets"] = {m: callable(pkgutil.resolve_name(f"{SGLANG_MODEL_RUNNER}.{m}")) for m in ("load_model", "forward")}


def parse_cases(path: str) -> None:
    """Each case through this version's own parser (``ServerArgs.add_cli_args``: every flag and choice checked),
    and through ``prepare_server_args`` (ServerArgs' own resolution; 0.5.15's needs an accelerator, so on this
    machine it is reported, with ``--device cpu`` added, rather than required)."""
    import argparse

    from sglang.srt.server_args import ServerArgs, prepare_server_args

    keys = ("model_path", "host", "port", "tp_size", "pp_size", "dp_size", "enable_dp_attention", "ep_size",
            "enable_dp_lm_head", "moe_dense_tp_size", "quantization", "moe_runner_backend",
            "disable_shared_experts_fusion", "kv_cache_dtype", "max_running_requests", "cuda_graph_max_bs_decode",
            "cuda_graph_backend_decode", "cuda_graph_backend_prefill", "attention_backend", "sampling_backend",
            "grammar_backend", "mem_fraction_static", "context_length", "moe_a2a_backend", "random_seed",
            "fp4_gemm_runner_backend", "skip_server_warmup", "disable_radix_cache", "attn_dp_size",
            "dsa_prefill_backend", "dsa_decode_backend", "cuda_graph_bs_decode", "cuda_graph_bs_prefill")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = {}
    for name, argv in json.load(open(path)).items():
        try:
            ns = parser.parse_args(list(argv))
            parsed[name] = {k: getattr(ns, k, "<missing>") for k in keys}
        except SystemExit as exc:
            parsed[name] = {"error": f"SystemExit {exc.code}"}
            continue
        try:
            extra = [] if "--device" in argv else ["--device", "cpu"]
            sa = prepare_server_args(list(argv) + extra)
            parsed[name]["resolved"] = {k: getattr(sa, k, "<missing>") for k in keys}
        except BaseException as exc:  # noqa: BLE001 - reported: the resolution is the GPU's to do
            parsed[name]["resolved"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    OUT["cases"] = parsed


def exclusions(path: str) -> None:
    """A checkpoint's quantization config (JSON: the config.json ``quantization_config`` and the
    hf_quant_config.json forms, and prefixes) through this version's ``ModelOptFp4Config.from_config``: which
    prefixes its own ``is_layer_excluded`` keeps unquantized (the routed-only recipe's exclude list, read by SGLang)."""
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config

    spec = json.load(open(path))
    OUT["exclusions"] = {}
    for form in ("flat", "nested"):
        qc = ModelOptFp4Config.from_config(spec[form])
        OUT["exclusions"][form] = {p: bool(qc.is_layer_excluded(p)) for p in spec["prefixes"]}


def main() -> None:
    model = sys.argv[1]
    import sglang

    OUT["version"] = sglang.__version__
    OUT["sglang_file"] = sglang.__file__
    import transformers

    OUT["transformers"] = transformers.__version__
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.plugins.hook_registry import HookRegistry

    from glm5_fp4.engines.sglang import compat

    OUT["registry"] = compat.has_runner_core_registry()
    OUT["hooked"] = sorted(HookRegistry._patched)
    if len(sys.argv) > 2:  # before publish: parsing runs ServerArgs' own resolution for each case
        attempt("cases", lambda: parse_cases(sys.argv[2]))
    attempt("choices", parser_choices)

    def resolve():
        from sglang.srt.layers.moe.utils import get_moe_runner_backend, get_speculative_moe_runner_backend
        from sglang.srt.server_args import prepare_server_args

        args = prepare_server_args(["--model-path", model, "--moe-runner-backend", "glm5_fp4", "--device", "cpu"])
        publish(args)
        b, s = get_moe_runner_backend(), get_speculative_moe_runner_backend()
        OUT["resolved"] = {"backend": b.value, "type": type(b).__name__, "speculative": s.value}
    attempt("resolve", resolve)
    _cpu_swizzle()
    attempt("layer", layer_checks)
    attempt("builtin_runner", builtin_runner_attributes)
    attempt("other_backend", other_backend_reaches_sglang)
    attempt("init", init_attributes)
    attempt("a2a", a2a_refusal)
    attempt("protocol", protocol_fields)
    attempt("timers", timer_targets)
    if os.environ.get("GLM5_FP4_PROBE_EXCLUSIONS"):
        attempt("exclusions", lambda: exclusions(os.environ["GLM5_FP4_PROBE_EXCLUSIONS"]))
    imports()  # last: a failing import can leave half-initialised modules behind
    print(json.dumps(OUT, default=str))


if __name__ == "__main__":
    main()
