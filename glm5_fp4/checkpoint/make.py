"""Write random-weight GLM-5-family checkpoints in the ModelOpt NVFP4 layout of nvidia/GLM-5-NVFP4.

What is NVFP4 follows NVIDIA's checkpoints, by ``recipe`` (``checkpoint.layout``: ``exclude_modules`` is the rule's
one home): ``glm5`` (nvidia/GLM-5-NVFP4) dense MLPs, routed experts and shared experts; ``routed-only``
(GLM-5.1/5.2-NVFP4) routed experts only. Attention (and the DSA indexer), the router, embeddings and lm_head stay
BF16 in both. Each quantized
linear has ``weight`` (uint8 [out, in/2]), ``weight_scale`` (float8_e4m3fn [out, in/16]),
``weight_scale_2`` (float32 scalar) and ``input_scale`` (float32 scalar); gate and up projections share
``weight_scale_2`` as ModelOpt exports them for fusion.

Every tensor is drawn from a generator seeded by (seed, tensor name), so the output depends only on the
arguments. ``dequantized=True`` writes the BF16 twin: each NVFP4 weight replaced by its dequantized value
(e2m1 x block scale x global scale computed in float32, rounded once to BF16), no quantization config.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from tqdm import tqdm

from glm5_fp4 import nvfp4
from glm5_fp4.checkpoint.configs import build_config, check_tokenizer_fits, dense_attention_view
from glm5_fp4.checkpoint.layout import RECIPES, TensorSpec, exclude_modules, model_tensors
from glm5_fp4.checkpoint.tokenizer import MIN_VOCAB_SIZE, save_tokenizer
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.outputs import output_dir, plain_file_mode

MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.42.0 (layout); written by glm5-fp4"}
SHARD_BYTES = 2 * 1024**3
# Static activation scales (amax / (6*448)) for the random model: RMS-normed inputs and SwiGLU products of
# unit-variance projections stay well inside these amax values, so W4A4 emulation does not saturate.
_INPUT_AMAX = {"gate_proj": 8.0, "up_proj": 8.0, "down_proj": 12.0}


def _draw(spec: TensorSpec, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(spec.name.encode())) % 2**63)
    x = torch.randn(spec.shape, generator=g, device=device)
    if spec.kind == "norm":
        return 1.0 + 0.1 * x
    if spec.kind == "bias":
        return 0.1 * x
    if spec.kind == "embed":
        return x
    # Fan-in scaling keeps activations near unit variance through the random network, so logits are
    # peaked enough that greedy decoding is not decided by rounding noise.
    return x / spec.shape[-1] ** 0.5


def _projection(name: str) -> str:
    return name.rsplit(".", 2)[-2]


def _quantized_group(specs: list[TensorSpec], seed: int, dequantized: bool, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Quantize one MLP's gate/up/down (on ``device``); gate and up share weight_scale_2. Returns CPU tensors."""
    weights = {s.name: _draw(s, seed, device) for s in specs}
    gate = next(n for n in weights if _projection(n) == "gate_proj")
    up = next(n for n in weights if _projection(n) == "up_proj")
    shared_gs = torch.maximum(nvfp4.weight_global_scale(weights[gate]), nvfp4.weight_global_scale(weights[up]))
    out = {}
    for name, w in weights.items():
        gs = shared_gs if name in (gate, up) else None
        packed, scale, global_scale = nvfp4.quantize(w, gs)
        if dequantized:
            out[name] = nvfp4.dequantize(packed, scale, global_scale, torch.bfloat16).cpu()
            continue
        base = name[: -len(".weight")]
        out[name] = packed.cpu()
        out[f"{base}.weight_scale"] = scale.cpu()
        out[f"{base}.weight_scale_2"] = global_scale.reshape(()).cpu()
        out[f"{base}.input_scale"] = torch.tensor(_INPUT_AMAX[_projection(name)] / (6 * 448), dtype=torch.float32)
    return out


