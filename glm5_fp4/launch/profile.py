"""A launch profile: one YAML file that says how to serve GLM-5 (engine, parallelism, CUDA graphs, MoE backend).

Example (``launch/tp8.yaml``)::

    engine: vllm                # vllm | sglang
    model: /models/GLM-5-NVFP4
    tensor_parallel: 8
    pipeline_parallel: 1
    data_parallel: 1            # >1: data-parallel attention (each GPU its own sequences; launch/dp8ep8.yaml)
    expert_parallel: false      # true: whole experts split over all the GPUs of a stage (tpNepN, dpNepN)
    cuda_graphs: full           # piecewise | full | off  (what each means per engine: commands.py)
    moe_backend: glm5_fp4       # ours, or any stock name of the engine
    kv_cache_dtype: auto
    max_concurrency: 512        # max running requests and the largest decode CUDA-graph batch
    host: 127.0.0.1
    glm5_fp4: {backend: auto, mode: auto}   # our backend's options (ignored for stock backends)
    extra_args: []              # appended verbatim; or {vllm: [...], sglang: [...]}
    env: {}                     # added to the server's environment (wins over generated variables; not
                                # GLM5_FP4_BACKEND/MODE: the glm5_fp4 field sets those for both engines)

Loading validates every field; the first problem becomes one :class:`Glm5Fp4Error` that names the file, the
field and the allowed values. Command-line overrides (``--engine`` ...) are validated the same way and the
error names the flag instead of the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, StrictInt, field_validator

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.inputs import UniqueKeyLoader
from glm5_fp4.launch.engine_choices import (
    DEFAULT_PORTS,
    ENGINES,
    KV_CACHE_DTYPES,
    MOE_BACKENDS,
    OURS,
    STOCK_QUANTIZATION,
    VLLM_OURS_QUANTIZATION,
)
from glm5_fp4.settings import BACKEND_CHOICES, MODE_CHOICES

CUDA_GRAPH_MODES = ("piecewise", "full", "off")
Engine = Literal["vllm", "sglang"]
OUR_BACKENDS, OUR_MODES = BACKEND_CHOICES, MODE_CHOICES
# variable -> the glm5_fp4 option the profile's glm5_fp4 field sets it from (env may not set them)
OUR_ENV = {"GLM5_FP4_BACKEND": "backend", "GLM5_FP4_MODE": "mode"}
# Quantization method per engine: None picks the right one for the MoE backend (see engine_choices).
QUANTIZATIONS = {"vllm": ("glm5_nvfp4", "modelopt_fp4", "none"), "sglang": ("modelopt_fp4", "none")}


class OurOptions(BaseModel):
    """Options of the glm5_fp4 MoE backend: which implementation and which activation precision."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    backend: Literal[BACKEND_CHOICES] = "auto"
    mode: Literal[MODE_CHOICES] = "auto"


