"""Validate an NVFP4 checkpoint (real or tiny) from its config and safetensors headers, and summarise it.

Only headers are read, so a 440 GB checkpoint is inspected in seconds. The files are the ones
``model.safetensors.index.json`` names (each must exist and hold what the index says), else every
``*.safetensors``. Every tensor the config implies (``checkpoint.layout``: embeddings, every layer's norms,
attention, router and MLP or experts, the shared experts, the final norm, lm_head) must be there: the
quantized linears as NVFP4 (U8 codes, F8_E4M3 block scales, F32 global scale; an F32 input scale is
optional) unless excluded, the rest in a float dtype, all with the config's shapes. Missing tensors are
reported together, by component and layer; otherwise the first problem raises one :class:`Glm5Fp4Error`
naming the file, the tensor and what was expected.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from glm5_fp4.checkpoint.configs import check_config, check_tokenizer_fits
from glm5_fp4.checkpoint.tokenizer import tokenizer_id_count
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.inputs import read_json
from glm5_fp4.nvfp4 import BLOCK_SIZE, shape_matches

RECIPE_TEXT = {"glm5": "dense MLPs, shared and routed experts NVFP4",
               "routed-only": "only routed experts NVFP4; dense MLPs and shared experts BF16"}
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "BF16": 2, "F16": 2, "I16": 2, "U16": 2,
                "F32": 4, "I32": 4, "U32": 4, "I64": 8, "U64": 8, "F64": 8}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")  # a tensor's decoder layer
_LINEAR_RE = re.compile(
    r"^model\.layers\.(?P<layer>\d+)\.mlp\.(?:(?:experts\.(?P<expert>\d+)|(?P<shared>shared_experts))\.)?"
    r"(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


@dataclass
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    file: str
    # where the data starts in the file (bytes from its start), so a scalar can be read without loading the file
    offset: int = 0

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * DTYPE_BYTES.get(self.dtype, 0)


@dataclass
class CheckpointReport:
    path: Path
    architecture: str
    model_type: str
    num_layers: int
    moe_layers: list[int]
    routed_experts: int
    quant_algo: str | None
    group_size: int | None
    quantized_linears: int
    # Which make-checkpoint recipe the exclude list describes (checkpoint.layout.RECIPES; None: not NVFP4 or
    # neither recipe, e.g. a hand-made list)
    recipe: str | None = None
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    tensors: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_dtype.values())

    def to_dict(self) -> dict:
        return {
            "path": str(self.path), "architecture": self.architecture, "model_type": self.model_type,
            "num_layers": self.num_layers, "moe_layers": len(self.moe_layers), "routed_experts": self.routed_experts,
            "quant_algo": self.quant_algo, "group_size": self.group_size, "quantized_linears": self.quantized_linears,
            "recipe": self.recipe, "tensors": self.tensors, "bytes_by_dtype": self.bytes_by_dtype, "total_bytes": self.total_bytes,
            "notes": self.notes,
        }

    def to_text(self) -> str:
        names = {"U8": "NVFP4 codes (U8)", "F8_E4M3": "FP8 E4M3 (block scales)", "BF16": "BF16", "F32": "FP32"}
        lines = [
            f"checkpoint   {self.path}",
            f"architecture {self.architecture} (model_type {self.model_type})",
            f"layers       {self.num_layers} ({len(self.moe_layers)} MoE, {self.num_layers - len(self.moe_layers)} dense)",
            f"experts      {self.routed_experts} routed per MoE layer",
            f"quantization {self.quant_algo or 'none'}"
            + (f", group size {self.group_size}, {self.quantized_linears} NVFP4 linears" if self.quant_algo else "")
            + (f" (recipe {self.recipe}: {RECIPE_TEXT[self.recipe]})" if self.recipe else ""),
            f"tensors      {self.tensors}",
            "bytes by precision:",
        ]
        for dtype, n in sorted(self.bytes_by_dtype.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {names.get(dtype, dtype):<26} {_human(n):>10}  {100 * n / max(self.total_bytes, 1):5.1f} %")
        lines.append(f"  {'total':<26} {_human(self.total_bytes):>10}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    if not path.is_file():
        raise Glm5Fp4Error(f"{path}: not a regular file (a directory?), so not a safetensors file")
    try:
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise Glm5Fp4Error(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw_len)
            if n > 100 * 1024**2:
                raise Glm5Fp4Error(f"{path}: not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise Glm5Fp4Error(f"{path}: corrupt safetensors header") from None
    except OSError as exc:
        raise Glm5Fp4Error(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not isinstance(header, dict):
        raise Glm5Fp4Error(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        # safe_open refuses it ("expected a string") once the engine loads the file
        raise Glm5Fp4Error(f"{path}: header __metadata__ is {meta!r:.80}, expected an object of string values")
    size = path.stat().st_size
    out = {}
    ranges = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = meta["data_offsets"]
            dtype, shape = meta["dtype"], tuple(meta["shape"])
            if not all(isinstance(v, int) and v >= 0 for v in (begin, end, *shape)) or not isinstance(dtype, str):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise Glm5Fp4Error(f"{path}: corrupt safetensors header entry for tensor {name}") from None
        if dtype not in DTYPE_BYTES:
            raise Glm5Fp4Error(f"{path}: tensor {name} has dtype {dtype!r}, not one an NVFP4 checkpoint's loader "
                               f"reads ({', '.join(DTYPE_BYTES)})")
        if 8 + n + end > size:
            raise Glm5Fp4Error(f"{path}: tensor {name} extends past the end of the file (truncated download?)")
        want = math.prod(shape) * DTYPE_BYTES[dtype]
        if end - begin != want:
            raise Glm5Fp4Error(f"{path}: tensor {name} ({dtype} {list(shape)}, {want} bytes) holds {end - begin} bytes "
                               f"(data_offsets {begin}..{end}): a corrupt header")
        ranges.append((begin, end, name))
        out[name] = TensorInfo(dtype, shape, path.name, 8 + n + begin)
    # safetensors (and so the engine's loader) wants the data to be the tensors, back to back, and nothing more
    ranges.sort()
    at = 0
    for begin, end, name in ranges:
        if begin != at:
            raise Glm5Fp4Error(f"{path}: tensor {name} starts at byte {begin} of the data, not {at}: tensors overlap or "
                               "leave a hole (a corrupt header)")
        at = end
    if 8 + n + at != size:
        raise Glm5Fp4Error(f"{path}: {size - 8 - n - at} bytes past its last tensor (a resumed or concatenated "
                           "download?): the loader refuses such a file")
    return out


INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("BF16", "F16", "F32")


def read_tensor_index(ckpt: Path, notes: list[str] | None = None) -> dict[str, TensorInfo]:
    """Every tensor's header, from the files the index names (else all ``*.safetensors``)."""
    index_path = ckpt / INDEX_FILE
    if not index_path.is_file():
        files = sorted(ckpt.glob("*.safetensors"))
        if not files:
            raise Glm5Fp4Error(f"{ckpt}: no *.safetensors files")
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            for name, info in read_safetensors_header(f).items():
                # Without an index nothing says which copy a loader takes: refuse rather than pick one.
                if name in tensors:
                    raise Glm5Fp4Error(f"{ckpt}: tensor {name} is in both {tensors[name].file} and {f.name} "
                                       f"(a leftover shard? remove one, or add {INDEX_FILE})")
                tensors[name] = info
        return tensors
    doc = read_json(index_path, "safetensors index")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise Glm5Fp4Error(f"{index_path}: not a safetensors index (no 'weight_map' object)")
    bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise Glm5Fp4Error(f"{index_path}: weight_map[{bad[0]!r}] is {bad[1]!r}, expected a file name")
    # the loaders look for the index's files in the checkpoint's folder (vLLM: "referenced in index but missing")
    bad = next(((k, v) for k, v in weight_map.items() if v in ("", ".", "..") or Path(v).name != v), None)
    if bad is not None:
        raise Glm5Fp4Error(f"{index_path}: weight_map[{bad[0]!r}] is {bad[1]!r}, expected a file name in the folder "
                           "(no path)")
    headers = {}
    for fname in sorted(set(weight_map.values())):
        if not (ckpt / fname).is_file():
            n = sum(1 for v in weight_map.values() if v == fname)
            raise Glm5Fp4Error(f"{ckpt}: {INDEX_FILE} names {fname}, which is missing ({n} tensors)")
        headers[fname] = read_safetensors_header(ckpt / fname)
    tensors = {}
    for name, fname in weight_map.items():
        info = headers[fname].get(name)
        if info is None:
            raise Glm5Fp4Error(f"{ckpt}: {INDEX_FILE} puts tensor {name} in {fname}, which does not hold it")
        tensors[name] = info
    # The loaders read every tensor of every indexed file, listed or not: a second copy of a listed tensor is
    # loaded too (which one wins is the loader's order), an unlisted one is a tensor like any other.
    unlisted = []
    for fname, header in headers.items():
        for name, info in header.items():
            if weight_map.get(name) == fname:
                continue
            if name in weight_map:
                raise Glm5Fp4Error(f"{ckpt}: tensor {name} is in {fname} as well as in {weight_map[name]}, where "
                                   f"{INDEX_FILE} puts it; the loader reads both files: remove one copy")
            if name in tensors:
                raise Glm5Fp4Error(f"{ckpt}: tensor {name}, which {INDEX_FILE} does not list, is in both "
                                   f"{tensors[name].file} and {fname}; the loader reads both: remove one copy")
            tensors[name] = info
            unlisted.append(f"{name} ({fname})")
    if unlisted and notes is not None:
        notes.append(f"{len(unlisted)} tensor(s) not listed in {INDEX_FILE} but in the files it names (the engines "
                     f"load them all the same): {', '.join(unlisted[:5])}" + (" ..." if len(unlisted) > 5 else ""))
    stray = sorted(p.name for p in ckpt.glob("*.safetensors") if p.name not in headers)
    if stray and notes is not None:
        notes.append(f"not in {INDEX_FILE}, so not read: {', '.join(stray)}")
    return tensors


