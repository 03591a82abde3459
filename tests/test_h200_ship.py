"""benchmarks/h200/ship.py (both engines' shipping): what is stripped, pieces and manifest, reassembly checks,
requirements against the device image, .pth folders, the import-closure check, the smoke verdicts.

The real runs are on the H200 (benchmarks/h200_vllm/README.md, benchmarks/h200_sglang/README.md); here a fake
payload goes the same way.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest
from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
ship = load_script("benchmarks/h200/ship.py", "ship")


@pytest.mark.parametrize("name,left", [
    ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", True),
    ("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", False),
    ("vllm/vllm-rs", True),
    ("vllm/third_party/fmha_sm100/cutlass/include/cute/arch/mma_sm90_gmma_ext.hpp", True),
    ("vllm/third_party/deep_gemm/include/cute/arch/mma_sm90_gmma_ext.hpp", False),
    ("vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so", True),
    ("vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so", False),
    ("vllm/_flashmla_C.abi3.so", False),
    ("vllm-0.26.0.dist-info/entry_points.txt", False),
])
def test_strip_rules_leave_out_only_what_sm90_and_python312_never_load(name, left):
    vllm = ship.SETS["vllm"]
    assert (vllm.stripped(name) is not None) == left
    native = {m.replace(".", "/") for m in vllm.native}
    assert not any(vllm.stripped(n + ".abi3.so") for n in native)


@pytest.mark.parametrize("name,left", [
    ("sgl_kernel/flash_ops.abi3.so", True),
    ("sgl_kernel/sm100/common_ops.abi3.so", True),
    ("sgl_kernel/sm90/common_ops.abi3.so", False),
    ("sgl_kernel/flashmla_ops.abi3.so", False),
    ("sgl_kernel/spatial_ops.abi3.so", False),
    ("sgl_kernel/flash_attn.py", False),
    ("deep_gemm/_C.so", False),
    ("nvidia_cutlass_dsl/python_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cpython-312-x86_64-linux-gnu.so", False),
    ("sglang/srt/layers/attention/triton_backend.py", False),
])
def test_sglang_strip_rules(name, left):
    assert (ship.SETS["sglang"].stripped(name) is not None) == left


def _payload(tmp_path: Path, size: int) -> Path:
    archive = tmp_path / ship.ARCHIVE
    archive.write_bytes(random.Random(size).randbytes(size))
    return archive


@pytest.mark.parametrize("size,max_piece,count", [(1000, 400, 3), (1200, 400, 3), (399, 400, 1), (1201, 400, 4)])
def test_pieces_are_few_equal_and_bounded(tmp_path, size, max_piece, count):
    archive = _payload(tmp_path, size)
    pieces = ship.split(archive, tmp_path / "out", max_piece)
    sizes = [p.stat().st_size for p in pieces]
    assert len(pieces) == count and max(sizes) <= max_piece and max(sizes) - min(sizes) <= count
    assert b"".join(p.read_bytes() for p in pieces) == archive.read_bytes()
    assert [p.parent.name for p in pieces] == [f"p{i}" for i in range(count)]


def _shipped(tmp_path: Path, size: int = 5000, max_piece: int = 2000):
    archive = _payload(tmp_path, size)
    out = tmp_path / "ship-out"
    pieces = ship.split(archive, out, max_piece)
    manifest = ship.write_manifest(out, archive, pieces, {"vllm_wheel": "fake.whl"})
    return archive, out, manifest


def test_receive_then_reassemble_restores_the_archive(tmp_path):
    archive, out, manifest = _shipped(tmp_path)
    dest = tmp_path / "tmp-ship"
    for piece_dir in sorted(out.glob("p*")):  # one call per piece, each carrying only its folder
        carried = tmp_path / f"call-{piece_dir.name}"
        (carried / piece_dir.name).mkdir(parents=True)
        for f in piece_dir.iterdir():
            (carried / piece_dir.name / f.name).write_bytes(f.read_bytes())
        assert ship.receive(carried, dest) == [f"{ship.ARCHIVE}.{piece_dir.name[1:].zfill(2)}"]
    joined = ship.reassemble(dest, json.loads((dest / ship.MANIFEST).read_text()))
    assert joined.read_bytes() == archive.read_bytes()


def test_a_missing_or_corrupt_piece_is_named(tmp_path):
    _, out, manifest = _shipped(tmp_path)
    dest = tmp_path / "d"
    dest.mkdir()
    for p in manifest["pieces"][1:]:
        (dest / p["name"]).write_bytes((out / f"p{int(p['name'][-2:])}" / p["name"]).read_bytes())
    with pytest.raises(ship.ShipError, match=r"pieces missing: payload\.tar\.xz\.00 .*warm"):
        ship.reassemble(dest, manifest)
    first = manifest["pieces"][0]["name"]
    data = bytearray((out / "p0" / first).read_bytes())
    data[10] ^= 1
    (dest / first).write_bytes(bytes(data))
    with pytest.raises(ship.ShipError, match=rf"{first}: sha256 .* != manifest"):
        ship.reassemble(dest, manifest)
    (out / "p0" / first).write_bytes(bytes(data))
    with pytest.raises(ship.ShipError, match="a broken transfer"):
        ship.receive(out, tmp_path / "e")
    with pytest.raises(ship.ShipError, match="name the nothing/pN folder"):
        ship.receive(tmp_path / "nothing", tmp_path / "f")


@pytest.mark.parametrize("engine", sorted(ship.SETS))
def test_requirements_are_pinned_and_none_is_on_the_device_image_unless_marked(tmp_path, engine):
    reqs = ship.read_requirements(ship.SETS[engine].requirements)
    assert len(reqs) == len({ship._norm(r.name) for r in reqs})  # one version of each
    assert ship._norm(ship.SETS[engine].package) not in {ship._norm(r.name) for r in reqs}  # the engine is the main wheel
    kinds = tmp_path / "KINDS.md"
    kinds.write_text("## Python packages already there\n\nimage: Packages: absl-py, pydantic_core, torch.\n")
    assert ship.image_overlap(["pydantic-core==2.50.5", "fastapi==0.136.3", "Torch==2.11.0"], kinds) == \
        ["pydantic-core==2.50.5", "Torch==2.11.0"]
    real = Path("/work/.library/device/KINDS.md")
    if real.is_file():
        overlap = ship.image_overlap([r.pin for r in reqs], real)
        assert overlap == [r.pin for r in reqs if r.shadows_image]  # each on purpose, with why
        assert all(len(r.shadows_image) > 20 for r in reqs if r.shadows_image)
    bad = tmp_path / "r.txt"
    bad.write_text("fastapi\n")
    with pytest.raises(ship.ShipError, match="not pinned"):
        ship.requirements(bad)
    bad.write_text("fastapi==1\nFastAPI==2\n")
    with pytest.raises(ship.ShipError, match="fastapi pinned twice"):
        ship.requirements(bad)


def test_sglang_set_shadows_exactly_the_two_pins_it_needs():
    shadow = {r.name: r.shadows_image for r in ship.read_requirements(ship.SETS["sglang"].requirements) if r.shadows_image}
    assert set(shadow) == {"transformers", "tokenizers"} and "qwen3_asr" in shadow["transformers"]


def test_pth_folders_are_what_a_site_directory_would_add(tmp_path):
    site = tmp_path / "site"
    (site / "nvidia_cutlass_dsl" / "python_packages" / "cutlass").mkdir(parents=True)
    (site / "nvidia_cutlass_dsl.pth").write_text("nvidia_cutlass_dsl/python_packages\n")
    (site / "other.pth").write_text("# comment\nimport sys; sys.flags\nno/such/folder\nnvidia_cutlass_dsl/python_packages\n")
    assert ship.pth_folders(site) == ["nvidia_cutlass_dsl/python_packages"]


def test_import_closure_check_names_what_is_missing_and_why(tmp_path):
    """The prepare-time check: a package the start-up modules import unguarded that neither the site nor the
    image holds stops prepare with the import chain; one in a try/except ImportError does not."""
    site = tmp_path / "site"
    (site / "eng" / "srt").mkdir(parents=True)
    (site / "eng" / "__init__.py").write_text("import numpy\nfrom eng.srt import server\n")
    (site / "eng" / "srt" / "__init__.py").write_text("")
    (site / "eng" / "srt" / "server.py").write_text(
        "import json\nimport shippedpkg\ntry:\n    import optionalpkg\nexcept ImportError:\n    optionalpkg = None\n"
        "if _is_hip:\n    import hiponly\ndef later():\n    import lazypkg\n")
    (site / "shippedpkg").mkdir()
    (site / "shippedpkg" / "__init__.py").write_text("import missingdep\n")
    kinds = tmp_path / "KINDS.md"
    kinds.write_text("Packages: numpy, torch.\n")
    fake = ship.ShipSet(engine="eng", package="eng", version="1", requirements=ROOT / "benchmarks" / "h200_sglang" /
                        "requirements.txt", strip={}, extract=(), native=(), smoke="", problems=lambda s, m: [],
                        out=".x", ship_to="/tmp/x", site="/tmp/x/site", closure_entries=("eng.srt.server",))
    with pytest.raises(ship.ShipError, match=r"missingdep \(eng\.srt\.server -> shippedpkg\)"):
        ship.check_closure(fake, site, kinds)
    (site / "missingdep.py").write_text("")
    report = ship.check_closure(fake, site, kinds)
    assert report["from_image"] == ["numpy"] and report["guarded_only_absent"] == ["optionalpkg"]


def test_import_closure_tells_namespace_packages_apart(tmp_path):
    """`cuda` is a namespace shared by several distributions: the image's cuda-bindings provides cuda.bindings,
    not cuda.tile. On the H200 flashinfer.comm's `import cuda.tile` passed the check (the image "had cuda") and
    then failed the plugin's registration; the check now names the subpackage."""
    site = tmp_path / "site"
    (site / "eng").mkdir(parents=True)
    (site / "eng" / "__init__.py").write_text("import cuda.bindings.runtime\nimport cuda.tile as ct\n")
    kinds = tmp_path / "KINDS.md"
    kinds.write_text("Packages: cuda-bindings, torch.\n")
    fake = ship.ShipSet(engine="eng", package="eng", version="1", requirements=ROOT / "benchmarks" / "h200_sglang" /
                        "requirements.txt", strip={}, extract=(), native=(), smoke="", problems=lambda s, m: [],
                        out=".x", ship_to="/tmp/x", site="/tmp/x/site", closure_entries=("eng",))
    with pytest.raises(ship.ShipError, match=r"cuda\.tile \(eng\)"):
        ship.check_closure(fake, site, kinds)
    (site / "cuda" / "tile").mkdir(parents=True)
    (site / "cuda" / "tile" / "__init__.py").write_text("")
    assert ship.check_closure(fake, site, kinds)["from_image"] == ["cuda.bindings"]