def _scalar_to_str(value: object) -> object:
    """YAML turns `1`, `true`, `0.5` into numbers and booleans; command lines and environments want strings."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float)):
        return str(value)
    return value


class LaunchProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Engine = "vllm"
    model: str = Field(min_length=1)
    description: str = ""
    # (upper bounds: beyond any one host's or cluster's GPUs, or any engine's running-request limit: typos)
    # strict: YAML's `true` was --tensor-parallel-size 1, `port: on` --port 1, "8" and 8.0 passed as 8
    tensor_parallel: StrictInt = Field(default=1, ge=1, le=1024)
    pipeline_parallel: StrictInt = Field(default=1, ge=1, le=1024)
    data_parallel: StrictInt = Field(default=1, ge=1, le=1024)
    expert_parallel: bool = False
    cuda_graphs: Literal["piecewise", "full", "off"] = "full"
    moe_backend: str = OURS
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    glm5_fp4: OurOptions = Field(default_factory=OurOptions)
    max_concurrency: StrictInt = Field(default=512, ge=1, le=1 << 20)
    host: str = "127.0.0.1"
    port: StrictInt | None = Field(default=None, ge=1, le=65535)
    extra_args: list[str] | dict[Engine, list[str]] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("cuda_graphs", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        # YAML 1.1 reads a bare `off` as False (and `on` as True); PyYAML follows it.
        if value is False:
            return "off"
        if value is True:
            raise ValueError("`on`/`true` is ambiguous; allowed: " + ", ".join(CUDA_GRAPH_MODES))
        return value

    @field_validator("moe_backend")
    @classmethod
    def _known_moe_backend(cls, value: str, info: ValidationInfo) -> str:
        engine = info.data.get("engine")
        if engine is not None and value not in MOE_BACKENDS[engine]:
            raise ValueError(f"{value!r} is not a MoE backend of {engine}; allowed: {', '.join(MOE_BACKENDS[engine])}")
        return value

    @field_validator("quantization")
    @classmethod
    def _known_quantization(cls, value: str | None, info: ValidationInfo) -> str | None:
        engine, backend = info.data.get("engine"), info.data.get("moe_backend")
        if value is None or engine is None:
            return value
        if value not in QUANTIZATIONS[engine]:
            raise ValueError(f"{value!r} is not a quantization this tool launches {engine} with; allowed: "
                             f"{', '.join(QUANTIZATIONS[engine])} (or leave it out to follow moe_backend)")
        if engine == "vllm" and backend is not None and (backend == OURS) != (value == "glm5_nvfp4"):
            raise ValueError(f"{value!r} does not go with moe_backend {backend!r} on vLLM: glm5_nvfp4 is what "
                             f"selects moe_backend {OURS}, stock backends run under modelopt_fp4 (or leave it out)")
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _known_kv_dtype(cls, value: str, info: ValidationInfo) -> str:
        engine = info.data.get("engine")
        if engine is not None and value not in KV_CACHE_DTYPES[engine]:
            raise ValueError(f"{value!r} is not a KV-cache dtype of {engine}; allowed: "
                             f"{', '.join(KV_CACHE_DTYPES[engine])}")
        return value

    @field_validator("extra_args", mode="before")
    @classmethod
    def _args_as_strings(cls, value: object) -> object:
        shape = "a list of strings, or {vllm: [...], sglang: [...]}"
        if isinstance(value, list):
            return [_scalar_to_str(v) for v in value]
        if isinstance(value, dict):
            unknown = [k for k in value if k not in ENGINES]
            if unknown:
                raise ValueError(f"unknown engine key(s) {unknown}; allowed: {', '.join(ENGINES)}")
            if not all(isinstance(vs, list) or vs is None for vs in value.values()):
                raise ValueError(f"must be {shape}")
            return {k: [_scalar_to_str(v) for v in (vs or [])] for k, vs in value.items()}
        raise ValueError(f"must be {shape}")

    @field_validator("env", mode="before")
    @classmethod
    def _env_as_strings(cls, value: object) -> object:
        if isinstance(value, dict):
            return {str(k): _scalar_to_str(v) for k, v in value.items()}
        return value

    @field_validator("env")
    @classmethod
    def _env_startable(cls, value: dict[str, str]) -> dict[str, str]:
        for key, text in value.items():
            # what execve cannot pass (Popen would raise in the middle of `serve`, after --dry-run said fine)
            if not key or "=" in key or "\0" in key:
                raise ValueError(f"{key!r} is not a variable name (it must be non-empty, without '=' or NUL)")
            if "\0" in text:
                raise ValueError(f"{key!r}: the value contains a NUL byte")
            # vLLM reads these from --additional-config, which the glm5_fp4 field writes, SGLang from the
            # environment: set here they would make the same profile run a different backend on each engine
            if key in OUR_ENV:
                raise ValueError(f"{key} is our backend's option {OUR_ENV[key]!r}: set it as glm5_fp4: "
                                 f"{{{OUR_ENV[key]}: ...}} in the profile (both engines get it from there)")
        return value

    # -- derived ------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    @property
    def stage_gpus(self) -> int:
        """GPUs of one pipeline stage: the attention's TP group times its data-parallel replicas (the MoE's group)."""
        return self.tensor_parallel * self.data_parallel

    @property
    def ep_size(self) -> int:
        """Experts are split whole over this many GPUs (1: no expert parallelism)."""
        return self.stage_gpus if self.expert_parallel else 1

    @property
    def uses_ours(self) -> bool:
        return self.moe_backend == OURS

    @property
    def effective_quantization(self) -> str:
        """The ``--quantization`` the engine gets: ours needs the plugin's name on vLLM; otherwise ModelOpt's."""
        if self.quantization is not None:
            return self.quantization
        if self.engine == "vllm" and self.uses_ours:
            return VLLM_OURS_QUANTIZATION
        return STOCK_QUANTIZATION

    @property
    def effective_port(self) -> int:
        return self.port if self.port is not None else DEFAULT_PORTS[self.engine]

    @property
    def layout(self) -> str:
        """``TP8``, ``TP4+PP2``, ``TP8+EP8``, ``DP8+EP8`` (``DP2xTP4+EP8``: attention TP4 in each of 2 replicas)."""
        dp, tp = self.data_parallel, self.tensor_parallel
        head = (f"DP{dp}" + (f"xTP{tp}" if tp > 1 else "")) if dp > 1 else f"TP{tp}"
        head += f"+EP{self.ep_size}" if self.expert_parallel else ""
        return head + (f"+PP{self.pipeline_parallel}" if self.pipeline_parallel > 1 else "")

    def engine_extra_args(self) -> list[str]:
        if isinstance(self.extra_args, dict):
            return list(self.extra_args.get(self.engine, []))
        return list(self.extra_args)


FIELDS = tuple(LaunchProfile.model_fields)


def _format_error(exc: ValidationError, origin: str, flags: dict[str, str]) -> str:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    if loc and loc[0] in ("extra_args", "env"):
        loc = loc[:1]  # pydantic adds union-member names (list[str], dict[...]) that mean nothing to users
    field = loc[0] if loc else "?"
    where = f"{flags[field]} (field {field!r})" if field in flags else f"{origin}: field {'.'.join(loc)!r}"
    if err["type"] == "extra_forbidden":
        return f"{origin}: unknown field {field!r}; allowed fields: {', '.join(FIELDS)}"
    if err["type"] == "missing":
        return f"{origin}: field {field!r} is required"
    msg = err["msg"].removeprefix("Value error, ")
    if field == "cuda_graphs" and err["type"] == "literal_error":
        msg = f"{err.get('input')!r} is not allowed; allowed: {', '.join(CUDA_GRAPH_MODES)}"
    elif field == "engine" and err["type"] == "literal_error":
        msg = f"{err.get('input')!r} is not allowed; allowed: {', '.join(ENGINES)}"
    elif "input" in err and err["type"] not in ("literal_error", "value_error"):
        msg = f"{msg} (got {err['input']!r})"
    return f"{where}: {msg}"


def profile_from_dict(data: object, origin: str = "profile", overrides: dict | None = None,
                      override_flags: dict[str, str] | None = None) -> LaunchProfile:
    """Validate ``data`` (plus command-line ``overrides``, None values ignored) into a :class:`LaunchProfile`.

    ``override_flags`` maps a field to the flag that set it, so an error names ``--moe-backend`` rather than
    the file when the bad value came from the command line.
    """
    if not isinstance(data, dict):
        raise Glm5Fp4Error(f"{origin}: expected a mapping of fields ({', '.join(FIELDS)}), got {type(data).__name__}")
    odd = [k for k in data if not isinstance(k, str)]
    if odd:  # YAML reads a bare number, yes/no, on/off or null as a number, a boolean or None
        raise Glm5Fp4Error(f"{origin}: key {odd[0]!r} is not a field name (quote it if it is one); fields: "
                           f"{', '.join(FIELDS)}")
    written_for = data.get("engine", "vllm")
    wanted = (overrides or {}).get("engine")
    if wanted is not None and wanted != written_for and isinstance(data.get("extra_args"), list) and data["extra_args"]:
        # engine flags are not the other engine's (SGLang's parser refuses vLLM's --max-model-len)
        raise Glm5Fp4Error(f"{origin}: extra_args is one list, written for {written_for}; --engine {wanted} would pass "
                           f"it to {wanted}: give it per engine ({{vllm: [...], sglang: [...]}})")
    merged = dict(data)
    flags = {}
    for key, value in (overrides or {}).items():
        if value is not None:
            # a mapping override (glm5_fp4 options) changes only the keys it names
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                value = {**merged[key], **value}
            merged[key] = value
            if override_flags and key in override_flags:
                flags[key] = override_flags[key]
    try:
        return LaunchProfile(**merged)
    except ValidationError as exc:
        raise Glm5Fp4Error(_format_error(exc, origin, flags)) from None


PACKAGED = Path(__file__).resolve().parents[1] / "data" / "launch"


def packaged_profiles() -> list[str]:
    return sorted(p.stem for p in PACKAGED.glob("*.yaml"))


def resolve_profile(path: str | Path) -> Path:
    """The file ``--profile`` names: an existing file as given; else a packaged profile named by itself (``tp8``,
    ``tp8.yaml``) or by the checkout's path to it (``launch/tp8.yaml``), which a plain install has no folder for."""
    given = Path(path)
    if given.exists() or given.parent not in (Path("."), Path("launch")):
        return given
    packaged = PACKAGED / (given.name if given.suffix in (".yaml", ".yml") else f"{given.name}.yaml")
    return packaged if packaged.is_file() else given