def _component(name: str) -> str:
    for needle, what in ((".self_attn.", "attention"), ("layernorm", "norms"), (".mlp.gate.", "router"),
                         (".mlp.shared_experts.", "shared experts"), (".mlp.experts.", "routed experts"),
                         (".mlp.", "dense MLP"), ("embed_tokens", "embeddings"), ("lm_head", "lm_head")):
        if needle in name:
            return what
    return "norms" if name.endswith("norm.weight") else "other"


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v != start else f"{v}")
            start = None
    return ", ".join(out)


def expected_tensors(config: dict, nvfp4: bool, excluded: list[str]) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """name -> (allowed dtypes, shape) of every tensor the config implies; input scales are optional."""
    from glm5_fp4.checkpoint.layout import model_tensors

    out = {}
    for spec in model_tensors(config):
        base = spec.name.removesuffix(".weight")
        if spec.quantized and nvfp4 and not _excluded(base, excluded):
            rows, cols = spec.shape
            out[spec.name] = (("U8",), (rows, cols // 2))
            out[f"{base}.weight_scale"] = (("F8_E4M3",), (rows, cols // BLOCK_SIZE))
            out[f"{base}.weight_scale_2"] = (("F32",), ())
        else:
            out[spec.name] = (FLOAT_DTYPES, spec.shape)
    return out


def _check_complete(ckpt: Path, cfg_path: Path, config: dict, tensors: dict[str, TensorInfo], nvfp4: bool,
                    excluded: list[str]) -> dict:
    try:
        expected = expected_tensors(config, nvfp4, excluded)
    except KeyError as exc:
        raise Glm5Fp4Error(f"{cfg_path}: field {exc} missing: it says which tensors the checkpoint holds") from None
    missing = [name for name in expected if name not in tensors]
    if missing:
        parts = Counter(_component(n) for n in missing)
        layers = sorted({int(m[1]) for n in missing if (m := _LAYER_RE.match(n))})
        where = f"; layers {_ranges(layers)}" if layers else ""
        raise Glm5Fp4Error(
            f"{ckpt}: missing {len(missing):,} of {len(expected):,} tensors the config implies "
            f"({', '.join(f'{what} {n:,}' for what, n in parts.most_common())}{where}), "
            f"e.g. {', '.join(missing[:4])}")
    for name, (dtypes, shape) in expected.items():
        info = tensors[name]
        if info.dtype not in dtypes or not shape_matches(info.shape, shape):
            want = dtypes[0] if len(dtypes) == 1 else (info.dtype if info.dtype in dtypes else
                                                      f"a float ({'/'.join(dtypes)})")
            raise Glm5Fp4Error(f"{ckpt / info.file}: tensor {name} is {info.dtype} {list(info.shape)}, "
                               f"expected {want} {list(shape)}")
    return expected


def _dense_attention_view(config: dict) -> bool:
    """make-checkpoint --dense-attention: GLM-5's weights (its DSA indexer's too) under a config without the indexer."""
    return config.get("model_type") == "deepseek_v3" and config.get("architectures") == ["GlmMoeDsaForCausalLM"]


_OPTIONAL_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".q_scale", ".kv_scale")  # activation / KV-cache scales


def _unaccounted(config: dict, tensors: dict[str, TensorInfo], expected: dict) -> list[str]:
    """Tensors no part of the config implies; the MTP layers past num_hidden_layers and activation / KV scales are
    the checkpoint's to carry (engines skip or read them on their own)."""
    layers = config["num_hidden_layers"]
    mtp = layers + int(config.get("num_nextn_predict_layers") or 0)
    dense_view = _dense_attention_view(config)
    out = []
    for name in tensors:
        if name in expected or name.endswith(_OPTIONAL_SUFFIXES) or (dense_view and ".self_attn.indexer." in name):
            continue
        m = _LAYER_RE.match(name)
        if m and layers <= int(m[1]) < mtp:
            continue
        out.append(name)
    return out


def _check_input_scales(ckpt: Path, tensors: dict[str, TensorInfo], expected: dict) -> None:
    """Every NVFP4 linear's input_scale, or none: W4A4 needs all of them (the engines refuse a partial set only after
    loading every weight)."""
    bases = [n.removesuffix(".weight_scale_2") for n in expected if n.endswith(".weight_scale_2")]
    without = [b for b in bases if f"{b}.input_scale" not in tensors]
    if without and len(without) < len(bases):
        raise Glm5Fp4Error(f"{ckpt}: {len(bases) - len(without)} of {len(bases)} NVFP4 linears carry an input_scale, "
                           f"{len(without)} do not (e.g. {without[0]}): all or none (W4A4 needs every one)")


def read_quant_config(ckpt: Path, config: dict, config_path: Path | None = None
                      ) -> tuple[str | None, int | None, list[str]]:
    """(quant_algo, group_size, exclude_modules) from config.json's quantization_config, else hf_quant_config.json
    (vLLM's order; ``config_path``: the file ``config`` came from, for messages; default ckpt/config.json). Where both
    say something they must agree: engines differ in which they read first."""
    cfg_where = f"{config_path or ckpt / 'config.json'}: quantization_config"
    q = config.get("quantization_config")
    from_cfg = _quant_fields(q, cfg_where, "ignore", "exclude_modules") if q else None
    if from_cfg is not None and (from_cfg[0] or "").upper() == "NVFP4":
        method = q.get("quant_method")
        if not (isinstance(method, str) and method.lower().startswith("modelopt")):
            # vLLM and SGLang read ModelOpt's NVFP4 only under quant_method modelopt*; any other is taken as the
            # method itself (fp8: the FP8 loader on NVFP4 bytes), none is an unknown method
            raise Glm5Fp4Error(f"{cfg_where}.quant_method is {method!r}, expected 'modelopt' (or 'modelopt_fp4') for "
                               "quant_algo NVFP4: the engines read NVFP4 checkpoints only under ModelOpt's method")
    hf = ckpt / "hf_quant_config.json"
    if not hf.exists():
        return from_cfg or (None, None, [])
    doc = read_json(hf, "quantizer config")
    if not isinstance(doc, dict):
        raise Glm5Fp4Error(f"{hf}: expected a JSON object, got {type(doc).__name__}")
    from_hf = _quant_fields(doc.get("quantization", {}), f"{hf}: quantization", "exclude_modules")
    if from_cfg is None:
        return from_hf
    differ = [f"{name} {a!r} / {b!r}" for name, a, b in (
        ("quant_algo", (from_cfg[0] or "").upper(), (from_hf[0] or "").upper()),
        ("group_size", from_cfg[1], from_hf[1])) if a != b]
    only = sorted(set(from_cfg[2]) ^ set(from_hf[2]))
    if only:
        differ.append(f"exclude list ({len(only)} entr{'y' if len(only) == 1 else 'ies'} in one only, e.g. {only[0]!r})")
    if differ:
        raise Glm5Fp4Error(f"{cfg_where} and {hf} disagree: {'; '.join(differ)} (config.json / hf_quant_config.json); "
                           "engines differ in which they read first: make them agree")
    return from_cfg


def _quant_fields(q: object, where: str, *exclude_keys: str) -> tuple[str | None, int | None, list[str]]:
    """(quant_algo, group_size, excluded modules) of a quantization block, each checked for its type."""
    if not isinstance(q, dict):
        raise Glm5Fp4Error(f"{where} is {q!r}, expected an object")
    algo, group = q.get("quant_algo"), q.get("group_size")
    if algo is not None and not isinstance(algo, str):
        raise Glm5Fp4Error(f"{where}.quant_algo is {algo!r}, expected a name such as 'NVFP4'")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int)):
        raise Glm5Fp4Error(f"{where}.group_size is {group!r}, expected an integer")
    key = next((k for k in exclude_keys if k in q), exclude_keys[-1])
    excluded = q.get(key, [])
    if not isinstance(excluded, list) or not all(isinstance(m, str) for m in excluded):
        raise Glm5Fp4Error(f"{where}.{key} is {excluded!r}, expected a list of module names")
    return algo, group, list(excluded)


# quant_algo -> the dtype (the cost model's name) of the linears it quantizes; the ones it excludes stay BF16
QUANT_DTYPES = {"NVFP4": "nvfp4", "FP8": "fp8"}


def mlp_weight_dtypes(path: str | Path) -> tuple[dict[str, str | None], str] | None:
    """The storage dtype of each MLP class (``checkpoint.layout.MLP_CLASSES``) of a checkpoint, from its
    quantization config, and the file that says so; a class is None where the config does not settle it (partly
    excluded, or a quant_algo not in :data:`QUANT_DTYPES`). None: no quantization config (or no quant_algo) at
    all. ``path``: the checkpoint directory or its config.json."""
    from glm5_fp4.checkpoint.layout import quantized_mlps

    from glm5_fp4.spec import read_config_json

    cfg_path, config = read_config_json(path)
    ckpt = cfg_path.parent
    quant_algo, _, excluded = read_quant_config(ckpt, config, cfg_path)
    if not quant_algo:
        return None
    dtype = QUANT_DTYPES.get(quant_algo.upper())
    source = ckpt / "hf_quant_config.json" if (ckpt / "hf_quant_config.json").exists() else cfg_path
    try:
        quantized = quantized_mlps(config, excluded)
    except KeyError as exc:
        raise Glm5Fp4Error(f"{cfg_path}: field {exc} missing (not a GLM-5-family MoE config)") from None
    dtypes = {c: None if q is None else dtype if q else "bf16" for c, q in quantized.items()}
    return dtypes, f"{source}, quant_algo {quant_algo}"


def _excluded(module: str, patterns: list[str]) -> bool:
    from glm5_fp4.checkpoint.layout import is_excluded

    return is_excluded(module, patterns)


def _recipe(config: dict, excluded: list[str]) -> str | None:
    from glm5_fp4.checkpoint.layout import recipe_of

    return recipe_of(config, excluded)


def _expected_linear_shape(config: dict, m: re.Match) -> tuple[int, int]:
    """(out, in) of an MLP projection named by the regex match."""
    h = config["hidden_size"]
    if m["expert"] is not None:
        inter = config["moe_intermediate_size"]
    elif m["shared"]:
        inter = config["moe_intermediate_size"] * config.get("n_shared_experts", 1)
    else:
        inter = config["intermediate_size"]
    return (h, inter) if m["proj"] == "down_proj" else (inter, h)


def _check(info: TensorInfo | None, name: str, dtype: str, shape: tuple[int, ...], ckpt: Path) -> None:
    if info is None:
        raise Glm5Fp4Error(f"{ckpt}: tensor {name} is missing (expected {dtype} {list(shape)})")
    if info.dtype != dtype or not shape_matches(info.shape, shape):
        raise Glm5Fp4Error(
            f"{ckpt / info.file}: tensor {name} is {info.dtype} {list(info.shape)}, expected {dtype} {list(shape)}"
        )


def _check_scalar_scales(ckpt: Path, tensors: dict[str, TensorInfo], names: list[str]) -> None:
    """Each global / input scale must be a positive finite number: the engines load 0 (the linear's weights all
    read as zero), a negative (its sign flipped) or NaN without a word. They are 4 bytes each (GLM-5: ~60,000), so
    reading them costs one seek each, in file order."""
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(tensors[name].file, []).append(name)
    for fname, group in sorted(by_file.items()):
        path = ckpt / fname
        try:
            with path.open("rb") as f:
                for name in sorted(group, key=lambda nm: tensors[nm].offset):
                    f.seek(tensors[name].offset)
                    (value,) = struct.unpack("<f", f.read(4))
                    if not (math.isfinite(value) and value > 0):
                        raise Glm5Fp4Error(f"{path}: tensor {name} is {value}, expected a positive finite scale "
                                           "(a broken export? the engines would load it as is)")
        except OSError as exc:
            raise Glm5Fp4Error(f"{path}: cannot read ({exc.strerror or exc})") from None


def inspect_checkpoint(path: str | Path, require_nvfp4: bool = False) -> CheckpointReport:
    ckpt = Path(path)
    cfg_path = ckpt / "config.json"
    if not cfg_path.exists():
        raise Glm5Fp4Error(f"{ckpt}: no config.json (is this a Hugging Face checkpoint directory?)")
    config = read_json(cfg_path, "config.json")
    check_config(config, str(cfg_path))
    tok_path = ckpt / "tokenizer.json"
    if tok_path.is_file():
        try:
            ids = tokenizer_id_count(tok_path)
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError) as exc:
            raise Glm5Fp4Error(f"{tok_path}: not a tokenizer.json ({exc})") from None
        check_tokenizer_fits(config["vocab_size"], ids, f"{cfg_path} with {tok_path.name}")
    quant_algo, group_size, excluded = read_quant_config(ckpt, config)
    if require_nvfp4 and (quant_algo or "").upper() != "NVFP4":
        raise Glm5Fp4Error(f"{ckpt}: not an NVFP4 checkpoint (quant_algo={quant_algo!r}; expected 'NVFP4')")
    if quant_algo and (quant_algo.upper() == "NVFP4") and group_size not in (None, BLOCK_SIZE):
        raise Glm5Fp4Error(f"{ckpt}: NVFP4 group_size {group_size}, expected {BLOCK_SIZE}")
    nvfp4 = (quant_algo or "").upper() == "NVFP4"

    notes: list[str] = []
    tensors = read_tensor_index(ckpt, notes)
    expected = _check_complete(ckpt, cfg_path, config, tensors, nvfp4, excluded)
    _check_input_scales(ckpt, tensors, expected)
    extra = _unaccounted(config, tensors, expected)
    if extra:
        notes.append(f"WARNING: {len(extra)} tensor(s) the config does not account for (an engine's loader may refuse "
                     f"them once loading has begun): {', '.join(extra[:5])}" + (" ..." if len(extra) > 5 else ""))
    layers = config["num_hidden_layers"]
    first_dense = config.get("first_k_dense_replace", 0)
    moe_layers = [i for i in range(layers) if i >= first_dense]
    n_experts = config["n_routed_experts"]

    quantized = 0
    scalars: list[str] = []  # the global and input scales, checked by value once their shapes are known
    seen_experts: Counter = Counter()
    for name, info in tensors.items():
        m = _LINEAR_RE.match(name)
        if not m or int(m["layer"]) >= layers:
            continue
        if m["expert"] is not None:
            if int(m["expert"]) >= n_experts:
                raise Glm5Fp4Error(f"{ckpt / info.file}: tensor {name}: expert index >= n_routed_experts={n_experts}")
            seen_experts[int(m["layer"])] += 1
        out_f, in_f = _expected_linear_shape(config, m)
        base = name[: -len(".weight")]
        is_fp4 = nvfp4 and not _excluded(base, excluded) and f"{base}.weight_scale" in tensors
        if nvfp4 and not _excluded(base, excluded) and not is_fp4:
            raise Glm5Fp4Error(f"{ckpt / info.file}: tensor {base}.weight_scale is missing "
                               f"(NVFP4 linear {base} needs F8_E4M3 [{out_f}, {in_f // BLOCK_SIZE}])")
        if is_fp4:
            _check(info, name, "U8", (out_f, in_f // 2), ckpt)
            _check(tensors.get(f"{base}.weight_scale"), f"{base}.weight_scale", "F8_E4M3", (out_f, in_f // BLOCK_SIZE), ckpt)
            _check(tensors.get(f"{base}.weight_scale_2"), f"{base}.weight_scale_2", "F32", (), ckpt)
            scalars.append(f"{base}.weight_scale_2")
            if f"{base}.input_scale" in tensors:
                _check(tensors[f"{base}.input_scale"], f"{base}.input_scale", "F32", (), ckpt)
                scalars.append(f"{base}.input_scale")
            quantized += 1
        elif info.shape != (out_f, in_f):
            raise Glm5Fp4Error(f"{ckpt / info.file}: tensor {name} is {info.dtype} {list(info.shape)}, "
                               f"expected [{out_f}, {in_f}]")
    _check_scalar_scales(ckpt, tensors, scalars)
    if require_nvfp4 and not quantized:
        raise Glm5Fp4Error(f"{ckpt}: no NVFP4 linear (quant_algo NVFP4, but exclude_modules {excluded!r} leaves every "
                           "linear unquantized, or no linear carries its weight_scale)")
    for layer in moe_layers:
        if seen_experts[layer] != 3 * n_experts:
            raise Glm5Fp4Error(f"{ckpt}: layer {layer} has {seen_experts[layer] // 3 if seen_experts[layer] else 0} "
                               f"complete experts' projections ({seen_experts[layer]} tensors), "
                               f"expected {n_experts} experts x 3 projections")
    by_dtype: Counter = Counter()
    for info in tensors.values():
        by_dtype[info.dtype] += info.nbytes
    report = CheckpointReport(
        path=ckpt, architecture=(config.get("architectures") or ["?"])[0], model_type=config.get("model_type", "?"),
        num_layers=layers, moe_layers=moe_layers, routed_experts=n_experts, quant_algo=quant_algo,
        group_size=group_size, quantized_linears=quantized, recipe=_recipe(config, excluded) if nvfp4 else None,
        bytes_by_dtype=dict(by_dtype), tensors=len(tensors),
        notes=notes,
    )
    if _dense_attention_view(config):
        report.notes.append("dense-attention view of GLM-5: the DSA indexer is not used (exact up to index_topk tokens)")
    return report


def resolve_mlp_dtypes(config: str | Path | None, expert_dtype: str | None = None, dense_dtype: str | None = None
                       ) -> tuple[str, str | None, str]:
    """The MLP weight dtypes a cost-model run uses (``profile analyze`` ceilings, ``plan``): each from its flag
    (``expert_dtype`` / ``dense_dtype``), else the ``config`` checkpoint's quantization config, else the default
    (nvfp4; shared experts and dense MLPs as the routed experts); and a line saying which. ``dense`` is None
    when it follows the routed experts."""
    found = mlp_weight_dtypes(config) if config else None
    ckpt, source = found or ({}, "")
    dense_classes = {ckpt[c] for c in ("shared experts", "dense MLPs") if c in ckpt}
    ckpt_dense = next(iter(dense_classes)) if len(dense_classes) == 1 else None
    unknown = ("no --config checkpoint to read" if not config else f"{config}: no quantization config"
               if found is None else f"{source} does not settle it")
    expert = expert_dtype or ckpt.get("routed experts") or "nvfp4"
    dense = dense_dtype or ckpt_dense

    def origin(flag: str, flagged: str | None, read: str | None) -> str | None:
        return f"--{flag}" if flagged else f"from {source}" if read else None

    o_expert = origin("expert-dtype", expert_dtype, ckpt.get("routed experts"))
    o_dense = origin("dense-dtype", dense_dtype, ckpt_dense)
    if o_expert is None and o_dense is None:
        line = (f"weight dtypes: the defaults ({unknown}): routed experts {expert}, shared experts and dense MLPs as "
                "them; --expert-dtype / --dense-dtype set them")
    elif o_expert == o_dense:
        line = f"weight dtypes ({o_expert}): routed experts {expert}; shared experts and dense MLPs {dense}"
    else:
        line = (f"weight dtypes: routed experts {expert} ({o_expert or f'default: {unknown}'}); shared experts and "
                f"dense MLPs {dense or expert} ({o_dense or f'as the routed experts: {unknown}'})")
    return expert, dense, line
