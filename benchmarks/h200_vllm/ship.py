"""Ship vLLM 0.26.0 and its server dependencies to the lent H200 (no registry there) in carried pieces.

Here (``prepare``, network): the vLLM wheel and the pinned dependency wheels (requirements.txt) are
downloaded, vLLM is unpacked minus what an SM90 GPU under Python 3.12 never loads (STRIP), the dependencies
are installed into the same ``site`` folder (``pip install --target --platform``: pip does the unpacking here,
the device only extracts), everything is packed as one tar.xz and cut into pieces of at most PIECE_MIB
under ``.ship/p0``, ``.ship/p1``, ... each with the manifest (sha256 of every piece and of the whole).

There (``receive``): each call copies the piece it carried to /tmp/ship (carried paths vanish after the
call; /tmp stays while the machine is warm). ``install``: checks every piece and the whole against the
manifest, extracts onto /tmp/site, installs glm5-fp4 from the working tree without dependencies, and
smoke-tests: vLLM's version, its five native libraries, the OpenAI server's imports, our entry point
registering ``glm5_nvfp4``. Every step is timed (``ship_timings.json``).

Standard library only (runs under the device's python3 before anything is installed).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VLLM_VERSION = "0.26.0"
PIECE_MIB = 58  # a call carries 64 MiB with the working tree (~4 MiB) and nothing else
MANIFEST = "manifest.json"
ARCHIVE = "payload.tar.xz"
# Files of the vLLM wheel an H200 (SM90) under CPython 3.12 never loads, with why.
STRIP = {
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "FlashAttention 2 (305 MB): SM90 runs FlashAttention 3 (_vllm_fa3_C)",
    "vllm/vllm-rs": "Rust frontend binary, used only with VLLM_RUST_FRONTEND_PATH set",
    "vllm/third_party/fmha_sm100/*": "SM100 (Blackwell) FMHA headers",
    "vllm/third_party/deep_gemm/_C.cpython-310-*": "DeepGEMM for CPython 3.10",
    "vllm/third_party/deep_gemm/_C.cpython-311-*": "DeepGEMM for CPython 3.11",
    "vllm/third_party/deep_gemm/_C.cpython-313-*": "DeepGEMM for CPython 3.13",
    "vllm/third_party/deep_gemm/_C.cpython-314-*": "DeepGEMM for CPython 3.14",
}
# What the previous session saw load under torch 2.11.0+cu130 (shared/reference/vllm-on-h200.md).
NATIVE = ("vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch", "vllm._flashmla_C", "vllm._flashmla_extension_C",
          "vllm.vllm_flash_attn._vllm_fa3_C")
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]


class ShipError(Exception):
    pass


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def stripped(name: str) -> str | None:
    """Why ``name`` (a path inside the wheel) is left out, or None to keep it."""
    for pattern, why in STRIP.items():
        if fnmatch.fnmatchcase(name, pattern):
            return why
    return None


def requirements(path: Path = HERE / "requirements.txt") -> list[str]:
    reqs = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    reqs = [r for r in reqs if r]
    bad = [r for r in reqs if "==" not in r]
    if bad:
        raise ShipError(f"{path}: every line must pin an exact version (NAME==VERSION); not pinned: {bad}")
    return reqs


def image_overlap(reqs: list[str], kinds_md: Path) -> list[str]:
    """Requirements the device image already has (KINDS.md's package list): carrying them would shadow it."""
    text = kinds_md.read_text()
    marker = "Packages: "
    listed = text[text.index(marker) + len(marker):].split("\n", 1)[0] if marker in text else ""
    norm = lambda n: n.strip().strip(".").lower().replace("_", "-").replace(".", "-")  # noqa: E731
    have = {norm(n) for n in listed.split(",") if n.strip()}
    return [r for r in reqs if norm(r.split("==")[0]) in have]


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


# -- here ------------------------------------------------------------------------------------------------------

def _pip(python: str, *args: str) -> None:
    subprocess.run([python, "-m", "pip", *args], check=True)


def _platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args


def prepare(out: Path, cache: Path, python: str, piece_mib: int, kinds_md: Path | None) -> dict:
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    reqs = requirements()
    if kinds_md is not None and kinds_md.is_file():
        overlap = image_overlap(reqs, kinds_md)
        if overlap:
            raise ShipError(f"already on the device image (KINDS.md), so carrying them would shadow it: {overlap}")
    wheels = cache / "wheels"
    deps = cache / "h200-deps"
    wheels.mkdir(parents=True, exist_ok=True)
    deps.mkdir(parents=True, exist_ok=True)
    _pip(python, "download", "-q", "--no-deps", *_platform_args(), "-d", str(wheels), f"vllm=={VLLM_VERSION}")
    _pip(python, "download", "-q", "--no-deps", *_platform_args(), "-d", str(deps), *reqs)
    timings["download_s"] = round(time.monotonic() - t0, 1)
    wheel = sorted(wheels.glob(f"vllm-{VLLM_VERSION}-*.whl"))[-1]
    wanted = {r.split("==")[0].lower().replace("-", "_").replace(".", "_"): r.split("==")[1] for r in reqs}
    dep_wheels = [w for w in sorted(deps.glob("*.whl"))
                  if wanted.get(w.name.split("-")[0].lower().replace(".", "_")) == w.name.split("-")[1]]
    if len(dep_wheels) != len(reqs):
        raise ShipError(f"{deps}: {len(dep_wheels)} wheels match requirements.txt's {len(reqs)} pins")

    build = out / "build"
    shutil.rmtree(build, ignore_errors=True)
    site = build / "site"
    t = time.monotonic()
    kept = left = 0
    left_bytes = 0
    with zipfile.ZipFile(wheel) as z:
        names = []
        for info in z.infolist():
            if stripped(info.filename):
                left += 1
                left_bytes += info.file_size
            else:
                names.append(info.filename)
        z.extractall(site, names)
        kept = len(names)
    _pip(python, "install", "-q", "--no-deps", "--no-index", "--no-compile", *_platform_args(), "--target",
         str(site), *map(str, dep_wheels))
    timings["unpack_s"] = round(time.monotonic() - t, 1)
    t = time.monotonic()
    shutil.rmtree(site / "bin", ignore_errors=True)  # console scripts with this machine's interpreter path
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
    info = {"vllm_wheel": wheel.name, "vllm_wheel_bytes": wheel.stat().st_size, "vllm_files_kept": kept,
            "stripped": {"files": left, "bytes": left_bytes, "rules": STRIP}, "dependencies": reqs,
            "site_bytes": sum(f.stat().st_size for f in site.rglob("*") if f.is_file()), "prepare_timings": timings}
    timings["total_s"] = round(time.monotonic() - t0, 1)
    manifest = write_manifest(out, archive, pieces, info)
    shutil.rmtree(build)
    return manifest


# -- there -----------------------------------------------------------------------------------------------------

def receive(carried: Path, ship: Path) -> list[str]:
    """Copy the piece(s) this call carried (``.ship/p*``) to ``ship``, checked against their manifest."""
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
        raise ShipError(f"no piece under {carried}/p*: name the .ship/pN folder in the call's carry list")
    return got


def _step(timings: dict, name: str, fn):
    t = time.monotonic()
    try:
        return fn()
    finally:
        timings[f"{name}_s"] = round(time.monotonic() - t, 2)
        print(f"[ship] {name}: {timings[f'{name}_s']} s", flush=True)


SMOKE = r"""
import importlib, importlib.metadata as md, json, sys, time, traceback
out = {}
def attempt(key, fn):  # every check reports, not only the first failure
    t = time.monotonic()
    try:
        fn()
        return "ok"
    except Exception as exc:
        out.setdefault("tracebacks", {})[key] = traceback.format_exc()[-2000:]
        return f"{type(exc).__name__}: {exc}"
    finally:
        out.setdefault("seconds", {})[key] = round(time.monotonic() - t, 2)
import vllm
out["vllm"], out["vllm_file"] = vllm.__version__, vllm.__file__
import torch
out["torch"], out["cuda"] = torch.__version__, torch.cuda.is_available()
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
import glm5_fp4
out["glm5_fp4_file"] = glm5_fp4.__file__
print("SMOKE " + json.dumps(out))
"""


def install(ship: Path, site: Path, repo: Path, out: Path | None) -> dict:
    timings: dict[str, float] = {}
    manifest = json.loads((ship / MANIFEST).read_text())
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
    _step(timings, "pip_install_glm5_fp4", lambda: subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
         "--no-compile", "--upgrade", "--target", str(site), str(repo)], check=True, cwd=repo))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(site)])}
    proc = _step(timings, "smoke", lambda: subprocess.run([sys.executable, "-c", SMOKE, ",".join(NATIVE)], env=env,
                                                          capture_output=True, text=True, timeout=300))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("SMOKE ")), None)
    smoke = json.loads(line[6:]) if line else {"error": proc.stderr[-3000:]}
    report = {"timings": timings, "smoke": smoke, "manifest": {k: manifest[k] for k in ("vllm_wheel", "archive_bytes")}}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "ship_timings.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    problems = smoke_problems(smoke)
    if problems:
        print(proc.stderr[-4000:], file=sys.stderr)
        raise ShipError("smoke test failed: " + "; ".join(problems))
    return report