def test_smoke_verdict_names_each_problem():
    vllm = ship.SETS["vllm"]
    good = {"vllm": vllm.version, "native": {m: "ok" for m in vllm.native}, "api_server": "ok",
            "entry_point": ["glm5_fp4.engines.vllm_plugin:register"], "glm5_nvfp4": "ok"}
    assert ship.smoke_problems(good) == []
    bad = {**good, "vllm": "0.33.0", "native": {**good["native"], "vllm._flashmla_C": "OSError: undefined symbol"},
           "api_server": "ModuleNotFoundError: No module named 'zmq'", "glm5_nvfp4": "AssertionError: not registered"}
    problems = ship.smoke_problems(bad)
    assert len(problems) == 4 and "expected 0.26.0" in problems[0] and "undefined symbol" in problems[1]
    assert "zmq" in problems[2] and "not registered" in problems[3]
    assert ship.smoke_problems({"error": "Traceback ...\nModuleNotFoundError: No module named 'torch'\n"}) == \
        ["ModuleNotFoundError: No module named 'torch'"]


def test_sglang_smoke_verdict_names_each_problem():
    sg = ship.SETS["sglang"]
    good = {"sglang": "0.5.15", "transformers": "5.12.1", "native": {m: "ok" for m in sg.native},
            "common_ops": "/tmp/sglang/site/sgl_kernel/sm90/common_ops.abi3.so",
            "server_imports": {m: "ok" for m in sg.closure_entries}, "flash_ops_stripped": "ImportError: ...",
            "entry_point": ["glm5_fp4.engines.sglang_plugin:register"], "glm5_fp4_backend": "ok"}
    assert ship.smoke_problems(good, sg) == []
    bad = {**good, "transformers": "5.17.0", "native": {**good["native"], "cutlass": "ModuleNotFoundError: cutlass"},
           "server_imports": {**good["server_imports"], "sglang.srt.models.glm4_moe": "ImportError: x"},
           "entry_point": [], "glm5_fp4_backend": "AssertionError: hooks not applied"}
    problems = ship.smoke_problems(bad, sg)
    assert len(problems) == 5 and "5.17.0" in problems[0] and "cutlass" in problems[1]
    assert "glm4_moe" in problems[2] and "entry point" in problems[3] and "hooks not applied" in problems[4]
    assert "not sm90/" in ship.smoke_problems({**good, "common_ops": "/x/sm100/common_ops.abi3.so"}, sg)[0]