def generate_tensors(cfg: dict, seed: int, dequantized: bool, specs: list[TensorSpec], device: str = "cpu"):
    """Yield ``(name, CPU tensor)`` in checkpoint order; quantized MLPs are handled a projection triple at a time."""
    pending: list[TensorSpec] = []
    for spec in specs:
        if spec.quantized:
            pending.append(spec)
            if len(pending) == 3:
                yield from _quantized_group(pending, seed, dequantized, device).items()
                pending = []
            continue
        t = _draw(spec, seed, device)
        # The router's correction bias is kept in float32 as DeepSeek-V3-style checkpoints do.
        yield spec.name, (t.float() if spec.name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)).cpu()


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_safetensors(tensors, out_dir: Path, total: int, shard_bytes: int = SHARD_BYTES) -> None:
    """Write tensors as one ``model.safetensors`` or as shards with an index, keeping memory to one shard."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    files: list[str] = []
    weight_map: dict[str, str] = {}

    def flush(final: bool) -> None:
        idx = len(files) + 1
        fname = "model.safetensors" if final and idx == 1 else f"model-{idx:05d}.safetensors"
        save_file(shards[-1], str(out_dir / fname), metadata={"format": "pt"})
        plain_file_mode(out_dir / fname)  # safetensors writes through a private (0600) temporary file
        files.append(fname)
        weight_map.update({k: fname for k in shards[-1]})
        shards[-1] = {}
        sizes[-1] = 0

    for name, t in tqdm(tensors, total=total, desc="tensors", unit="t", leave=False, disable=total < 2000):
        if sizes[-1] and sizes[-1] + _tensor_bytes(t) > shard_bytes:
            flush(final=False)
        shards[-1][name] = t.contiguous()
        sizes[-1] += _tensor_bytes(t)
    flush(final=True)
    if len(files) > 1:
        # Rename to the usual "-of-N" form so loaders that glob either spelling find them.
        n = len(files)
        renamed = {}
        for i, f in enumerate(files, 1):
            new = f"model-{i:05d}-of-{n:05d}.safetensors"
            (out_dir / f).rename(out_dir / new)
            renamed[f] = new
        weight_map = {k: renamed[v] for k, v in weight_map.items()}
        total_size = sum((out_dir / f).stat().st_size for f in renamed.values())
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=1)
        )


def make_checkpoint(
    out_dir: str | Path,
    arch: str = "glm5",
    seed: int = 0,
    dequantized: bool = False,
    dense_attention: bool = False,
    sizes: dict | None = None,
    overwrite: bool = False,
    device: str = "cpu",
    recipe: str = "glm5",
) -> Path:
    """Write a tiny (or any-size) random checkpoint; returns its directory.

    ``dense_attention`` writes the dense-attention view of a glm5 checkpoint (same tensors, config without the
    DSA indexer) — what vLLM's CPU backend serves. ``device``: where tensors are drawn and quantized (CUDA's
    generator draws other values than the CPU's; GLM-5's true sizes take seconds on a GPU). Every argument is checked before anything is written, and a
    failure while writing removes the directories this call created, so bad input leaves nothing behind.
    """
    out = output_dir(out_dir, create=False)
    if out.is_dir() and any(f for f in out.iterdir() if not _is_scratch(f)) and not overwrite:
        raise Glm5Fp4Error(f"{out}: directory exists and is not empty (pass --overwrite to replace its files)")
    if dense_attention and arch != "glm5":
        raise Glm5Fp4Error("--dense-attention applies to --arch glm5 only")
    if recipe not in RECIPES:
        raise Glm5Fp4Error(f"--recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:
        raise Glm5Fp4Error(f"--device {device!r} is not usable here: {str(exc).splitlines()[0]}") from None
    cfg = build_config(arch, sizes)
    check_tokenizer_fits(cfg["vocab_size"], MIN_VOCAB_SIZE, "--size")
    _check_room(cfg, out, device, dequantized, recipe)
    created = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)  # the topmost new one
    output_dir(out)
    for f in out.iterdir():  # an earlier run's, killed before it could clean up: no one's data
        if _is_scratch(f):
            shutil.rmtree(f, ignore_errors=True)
    # Written whole into a scratch directory inside ``out`` (the same file system, even where ``out`` is a mount
    # point), then moved in: a failed write (a full disk) leaves ``out`` as it was, never the new config beside the
    # old weights (which `inspect` would then pass).
    try:
        tmp = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=out))
    except OSError as exc:
        raise Glm5Fp4Error(f"{out}: cannot write there ({exc.strerror or exc})") from None
    try:
        try:
            _write(tmp, cfg, seed, dequantized, dense_attention, device, recipe)
        except (OSError, SafetensorError) as exc:
            raise Glm5Fp4Error(f"{out}: cannot write the checkpoint ({getattr(exc, 'strerror', None) or exc}); "
                               "nothing of it was written there") from None
        try:
            _move_in(tmp, out)
        except OSError as exc:
            culprit = exc.filename or exc.filename2 or "a file"
            state = ("it is as it was" if getattr(exc, "restored", False) else
                     "its earlier files could not all be put back: it now holds part of each checkpoint (the rest of "
                     f"the earlier one is in {out}/{SCRATCH_PREFIX}*)")
            raise Glm5Fp4Error(f"{out}: cannot move the new checkpoint's files in: {culprit}: "
                               f"{exc.strerror or exc}; {state}") from None
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_room(cfg: dict, out: Path, device: str, dequantized: bool = False, recipe: str = "glm5") -> None:
    """Refuse sizes this machine cannot hold before anything is drawn: the largest tensor (drawn in float32) against
    the memory of ``device``, the checkpoint as it will be written (NVFP4 where the recipe quantizes, BF16 else)
    against the free space where ``out`` is. Without it a size typed wrong was an allocator's traceback after
    minutes of work."""
    import math

    from glm5_fp4.checkpoint.inspect import DTYPE_BYTES, expected_tensors

    written = expected_tensors(cfg, not dequantized, exclude_modules(cfg, recipe)).values()
    largest = max((t.shape for t in model_tensors(cfg)), key=math.prod)  # as drawn, before quantizing
    drawn = 4 * math.prod(largest)
    total = sum(DTYPE_BYTES[dtypes[0]] * math.prod(shape) for dtypes, shape in written)
    if str(device).startswith("cuda"):
        memory, where = torch.cuda.get_device_properties(torch.device(device)).total_memory, f"--device {device}"
    else:
        memory, where = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine's memory"
    gib = 1024**3
    sizes = ", ".join(f"{k} {cfg[k]:,}" for k in ("vocab_size", "hidden_size", "moe_intermediate_size",
                                                     "intermediate_size") if k in cfg)
    if drawn > memory:
        raise Glm5Fp4Error(f"--size: a tensor of {list(largest)} needs {drawn / gib:,.1f} GiB while drawn, past "
                           f"{where} ({memory / gib:,.1f} GiB); sizes {sizes}")
    probe = next((p for p in [out, *out.parents] if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free
    if total > free:
        raise Glm5Fp4Error(f"--size: the checkpoint needs up to {total / gib:,.1f} GiB, {probe} has {free / gib:,.1f} "
                           f"GiB free; sizes {sizes}")


SCRATCH_PREFIX = ".make-checkpoint-"


def _is_scratch(path: Path) -> bool:
    """The scratch directory of a make_checkpoint run inside its ``out`` (tempfile.mkdtemp's name)."""
    return path.name.startswith(SCRATCH_PREFIX) and path.is_dir() and not path.is_symlink()


def _move_in(tmp: Path, out: Path) -> None:
    """The finished checkpoint's files from ``tmp`` into ``out`` (renames within one file system); weight shards, an
    index or a quantizer config of an earlier checkpoint there that this one does not have are removed, since a
    loader would read them as part of it (a BF16 twin written over an NVFP4 checkpoint would still read as NVFP4).

    All or nothing: the earlier files are first moved aside, and if any rename fails (a file another user owns, an
    immutable one) the new files go back out and the earlier ones back in, so ``out`` is as it was (a mix of two
    checkpoints is one an engine loads and inspect passes). Raises OSError naming the file; ``restored`` on it says
    whether ``out`` could be put back."""
    new = sorted(f.name for f in tmp.iterdir())
    aside = [old.name for old in out.iterdir() if old.is_file() and (old.name in new or (
        old.name.endswith(".safetensors") or old.name in ("model.safetensors.index.json", "hf_quant_config.json")))]
    backup = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=out))
    moved: list[str] = []
    placed: list[str] = []
    try:
        for name in aside:
            os.replace(out / name, backup / name)
            moved.append(name)
        for name in new:
            os.replace(tmp / name, out / name)
            placed.append(name)
    except OSError as exc:
        restored = True
        for src, dst, names in ((out, tmp, placed), (backup, out, moved)):
            for name in names:
                try:
                    os.replace(src / name, dst / name)
                except OSError:
                    restored = False
        exc.restored = restored
        if not restored:
            backup = None  # what could not be put back stays there, named in the error
        raise
    finally:
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)