def smoke_problems(smoke: dict) -> list[str]:
    if "error" in smoke:
        return [smoke["error"].strip().splitlines()[-1] if smoke["error"].strip() else "no output"]
    problems = []
    if smoke.get("vllm") != VLLM_VERSION:
        problems.append(f"import vllm reports {smoke.get('vllm')}, expected {VLLM_VERSION}")
    problems += [f"{m}: {r}" for m, r in smoke.get("native", {}).items() if r != "ok"]
    if smoke.get("api_server") != "ok":
        problems.append(f"vllm.entrypoints.openai.api_server: {smoke.get('api_server')}")
    if not smoke.get("entry_point"):
        problems.append("entry point vllm.general_plugins:glm5_fp4 not found (glm5-fp4 not installed?)")
    if smoke.get("glm5_nvfp4") != "ok":
        problems.append(f"the plugin did not register --quantization glm5_nvfp4: {smoke.get('glm5_nvfp4')}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="here: download, strip, pack, split into .ship/pN")
    p.add_argument("--out", type=Path, default=ROOT / ".ship")
    p.add_argument("--cache", type=Path, default=ROOT / ".cache")
    p.add_argument("--python", default=sys.executable, help="interpreter whose pip downloads (any Python)")
    p.add_argument("--piece-mib", type=int, default=PIECE_MIB)
    p.add_argument("--kinds-md", type=Path, default=Path("/work/.library/device/KINDS.md"))
    r = sub.add_parser("receive", help="there: copy the carried piece(s) to /tmp/ship")
    r.add_argument("--carried", type=Path, default=ROOT / ".ship")
    r.add_argument("--ship", type=Path, default=Path("/tmp/ship"))
    i = sub.add_parser("install", help="there: verify, extract onto /tmp/site, install glm5-fp4, smoke-test")
    i.add_argument("--ship", type=Path, default=Path("/tmp/ship"))
    i.add_argument("--site", type=Path, default=Path("/tmp/site"))
    i.add_argument("--repo", type=Path, default=ROOT)
    i.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "prepare":
            m = prepare(args.out, args.cache, args.python, args.piece_mib, args.kinds_md)
            print(json.dumps({k: m[k] for k in ("vllm_wheel", "archive_bytes", "stripped", "prepare_timings")}
                             | {"pieces": [(p["name"], p["bytes"]) for p in m["pieces"]]}, indent=1))
        elif args.cmd == "receive":
            print("[ship] received", receive(args.carried, args.ship), "->", args.ship)
        else:
            install(args.ship, args.site, args.repo, args.out)
    except (ShipError, subprocess.CalledProcessError, OSError) as exc:
        print(f"ship {args.cmd}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
