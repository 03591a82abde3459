"""Ship an engine and its server dependencies to the lent H200 (no registry there) in carried pieces.

One procedure for both engines; what differs is a :class:`ShipSet` (``SETS``): vLLM 0.26.0 and SGLang 0.5.15,
each the newest release of its engine that pins torch 2.11, the H200 image's torch.

Here (``prepare``, network): the engine's wheel and its pinned dependency wheels (``<engine folder>/
requirements.txt``) are downloaded; the wheels named in ``extract`` are unpacked minus what an SM90 GPU under
Python 3.12 never loads (``strip``) -- by zipfile, so a stripped file is never written -- and the others are
installed into the same ``site`` folder by ``pip install --target --platform`` (pip does the unpacking here, the
device only extracts); for SGLang the site's import closure is checked against the device image (every package
the server imports at start-up is shipped or already there, ``import_closure.py``). Everything is packed as one
tar.xz and cut into equal pieces of at most :func:`piece_limit_mib` (what a device call carries beside the working
tree) under ``<out>/p0``, ``<out>/p1``, ... each with the
manifest (sha256 of every piece and of the whole, the ``.pth`` folders the site needs on ``PYTHONPATH``).

There (``receive``): each call copies the piece it carried to the set's ship folder under /tmp (carried paths
vanish after the call; /tmp stays while the machine is warm). ``install``: checks every piece and the whole
against the manifest, extracts onto the set's site folder, writes ``<site>/.pythonpath`` (what ``.pth`` files would
add; a ``PYTHONPATH`` folder is not a site directory, so Python ignores them there), installs glm5-fp4 from the
working tree without dependencies, and smoke-tests: the engine's version, its native libraries, the server's
imports, our entry point registering its name. Every step is timed (``ship_timings.json``).

Standard library only (runs under the device's python3 before anything is installed).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# A device call carries 64 MiB in all: the working tree (git's tracked files and the untracked ones it does not
# ignore) and the carried paths. The tree grows with the committed results (3.4 MB on 2026-12-01, 17 MB on
# 2026-12-05, when 47 MiB pieces prepared for the former no longer fit beside it), so a piece is sized to what the tree
# leaves, less a margin for the piece's manifest and files written between prepare and the calls.
CALL_MIB = 64
MARGIN_MIB = 2
MANIFEST = "manifest.json"
ARCHIVE = "payload.tar.xz"
PYTHONPATH_FILE = ".pythonpath"
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
KINDS_MD = Path("/work/.library/device/KINDS.md")
# Import names of device-image distributions whose import name is not the distribution name with '-' -> '_'
# (inside a namespace package: the subpackage, import_closure.package_name).
IMAGE_IMPORT_NAMES = {"pillow": ("PIL",), "pyyaml": ("yaml",), "cuda-bindings": ("cuda.bindings",), "cuda-core": ("cuda.core",),
                      "cuda-pathfinder": ("cuda.pathfinder",),
                      "nvidia-ml-py": ("pynvml",), "attrs": ("attr", "attrs"), "protobuf": ("google",),
                      "scikit-learn": ("sklearn",), "scikit-image": ("skimage",), "opencv-python-headless": ("cv2",),
                      "python-dateutil": ("dateutil",), "pyzmq": ("zmq",), "py-cpuinfo": ("cpuinfo",),
                      "typing-extensions": ("typing_extensions",), "beautifulsoup4": ("bs4",)}


class ShipError(Exception):
    pass


# -- what is shipped, per engine ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShipSet:
    engine: str
    package: str  # the engine's distribution
    version: str
    requirements: Path  # NAME==VERSION lines; "# shadows the image: WHY" lets one replace an image package
    strip: dict[str, str]  # fnmatch pattern (path inside the site) -> why an H200 under CPython 3.12 never loads it
    extract: tuple[str, ...]  # distributions unpacked by zipfile (stripped files never written); the rest by pip
    native: tuple[str, ...]  # native libraries the smoke test loads
    smoke: str  # the engine's part of the smoke script (after SMOKE_PRELUDE)
    problems: Callable[["ShipSet", dict], list[str]]
    out: str  # where the pieces go here, relative to the repository
    ship_to: str  # where receive copies the pieces on the device (/tmp survives while the machine is warm)
    site: str  # where install extracts them
    # Start-up modules whose import closure must be covered (empty: no check), and third-party names the
    # closure finds that no server of ours imports (why).
    closure_entries: tuple[str, ...] = ()
    not_needed: dict[str, str] = field(default_factory=dict)

    @property
    def ship_dir(self) -> Path:
        return Path(self.ship_to)

    def stripped(self, name: str) -> str | None:
        """Why ``name`` (a path inside the site) is left out, or None to keep it."""
        for pattern, why in self.strip.items():
            if fnmatch.fnmatchcase(name, pattern):
                return why
        return None


SMOKE_PRELUDE = r"""
import importlib, importlib.metadata as md, json, sys, time, traceback
out = {}
def attempt(key, fn):  # every check reports, not only the first failure
    t = time.monotonic()
    try:
        fn()
        return "ok"
    except BaseException as exc:  # SystemExit / RuntimeError from CUDA code are findings too
        out.setdefault("tracebacks", {})[key] = traceback.format_exc()[-2000:]
        return f"{type(exc).__name__}: {exc}"
    finally:
        out.setdefault("seconds", {})[key] = round(time.monotonic() - t, 2)