def test_smoke_script_reports_every_check_on_this_machine(tmp_path):
    """The smoke script itself, against this environment's vLLM: it reports each check instead of stopping."""
    pytest.importorskip("vllm")
    import subprocess

    proc = subprocess.run([sys.executable, "-c", ship.smoke_script(ship.SETS["vllm"]), "vllm.no_such_library,json"],
                          capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("SMOKE "))
    smoke = json.loads(line[6:])
    assert smoke["native"]["json"] == "ok" and "ModuleNotFoundError" in smoke["native"]["vllm.no_such_library"]
    assert smoke["api_server"] == "ok" and smoke["glm5_nvfp4"] == "ok"
    problems = ship.smoke_problems(smoke)
    assert any("no_such_library" in p for p in problems)


@pytest.mark.parametrize("engine", sorted(ship.SETS))
def test_prepared_pieces_fit_a_call(engine):
    out = ROOT / ship.SETS[engine].out
    if not (out / ship.MANIFEST).is_file():
        pytest.skip(f"run benchmarks/h200_{engine}/prepare.sh first")
    manifest = json.loads((out / ship.MANIFEST).read_text())
    assert manifest.get("engine", "vllm") == engine
    # each piece must still fit one call beside today's working tree (which grows with the committed results)
    assert all(p["bytes"] + ship.travelling_bytes() <= (ship.CALL_MIB - 1) << 20 for p in manifest["pieces"]), (
        f"re-run benchmarks/h200_{engine}/prepare.sh: its pieces no longer fit a call beside this working tree")
    for i, p in enumerate(manifest["pieces"]):
        assert (out / f"p{i}" / p["name"]).stat().st_size == p["bytes"]
        assert json.loads((out / f"p{i}" / ship.MANIFEST).read_text()) == manifest
    assert os.path.getsize(out / "p0" / manifest["pieces"][0]["name"]) > 0


def test_pieces_are_sized_to_what_the_working_tree_leaves(tmp_path):
    """A call carries 64 MiB with the working tree: the piece limit shrinks as the tree grows (2026-12-05: 47 MiB
    pieces made when the tree was 3.4 MB were refused beside a 17 MB tree). Untracked files git does not ignore
    travel too; ignored ones do not."""
    import subprocess

    def git(*a):
        subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("big-ignored.bin\n")
    (tmp_path / "small.txt").write_text("x")
    git("add", ".")
    base = ship.piece_limit_mib(tmp_path)
    assert base == ship.CALL_MIB - ship.MARGIN_MIB - 1  # the two tiny files round the limit down by one MiB
    (tmp_path / "results.json").write_bytes(os.urandom(20 << 20))  # untracked, not ignored: it travels
    (tmp_path / "big-ignored.bin").write_bytes(b"0" * (30 << 20))  # ignored: stays here
    assert ship.piece_limit_mib(tmp_path) == base - 20
    (tmp_path / "more.bin").write_bytes(b"1" * (40 << 20))
    with pytest.raises(ship.ShipError, match="less than 8 MiB"):
        ship.piece_limit_mib(tmp_path)