def load_profile(path: str | Path, overrides: dict | None = None,
                 override_flags: dict[str, str] | None = None) -> LaunchProfile:
    """Read and validate a YAML launch profile (``path`` as :func:`resolve_profile` reads it)."""
    path = resolve_profile(path)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except FileNotFoundError:
        raise Glm5Fp4Error(f"{path}: launch profile not found; the packaged ones, by name: "
                           f"{', '.join(packaged_profiles())}") from None
    except IsADirectoryError:
        raise Glm5Fp4Error(f"{path}: is a directory, expected a YAML launch profile") from None
    except yaml.YAMLError as exc:
        raise Glm5Fp4Error(f"{path}: not valid YAML ({exc})") from None
    except UnicodeDecodeError as exc:
        raise Glm5Fp4Error(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise Glm5Fp4Error(f"{path}: cannot read ({exc.strerror or exc})") from None
    if data is None:
        raise Glm5Fp4Error(f"{path}: empty launch profile (needs at least 'model:')")
    return profile_from_dict(data, str(path), overrides, override_flags)


def model_dims(model: str) -> tuple[int | None, int | None, str]:
    """(attention heads, layers, where they come from) of the model a profile serves: a local checkpoint's
    config.json, else GLM-5's own dimensions (a hub id is not read here). None where the config does not say."""
    from glm5_fp4.spec import Glm5Spec, read_config_json

    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        file, config = read_config_json(path)
        config = config if isinstance(config, dict) else {}
        dims = [config.get(k) for k in ("num_attention_heads", "num_hidden_layers")]
        heads, layers = (v if type(v) is int and v > 0 else None for v in dims)
        return heads, layers, str(file)
    spec = Glm5Spec()
    return spec.num_attention_heads, spec.num_layers, f"GLM-5's built-in dimensions; {model} is not a local folder"


def check_fits_model(profile: LaunchProfile, origin: str, heads: int | None, layers: int | None, said: str,
                     model_flag: str | None = None) -> None:
    """What both engines refuse only once their workers are up (vLLM's check that the tensor-parallel size divides
    the attention heads; a pipeline stage without a layer), said before anything starts. ``model_flag``: the flag
    that chose the model, when not the profile."""
    via = f" (the model given by {model_flag})" if model_flag else ""
    if heads and heads % profile.tensor_parallel:
        raise Glm5Fp4Error(f"{origin}: field 'tensor_parallel' {profile.tensor_parallel} does not divide the model's "
                           f"{heads} attention heads{via} ({said}); the engines refuse it at start-up")
    if layers and profile.pipeline_parallel > layers:
        raise Glm5Fp4Error(f"{origin}: field 'pipeline_parallel' {profile.pipeline_parallel} is more stages than the "
                           f"model's {layers} layers{via} ({said})")