def _write(out: Path, cfg: dict, seed: int, dequantized: bool, dense_attention: bool, device: str = "cpu",
           recipe: str = "glm5") -> None:
    eos = save_tokenizer(out, cfg["vocab_size"], seed)
    cfg["eos_token_id"] = cfg["pad_token_id"] = eos
    excluded = exclude_modules(cfg, recipe)
    written_cfg = dense_attention_view(cfg) if dense_attention else dict(cfg)
    if not dequantized:
        quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": excluded}
        (out / "hf_quant_config.json").write_text(
            json.dumps({"producer": MODELOPT_PRODUCER, "quantization": quant}, indent=2)
        )
        written_cfg["quantization_config"] = {
            "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
            "kv_cache_scheme": None, "ignore": excluded, "producer": MODELOPT_PRODUCER,
        }
    (out / "config.json").write_text(json.dumps(written_cfg, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "pad_token_id": eos, "do_sample": False}, indent=2)
    )
    # Excluded MLPs are plain BF16 draws (in the twin too); quantized ones NVFP4 (the twin: their dequantized value)
    specs = model_tensors(cfg, recipe)
    n_out = sum(4 if s.quantized and not dequantized else 1 for s in specs)
    write_safetensors(generate_tensors(cfg, seed, dequantized, specs, device), out, total=n_out)