import torch
out["torch"], out["cuda"] = torch.__version__, torch.cuda.is_available()
"""

SMOKE_EPILOGUE = r"""
import glm5_fp4
out["glm5_fp4_file"] = glm5_fp4.__file__
print("SMOKE " + json.dumps(out))
"""

VLLM_SMOKE = r"""
import vllm
out["vllm"], out["vllm_file"] = vllm.__version__, vllm.__file__
out["native"] = {m: attempt(m, lambda m=m: importlib.import_module(m)) for m in sys.argv[1].split(",")}
# The server's whole import chain (fastapi, zmq, msgspec, xgrammar, ...), as `python -m` loads it.
out["api_server"] = attempt("api_server", lambda: importlib.import_module("vllm.entrypoints.openai.api_server"))
out["entry_point"] = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "glm5_fp4"]
def register():
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    assert "glm5_nvfp4" in QUANTIZATION_METHODS, "glm5_nvfp4 not in QUANTIZATION_METHODS"
    assert get_quantization_config("glm5_nvfp4").__name__ == "Glm5NvFp4Config"
out["glm5_nvfp4"] = attempt("register", register)
"""

SGLANG_SMOKE = r"""
import os
os.environ.setdefault("SGLANG_PLUGINS", "glm5_fp4")
import sglang, transformers
out["sglang"], out["sglang_file"], out["transformers"] = sglang.__version__, sglang.__file__, transformers.__version__
out["native"] = {m: attempt(m, lambda m=m: importlib.import_module(m)) for m in sys.argv[1].split(",")}
# sgl_kernel loads common_ops from sm90/ on compute capability 9.0 (sm100/ is stripped)
out["common_ops"] = getattr(getattr(sys.modules.get("sgl_kernel"), "common_ops", None), "__file__", None)
# Stripped on purpose: FlashAttention's kernels. Recorded, not a failure.
out["flash_ops_stripped"] = attempt("flash_ops", lambda: importlib.import_module("sgl_kernel.flash_attn"))
out["server_imports"] = {m: attempt(m, lambda m=m: importlib.import_module(m)) for m in sys.argv[2].split(",")}
out["entry_point"] = [e.value for e in md.entry_points(group="sglang.srt.plugins") if e.name == "glm5_fp4"]
def register():
    from sglang.srt.plugins import load_plugins
    load_plugins()
    import argparse
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs
    # The parser only: prepare_server_args would read a model's config (none here); the choice list is what
    # registration changes.
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "/m", "--moe-runner-backend", "glm5_fp4"])
    assert args.moe_runner_backend == "glm5_fp4", args.moe_runner_backend
    missing = set(HookRegistry._hooks) - set(HookRegistry._patched)  # only our plugin is loaded (SGLANG_PLUGINS)
    assert not missing, f"hooks not applied: {sorted(missing)}"
    out["hooks"] = sorted(HookRegistry._patched)
out["glm5_fp4_backend"] = attempt("register", register)
try:
    out["cuda_bindings"] = md.version("cuda-bindings")
except Exception as exc:
    out["cuda_bindings"] = f"unknown ({exc})"
"""


def _vllm_problems(ship_set: ShipSet, smoke: dict) -> list[str]:
    problems = []
    if smoke.get("vllm") != ship_set.version:
        problems.append(f"import vllm reports {smoke.get('vllm')}, expected {ship_set.version}")
    problems += [f"{m}: {r}" for m, r in smoke.get("native", {}).items() if r != "ok"]
    if smoke.get("api_server") != "ok":
        problems.append(f"vllm.entrypoints.openai.api_server: {smoke.get('api_server')}")
    if not smoke.get("entry_point"):
        problems.append("entry point vllm.general_plugins:glm5_fp4 not found (glm5-fp4 not installed?)")
    if smoke.get("glm5_nvfp4") != "ok":
        problems.append(f"the plugin did not register --quantization glm5_nvfp4: {smoke.get('glm5_nvfp4')}")
    return problems


def _sglang_problems(ship_set: ShipSet, smoke: dict) -> list[str]:
    problems = []
    if smoke.get("sglang") != ship_set.version:
        problems.append(f"import sglang reports {smoke.get('sglang')}, expected {ship_set.version}")
    if smoke.get("transformers") != "5.12.1":
        problems.append(f"transformers {smoke.get('transformers')} imported, not the shipped 5.12.1 (SGLang 0.5.15's "
                        "pin; the image's 5.17 collides with its qwen3_asr config): is the site first on PYTHONPATH?")
    problems += [f"{m}: {r}" for m, r in smoke.get("native", {}).items() if r != "ok"]
    if smoke.get("native", {}).get("sgl_kernel") == "ok" and "/sm90/" not in str(smoke.get("common_ops")):
        problems.append(f"sgl_kernel loaded common_ops from {smoke.get('common_ops')}, not sm90/ (is this an H200?)")
    problems += [f"{m}: {r}" for m, r in smoke.get("server_imports", {}).items() if r != "ok"]
    if not smoke.get("entry_point"):
        problems.append("entry point sglang.srt.plugins:glm5_fp4 not found (glm5-fp4 not installed?)")
    if smoke.get("glm5_fp4_backend") != "ok":
        problems.append(f"the plugin did not register --moe-runner-backend glm5_fp4: {smoke.get('glm5_fp4_backend')}")
    return problems


# What SGLang's server processes import at start-up for the H200 runs: the launcher, the HTTP server, the
# tokenizer/detokenizer and scheduler processes, the model runner, both model files (GLM-5 and GLM-4.5 live in
# glm4_moe.py, on deepseek_v2.py), the NVFP4 method, the stock Marlin MoE runner, the attention backends the
# runs choose (Triton; DSA for GLM-5 with its FlashMLA kernels) and the PyTorch sampler.
SGLANG_SERVER_MODULES = (
    "sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.scheduler", "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager", "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.glm4_moe", "sglang.srt.models.deepseek_v2", "sglang.srt.layers.quantization.modelopt_quant",
    "sglang.srt.layers.moe.moe_runner.marlin", "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.attention.dsa_backend", "sglang.srt.layers.sampler", "sglang.srt.managers.io_struct",
    # What our plugin imports at registration, in the server's main process (before the model files): on the
    # H200 the token dispatcher's chain reached flashinfer.comm -> cuda.tile, absent, and registration failed.
    "sglang.srt.layers.moe.moe_runner.runner", "sglang.srt.layers.moe.moe_runner.base",
    "sglang.srt.layers.moe.token_dispatcher.standard", "sglang.srt.layers.moe.utils",
    "sglang.srt.plugins.hook_registry", "sglang.srt.runtime_context",
)

SETS: dict[str, ShipSet] = {
    "vllm": ShipSet(
        engine="vllm", package="vllm", version="0.26.0", requirements=ROOT / "benchmarks" / "h200_vllm" / "requirements.txt",
        strip={
            "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "FlashAttention 2 (305 MB): SM90 runs FlashAttention 3 (_vllm_fa3_C)",
            "vllm/vllm-rs": "Rust frontend binary, used only with VLLM_RUST_FRONTEND_PATH set",
            "vllm/third_party/fmha_sm100/*": "SM100 (Blackwell) FMHA headers",
            "vllm/third_party/deep_gemm/_C.cpython-310-*": "DeepGEMM for CPython 3.10",
            "vllm/third_party/deep_gemm/_C.cpython-311-*": "DeepGEMM for CPython 3.11",
            "vllm/third_party/deep_gemm/_C.cpython-313-*": "DeepGEMM for CPython 3.13",
            "vllm/third_party/deep_gemm/_C.cpython-314-*": "DeepGEMM for CPython 3.14",
        },
        extract=("vllm",),
        # What a previous session saw load under torch 2.11.0+cu130 (shared/reference/vllm-on-h200.md).
        native=("vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch", "vllm._flashmla_C",
                "vllm._flashmla_extension_C", "vllm.vllm_flash_attn._vllm_fa3_C"),
        smoke=VLLM_SMOKE, problems=_vllm_problems, out=".ship", ship_to="/tmp/ship", site="/tmp/site"),
    "sglang": ShipSet(
        engine="sglang", package="sglang", version="0.5.15",
        requirements=ROOT / "benchmarks" / "h200_sglang" / "requirements.txt",
        strip={
            "sgl_kernel/flash_ops.abi3.so": "FlashAttention 3/4 kernels (1.76 GB): the H200 servers run the Triton "
                                            "attention backend and, for DSA, FlashMLA (flashmla_ops) + DeepGEMM",
            "sgl_kernel/sm100/*": "the Blackwell build of common_ops (sgl_kernel loads sm90/ on an H200)",
        },
        extract=("sglang", "sglang-kernel"),
        native=("sgl_kernel", "sgl_kernel.flash_mla", "deep_gemm", "tvm_ffi", "flashinfer", "cutlass", "cutlass.cute",
                "soundfile", "zmq", "msgspec", "orjson", "pybase64", "setproctitle", "zstandard", "tokenizers"),
        smoke=SGLANG_SMOKE, problems=_sglang_problems, out=".ship-sglang", ship_to="/tmp/sglang/ship",
        site="/tmp/sglang/site", closure_entries=SGLANG_SERVER_MODULES,
        not_needed={
            "smg_grpc_servicer": "gRPC serving mode only",
        }),
}


def smoke_problems(smoke: dict, ship_set: ShipSet | None = None) -> list[str]:
    """What the smoke report says is wrong (an empty list: ready to serve)."""
    if "error" in smoke:
        return [smoke["error"].strip().splitlines()[-1] if smoke["error"].strip() else "no output"]
    ship_set = ship_set or SETS["vllm"]
    return ship_set.problems(ship_set, smoke)


def smoke_script(ship_set: ShipSet) -> str:
    return SMOKE_PRELUDE + ship_set.smoke + SMOKE_EPILOGUE


def smoke_argv(ship_set: ShipSet) -> list[str]:
    return [",".join(ship_set.native), ",".join(ship_set.closure_entries)]


# -- shared helpers ------------------------------------------------------------------------------------------------

def travelling_bytes(root: Path = ROOT) -> int:
    """Bytes every device call sends besides its carried paths: the files git tracks and the untracked ones it does not
    ignore, as they are in the working tree."""
    names = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True).stdout.split(b"\0")
    files = (root / os.fsdecode(n) for n in names if n)
    return sum(f.stat().st_size for f in files if f.is_file())


def piece_limit_mib(root: Path = ROOT) -> int:
    """The largest piece (MiB) that fits one call beside the working tree of ``root``."""
    tree = travelling_bytes(root)
    left = (CALL_MIB << 20) - tree - (MARGIN_MIB << 20)
    if left < 8 << 20:
        raise ShipError(f"the working tree of {root} takes {tree / 2**20:.1f} MiB of the {CALL_MIB} MiB "
                        f"a device call carries: less than 8 MiB would be left per piece (ignore what calls need not send)")
    return left >> 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip().strip(".")).lower()


@dataclass(frozen=True)
class Requirement:
    pin: str  # NAME==VERSION
    shadows_image: str | None  # why it replaces the image's own copy, if it does

    @property
    def name(self) -> str:
        return self.pin.split("==")[0]

    @property
    def version(self) -> str:
        return self.pin.split("==")[1]


def read_requirements(path: Path) -> list[Requirement]:
    reqs = []
    for line in path.read_text().splitlines():
        pin, _, comment = line.partition("#")
        pin = pin.strip()
        if not pin:
            continue
        if "==" not in pin:
            raise ShipError(f"{path}: every line must pin an exact version (NAME==VERSION); not pinned: {pin!r}")
        why = comment.split("shadows the image:", 1)[1].strip() if "shadows the image:" in comment else None
        reqs.append(Requirement(pin, why))
    names = [_norm(r.name) for r in reqs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ShipError(f"{path}: one version of each package, {', '.join(twice)} pinned twice")
    return reqs


def requirements(path: Path = SETS["vllm"].requirements) -> list[str]:
    return [r.pin for r in read_requirements(path)]


def image_packages(kinds_md: Path = KINDS_MD) -> set[str]:
    """Distributions KINDS.md lists as already on the device image (normalised names)."""
    text = kinds_md.read_text()
    marker = "Packages: "
    listed = text[text.index(marker) + len(marker):].split("\n", 1)[0] if marker in text else ""
    return {_norm(n) for n in listed.split(",") if n.strip()}


def image_overlap(reqs: list[str], kinds_md: Path) -> list[str]:
    """Requirements the device image already has (KINDS.md's package list): carrying them would shadow it."""
    have = image_packages(kinds_md)
    return [r for r in reqs if _norm(r.split("==")[0]) in have]


def image_import_names(kinds_md: Path = KINDS_MD) -> set[str]:
    out = set()
    for dist in image_packages(kinds_md):
        out.update(IMAGE_IMPORT_NAMES.get(dist, (dist.replace("-", "_"),)))
    return out


def split(archive: Path, out: Path, max_piece_bytes: int) -> list[Path]:
    """As few pieces as ``max_piece_bytes`` allows, of equal size (each call then carries the least)."""
    total = archive.stat().st_size
    count = max(1, -(-total // max_piece_bytes))
    piece_bytes = -(-total // count)
    pieces = []
    with archive.open("rb") as f:
        for i, block in enumerate(iter(lambda: f.read(piece_bytes), b"")):
            d = out / f"p{i}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{ARCHIVE}.{i:02d}").write_bytes(block)
            pieces.append(d / f"{ARCHIVE}.{i:02d}")
    return pieces


def write_manifest(out: Path, archive: Path, pieces: list[Path], info: dict) -> dict:
    manifest = {**info, "archive": ARCHIVE, "archive_bytes": archive.stat().st_size, "archive_sha256": sha256(archive),
                "pieces": [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256(p)} for p in pieces]}
    for p in pieces:
        (p.parent / MANIFEST).write_text(json.dumps(manifest, indent=1))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def reassemble(ship: Path, manifest: dict) -> Path:
    """Check every piece in ``ship`` and the whole against the manifest; returns the archive."""
    missing = [p["name"] for p in manifest["pieces"] if not (ship / p["name"]).is_file()]
    if missing:
        raise ShipError(f"{ship}: pieces missing: {', '.join(missing)} (each receive call copies the piece it "
                        f"carried; the machine must stay warm between the calls)")
    for p in manifest["pieces"]:
        got = sha256(ship / p["name"])
        if got != p["sha256"]:
            raise ShipError(f"{ship / p['name']}: sha256 {got} != manifest {p['sha256']}")
    archive = ship / manifest["archive"]
    with archive.open("wb") as out:
        for p in manifest["pieces"]:
            with (ship / p["name"]).open("rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    got = sha256(archive)
    if got != manifest["archive_sha256"]:
        raise ShipError(f"{archive}: sha256 {got} != manifest {manifest['archive_sha256']}")
    return archive


def pth_folders(site: Path) -> list[str]:
    """Folders the site's ``.pth`` files add to sys.path (relative to the site), as a site directory would."""
    out = []
    for pth in sorted(site.glob("*.pth")):
        for line in pth.read_text().splitlines():
            line = line.strip()
            if not line or line.startswith(("#", "import ", "import\t")):
                continue
            if (site / line).is_dir() and line not in out:
                out.append(line)
    return out


# -- here ------------------------------------------------------------------------------------------------------

def _pip(python: str, *args: str) -> None:
    subprocess.run([python, "-m", "pip", *args], check=True)


def _platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args


def _wheel_key(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return _norm(name), version


def check_closure(ship_set: ShipSet, site: Path, kinds_md: Path | None) -> dict:
    """Every third-party package the server's start-up modules import unguarded is in the site or on the image."""
    sys.path.insert(0, str(HERE))
    try:
        from import_closure import closure
    finally:
        sys.path.pop(0)
    roots = [site] + [site / p for p in pth_folders(site)]
    found = closure(roots, list(ship_set.closure_entries))
    image = image_import_names(kinds_md) if kinds_md is not None and kinds_md.is_file() else set()
    missing = sorted(n for n in found.hard if n not in image and n not in ship_set.not_needed)
    report = {"modules": len(found.modules), "from_image": sorted(n for n in found.hard if n in image),
              "not_needed": {n: ship_set.not_needed[n] for n in sorted(found.hard) if n in ship_set.not_needed},
              "guarded_only_absent": sorted(n for n in found.guarded if n not in found.hard and n not in image)}
    if missing:
        chains = "; ".join(f"{n} ({' -> '.join(found.chain(n))})" for n in missing)
        raise ShipError(f"{ship_set.engine} start-up imports what neither the shipped site nor the device image has "
                        f"(add it to {ship_set.requirements.relative_to(ROOT)}, or to not_needed with why): {chains}")
    return report


def prepare(ship_set: ShipSet, out: Path, cache: Path, python: str, piece_mib: int, kinds_md: Path | None) -> dict:
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    reqs = read_requirements(ship_set.requirements)
    if kinds_md is not None and kinds_md.is_file():
        overlap = [r for r in image_overlap([r.pin for r in reqs], kinds_md)
                   if not next(q for q in reqs if q.pin == r).shadows_image]
        if overlap:
            raise ShipError(f"already on the device image (KINDS.md), so carrying them would shadow it: {overlap} "
                            "(mark a line '# shadows the image: WHY' if that is the point)")
    wheels = cache / "wheels"
    deps = cache / f"h200-deps-{ship_set.engine}" if ship_set.engine != "vllm" else cache / "h200-deps"
    wheels.mkdir(parents=True, exist_ok=True)
    deps.mkdir(parents=True, exist_ok=True)
    main_pin = f"{ship_set.package}=={ship_set.version}"
    _pip(python, "download", "-q", "--no-deps", *_platform_args(), "-d", str(wheels), main_pin)
    _pip(python, "download", "-q", "--no-deps", *_platform_args(), "-d", str(deps), *(r.pin for r in reqs))
    timings["download_s"] = round(time.monotonic() - t0, 1)
    main = _norm(ship_set.package)
    wheel = sorted(w for w in wheels.glob("*.whl") if _wheel_key(w) == (main, ship_set.version))[-1]
    wanted = {_norm(r.name): r.version for r in reqs}
    dep_wheels = [w for w in sorted(deps.glob("*.whl")) if wanted.get(_wheel_key(w)[0]) == _wheel_key(w)[1]]
    if len(dep_wheels) != len(reqs):
        got = {_wheel_key(w)[0] for w in dep_wheels}
        raise ShipError(f"{deps}: {len(dep_wheels)} wheels match {ship_set.requirements.name}'s {len(reqs)} pins; "
                        f"missing: {sorted(set(wanted) - got)}")
    extract = {_norm(n) for n in ship_set.extract}
    unzip = [wheel] + [w for w in dep_wheels if _wheel_key(w)[0] in extract]
    by_pip = [w for w in dep_wheels if w not in unzip]

    build = out / "build"
    shutil.rmtree(build, ignore_errors=True)
    site = build / "site"
    t = time.monotonic()
    kept = left = 0
    left_bytes = 0
    for whl in unzip:
        with zipfile.ZipFile(whl) as z:
            names = []
            for info in z.infolist():
                if ship_set.stripped(info.filename):
                    left += 1
                    left_bytes += info.file_size
                else:
                    names.append(info.filename)
            z.extractall(site, names)
            kept += len(names)
    if by_pip:
        _pip(python, "install", "-q", "--no-deps", "--no-index", "--no-compile", *_platform_args(), "--target",
             str(site), *map(str, by_pip))
    for f in [f for f in site.rglob("*") if f.is_file()]:  # stripped files pip unpacked
        if ship_set.stripped(str(f.relative_to(site))):
            left += 1
            left_bytes += f.stat().st_size
            f.unlink()
    timings["unpack_s"] = round(time.monotonic() - t, 1)
    shutil.rmtree(site / "bin", ignore_errors=True)  # console scripts with this machine's interpreter path
    closure = check_closure(ship_set, site, kinds_md) if ship_set.closure_entries else None
    t = time.monotonic()
    archive = build / ARCHIVE
    if shutil.which("xz") and shutil.which("tar"):  # multi-threaded; same format as tarfile's
        with archive.open("wb") as f:
            tar = subprocess.Popen(["tar", "-cf", "-", "-C", str(build), "site"], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-9", "-T0", "-c"], stdin=tar.stdout, stdout=f, check=True)
            if tar.wait() != 0:
                raise ShipError("tar failed while packing the site folder")
    else:
        with tarfile.open(archive, "w:xz", preset=9) as tar:
            tar.add(site, arcname="site")
    timings["compress_s"] = round(time.monotonic() - t, 1)
    for old in out.glob("p[0-9]*"):
        shutil.rmtree(old)
    pieces = split(archive, out, piece_mib << 20)
    info = {"engine": ship_set.engine, "wheel": wheel.name, "wheel_bytes": wheel.stat().st_size,
            "files_kept": kept, "stripped": {"files": left, "bytes": left_bytes, "rules": ship_set.strip},
            "dependencies": [r.pin for r in reqs], "shadows_image": {r.pin: r.shadows_image for r in reqs if r.shadows_image},
            "pythonpath": pth_folders(site), "import_closure": closure,
            "site_bytes": sum(f.stat().st_size for f in site.rglob("*") if f.is_file()), "prepare_timings": timings}
    if ship_set.engine == "vllm":  # the keys the first H200 run's scripts and results used
        info.update(vllm_wheel=wheel.name, vllm_wheel_bytes=wheel.stat().st_size, vllm_files_kept=kept)
    timings["total_s"] = round(time.monotonic() - t0, 1)
    manifest = write_manifest(out, archive, pieces, info)
    shutil.rmtree(build)
    return manifest


# -- there -----------------------------------------------------------------------------------------------------

def receive(carried: Path, ship: Path) -> list[str]:
    """Copy the piece(s) this call carried (``<out>/p*``) to ``ship``, checked against their manifest."""
    ship.mkdir(parents=True, exist_ok=True)
    got = []
    for d in sorted(carried.glob("p[0-9]*")):
        manifest = json.loads((d / MANIFEST).read_text())
        expected = {p["name"]: p["sha256"] for p in manifest["pieces"]}
        for piece in d.glob(f"{ARCHIVE}.*"):
            if sha256(piece) != expected.get(piece.name):
                raise ShipError(f"{piece}: checksum differs from its manifest (a broken transfer)")
            shutil.copyfile(piece, ship / piece.name)
            got.append(piece.name)
        shutil.copyfile(d / MANIFEST, ship / MANIFEST)
    if not got:
        raise ShipError(f"no piece under {carried}/p*: name the {carried.name}/pN folder in the call's carry list")
    return got


def _step(timings: dict, name: str, fn):
    t = time.monotonic()
    try:
        return fn()
    finally:
        timings[f"{name}_s"] = round(time.monotonic() - t, 2)
        print(f"[ship] {name}: {timings[f'{name}_s']} s", flush=True)


def install(ship_set: ShipSet, ship: Path, site: Path, repo: Path, out: Path | None) -> dict:
    timings: dict[str, float] = {}
    manifest = json.loads((ship / MANIFEST).read_text())
    if manifest.get("engine", "vllm") != ship_set.engine:
        raise ShipError(f"{ship}: pieces of {manifest.get('engine')}, not {ship_set.engine}")
    archive = _step(timings, "verify_and_join", lambda: reassemble(ship, manifest))

    def extract():
        site.mkdir(parents=True, exist_ok=True)
        if shutil.which("xz") and shutil.which("tar"):  # multi-threaded where xz can, else tarfile's lzma
            subprocess.run(["tar", "-xJf", str(archive), "-C", str(site.parent)], check=True)
        else:
            with tarfile.open(archive) as tar:
                tar.extractall(site.parent)
        archive.unlink()
    if site.name != "site":
        raise ShipError(f"{site}: the archive holds a folder named site; extract target must end in /site")
    _step(timings, "extract", extract)
    extra = [str(site / p) for p in manifest.get("pythonpath", [])]
    (site / PYTHONPATH_FILE).write_text(os.pathsep.join(extra))
    _step(timings, "pip_install_glm5_fp4", lambda: subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
         "--no-compile", "--upgrade", "--target", str(site), str(repo)], check=True, cwd=repo))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(site), *extra])}
    proc = _step(timings, "smoke", lambda: subprocess.run([sys.executable, "-c", smoke_script(ship_set),
                                                           *smoke_argv(ship_set)], env=env,
                                                          capture_output=True, text=True, timeout=300))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("SMOKE ")), None)
    smoke = json.loads(line[6:]) if line else {"error": proc.stderr[-3000:]}
    report = {"timings": timings, "smoke": smoke,
              "manifest": {k: manifest.get(k) for k in ("engine", "wheel", "archive_bytes", "pythonpath")}}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        name = "ship_timings.json" if ship_set.engine == "vllm" else f"ship_timings_{ship_set.engine}.json"
        (out / name).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    problems = smoke_problems(smoke, ship_set)
    if problems:
        print(proc.stderr[-4000:], file=sys.stderr)
        raise ShipError("smoke test failed: " + "; ".join(problems))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=sorted(SETS), default="vllm")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="here: download, strip, pack, split into <out>/pN")
    p.add_argument("--out", type=Path, default=None, help="default: .ship (vllm), .ship-sglang (sglang)")
    p.add_argument("--cache", type=Path, default=ROOT / ".cache")
    p.add_argument("--python", default=sys.executable, help="interpreter whose pip downloads (any Python)")
    p.add_argument("--piece-mib", type=int, default=None,
                   help="largest piece (default: what a call carries beside this working tree, piece_limit_mib)")
    p.add_argument("--kinds-md", type=Path, default=KINDS_MD)
    r = sub.add_parser("receive", help="there: copy the carried piece(s) to the set's ship folder")
    r.add_argument("--carried", type=Path, default=None)
    r.add_argument("--ship", type=Path, default=None)
    i = sub.add_parser("install", help="there: verify, extract onto the set's site, install glm5-fp4, smoke-test")
    i.add_argument("--ship", type=Path, default=None)
    i.add_argument("--site", type=Path, default=None)
    i.add_argument("--repo", type=Path, default=ROOT)
    i.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    args = ap.parse_args(argv)
    ship_set = SETS[args.engine]
    try:
        if args.cmd == "prepare":
            m = prepare(ship_set, args.out or ROOT / ship_set.out, args.cache, args.python,
                        args.piece_mib or piece_limit_mib(), args.kinds_md)
            print(json.dumps({k: m[k] for k in ("wheel", "archive_bytes", "site_bytes", "stripped", "prepare_timings",
                                                "pythonpath", "import_closure")}
                             | {"pieces": [(p["name"], p["bytes"]) for p in m["pieces"]]}, indent=1))
        elif args.cmd == "receive":
            ship = args.ship or ship_set.ship_dir
            print("[ship] received", receive(args.carried or ROOT / ship_set.out, ship), "->", ship)
        else:
            install(ship_set, args.ship or ship_set.ship_dir, args.site or Path(ship_set.site), args.repo, args.out)
    except (ShipError, subprocess.CalledProcessError, OSError) as exc:
        print(f"ship {args.cmd}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
