"""SM120 gate on a CPU machine: every MoE kernel the backend may launch on sm_120 is compiled ahead of time
(Triton targets sm_120 without the GPU) and must fit 99 KB of shared memory, not spill, and use tensor-core
MMAs with the FP8-conversion decode. The configurations are read from glm5_fp4/kernels/configs.py and the
launches recorded from glm5_fp4/kernels/moe.py, so a new config or kernel argument is covered without an edit.

One module-scoped compile of the whole sm_120 matrix (~1-3 min on 2 cores); the rest are unit tests of the
parsers and verdicts. `make test` runs this file twice: with .venv's Triton and with .venv-sglang's, the Triton
torch 2.14 pins (3.8: what vLLM 0.33 and SGLang 0.5.23 users compile with), which builds some kernel forms
differently (glm5_fp4/kernels/configs.py, triton_stages_mma_sets).
"""

from __future__ import annotations

import os

import pytest

from glm5_fp4.hardware import get_gpu
from glm5_fp4.kernels import configs as C
from glm5_fp4.sm120 import launches as L
from glm5_fp4.sm120.build import Build, Instructions, compile_specialized, parse_ptxas, scan_ptx, specialize
from glm5_fp4.sm120.matrix import MatrixResult, Row, run_matrix, smem_limit, verdicts
from glm5_fp4.sm120.report import markdown

SM120_LIMIT = get_gpu("rtx-pro-6000-ws").smem_per_block_bytes


@pytest.fixture(scope="module")
def sm120() -> MatrixResult:
    return run_matrix(archs=("sm120",), jobs=min(2, os.cpu_count() or 1))


def _describe(rows) -> str:
    return "\n".join(
        f"{r.kernel} {r.constexprs} warps={r.num_warps} stages={r.num_stages}: {'; '.join(r.problems)} "
        f"[configs {r.configs}]"
        for r in rows
    )


def test_limit_is_the_sm120_opt_in_maximum():
    assert smem_limit("sm120") == SM120_LIMIT == 101_376


def test_every_sm120_kernel_compiles(sm120):
    broken = [r for r in sm120.rows if r.error]
    assert not broken, "kernels that do not compile for sm_120:\n" + _describe(broken)


def test_every_selected_sm120_config_fits_shared_memory_and_does_not_spill(sm120):
    bad = [r for r in sm120.rows if r.build and any(p.startswith(("smem", "spill")) for p in r.problems)]
    assert not bad, (
        "sm_120 configs to remove from glm5_fp4/kernels/configs.py (or fix in the kernel):\n" + _describe(bad)
    )
    for r in sm120.rows:
        if r.build:
            assert r.build["shared_bytes"] <= SM120_LIMIT
            assert r.build["registers"] is not None and r.build["spill_store_bytes"] == 0


def test_sm120_gemms_use_the_intended_instructions(sm120):
    """16-bit GEMMs: mma.sync (no wgmma/tcgen05 on SM120) fed by the cvt.rn.f16x2.e4m3x2 decode; the native
    FP4 path (if configs.py has one for sm120): mma.sync m16n8k64 kind::mxf4nvf4 block-scaled."""
    gemms = [r for r in sm120.rows if r.build and "gemm" in r.kernel]
    assert gemms
    for r in gemms:
        ins = r.build["instructions"]
        assert not any(m.startswith(("wgmma", "tcgen05")) for m in {**ins["mma"], **ins["fp4_native"]})
        if "kind::mxf4nvf4" in r.intended:
            assert any(f.startswith("mma.sync m16n8k64 kind::mxf4nvf4") for f in ins["fp4_native"]), (r.kernel, ins)
        else:
            assert any(m.startswith("mma.sync") and m.endswith(("f16", "bf16")) for m in ins["mma"]), (r.kernel, ins)
            if r.constexprs.get("USE_ASM"):
                assert ins["cvt_e4m3x2_f16x2"] > 0, (r.kernel, r.constexprs)
    bad = [r for r in sm120.rows if any(p.startswith(("no_mma", "no_cvt", "wrong_fp4", "no_fp4_mma")) for p in r.problems)]
    assert not bad, _describe(bad)


def test_matrix_covers_every_batch_size_the_picker_can_choose(sm120):
    """Batch sizes outside the matrix's list must not pick a config the matrix did not compile."""
    for shape in L.shape_classes():
        compiled = {
            (c["role"], c["schedule"], tuple(c[k] for k in ("bn", "bm", "num_warps", "num_stages")), c.get("bk"))
            for r in sm120.rows if shape.name in r.shapes for c in r.configs
        }
        for t in (1, 2, 3, 4, 6, 7, 9, 13, 24, 40, 100, 200, 300, 700, 1500, 3000, 6000, 16384):
            p = C.plan("sm120", t, shape.num_experts, shape.top_k, shape.hidden, shape.intermediate)
            for role in ("gemm1", "gemm2"):
                c = getattr(p, role)
                key = (role, p.schedule, (c.bn, c.bm, c.num_warps, c.num_stages), getattr(c, "bk", None))
                assert key in compiled, f"{shape.name} T={t}: {role} {c} ({p.schedule}) was not compiled"


def test_an_oversized_config_is_caught():
    """The gate can fail: a GEMM2 tile far above 99 KB is reported as a shared-memory failure."""
    shape = next(s for s in L.shape_classes() if s.name == "tp4")
    base = C.plan("sm120", 64, shape.num_experts, shape.top_k, shape.hidden, shape.intermediate)
    big = C.Plan("grouped", base.gemm1, C.Gemm2Config(256, 64, 8, 2), 1)
    sel = L.Selection("sm120", shape, "w4a16", big, 64, ("gemm2",), "test")
    launch = next(x for x in L.record(sel) if "gemm2" in x.name)
    sp = specialize(launch, 120)
    b = compile_specialized(sp)
    assert b.shared_bytes > SM120_LIMIT
    probs = verdicts("sm120", "tl.dot", sp.constexpr_values(), b, SM120_LIMIT)
    assert any(p.startswith("smem") for p in probs)


# ---------------------------------------------------------------------------------------------------------
# Parsers and verdicts (no compilation)
# ---------------------------------------------------------------------------------------------------------
PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'other_kernel' for 'sm_120a'
ptxas info    : Function properties for other_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers
ptxas info    : Compiling entry function 'moe_gemm1_kernel' for 'sm_120a'
ptxas info    : Function properties for moe_gemm1_kernel
    24 bytes stack frame, 12 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 24 bytes cumulative stack size
"""


def test_parse_ptxas_reads_the_named_entry():
    r = parse_ptxas(PTXAS_LOG, "moe_gemm1_kernel")
    assert r == {"registers": 255, "stack_bytes": 24, "spill_store_bytes": 12, "spill_load_bytes": 20}
    assert parse_ptxas(PTXAS_LOG, "other_kernel")["registers"] == 40
    assert parse_ptxas("garbage")["registers"] is None


def test_scan_ptx_classifies_mma_forms():
    ptx = "\n".join([
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f2};",
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};",
        "mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1.e2m1.f32.ue4m3 {%f1};",
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%f1}, %rd1, %rd2;",
        "tcgen05.mma.cta_group::1.kind::f16 [%r1], %rd1, %rd2, %r2, %p1;",
        "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale [%r1], %rd1, %rd2;",
        "cvt.rn.f16x2.e4m3x2 %r5, %h1;",
        "// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 in a comment",
    ])
    ins = scan_ptx(ptx)
    assert ins.mma == {"mma.sync m16n8k16 f16": 1, "mma.sync m16n8k16 bf16": 1, "wgmma m64n16k16 f16": 1,
                       "tcgen05.mma kind::f16": 1}
    assert ins.fp4_native == {"mma.sync m16n8k64 kind::mxf4nvf4": 1, "tcgen05.mma kind::mxf4nvf4": 1}
    assert ins.cvt_e4m3x2_f16x2 == 1


def _build(**kw) -> Build:
    base = dict(kernel="k", cc=120, num_warps=4, num_stages=2, shared_bytes=1000, registers=100, spill_store_bytes=0,
                spill_load_bytes=0, stack_bytes=0, tmem_bytes=None,
                instructions=Instructions(mma={"mma.sync m16n8k16 f16": 8}, cvt_e4m3x2_f16x2=4), compile_s=0.1)
    base.update(kw)
    return Build(**base)


def test_verdicts():
    assert verdicts("sm120", "tl.dot", {"USE_ASM": True}, _build(), SM120_LIMIT) == []
    assert verdicts("sm120", "", {}, _build(shared_bytes=SM120_LIMIT + 1), SM120_LIMIT)[0].startswith("smem")
    assert verdicts("sm120", "", {}, _build(spill_store_bytes=4, spill_load_bytes=4), SM120_LIMIT)[0].startswith("spill")
    wg = _build(instructions=Instructions(mma={"wgmma m64n16k16 f16": 1}))
    assert verdicts("sm120", "tl.dot", {}, wg, SM120_LIMIT)[0].startswith("no_mma")
    assert verdicts("sm90", "tl.dot", {}, wg, SM120_LIMIT) == []
    no_cvt = _build(instructions=Instructions(mma={"mma.sync m16n8k16 f16": 1}))
    assert verdicts("sm120", "tl.dot cvt.rn.f16x2.e4m3x2", {"USE_ASM": True}, no_cvt, SM120_LIMIT)[0].startswith("no_cvt")
    fp4 = _build(instructions=Instructions(fp4_native={"tcgen05.mma kind::mxf4nvf4": 1}))
    assert verdicts("sm120", "tl.dot", {}, fp4, SM120_LIMIT)[0].startswith("wrong_fp4")
    assert verdicts("sm100", "tl.dot", {}, fp4, SM120_LIMIT) == []


def test_markdown_names_failing_configs():
    row = Row("sm120", "moe_gemm1_kernel", {"H": 6144, "I": 256, "BN": 64, "BM": 64, "BK": 128, "W4A4": False},
              4, 2, origins=["tp8 w4a16 picked T=256", "tp8 w4a16 picked T=512"],
              configs=[{"role": "gemm1", "schedule": "grouped", "bn": 64, "bm": 64, "bk": 128, "num_warps": 4,
                        "num_stages": 2}], shapes=["tp8"], modes=["w4a16"], smem_limit=SM120_LIMIT)
    row.build = _build(registers=255, spill_store_bytes=16, spill_load_bytes=16).to_dict()
    row.problems = verdicts("sm120", "tl.dot", row.constexprs, _build(spill_store_bytes=16, spill_load_bytes=16), SM120_LIMIT)
    res = MatrixResult({"triton": "x", "date": "d", "shapes": [], "distinct_kernels": 1, "elapsed_s": 1.0,
                        "fresh_cache": True, "cpu_count": 2, "archs": ["sm120"]}, {"sm120": SM120_LIMIT}, [row])
    md = markdown(res.to_dict())
    assert "gemm1 (bn=64, bm=64, bk=128, num_warps=4, num_stages=2) (picker default): spill" in md
    assert "selected by the picker" in md
    assert "picked T=256..512 (2)" in md
    assert "| sm_120 (RTX PRO 6000 Blackwell) | 1 | 0 | 1 |" in md


# -- CLI validation: everything is checked before the first compile (no test here compiles anything) -------------

@pytest.fixture()
def no_compiling(monkeypatch):
    """Fails the test if the CLI reaches the compiler (the options must have been refused before)."""
    import glm5_fp4.sm120.matrix as M

    def refuse(**kw):
        raise AssertionError("compile-matrix compiled before validating its options")

    monkeypatch.setattr(M, "run_matrix", refuse)


QUICK = ["compile-matrix", "--picked-only", "--shapes", "tiny", "--arch", "sm120", "--modes", "w4a16", "--quiet"]


@pytest.mark.parametrize("what", ["out_is_a_file", "out_under_a_file", "gpu", "alt_gpu"])
def test_compile_matrix_refuses_bad_out_and_gpus_before_compiling(tmp_path, capsys, no_compiling, what):
    from glm5_fp4.cli import main

    afile = tmp_path / "afile"
    afile.write_text("keep me")
    argv = {"out_is_a_file": ["--out", str(afile)], "out_under_a_file": ["--out", str(afile / "sub")],
            "gpu": ["--out", str(tmp_path / "o"), "--gpu", "nosuch"],
            "alt_gpu": ["--out", str(tmp_path / "o"), "--alt-gpu", "nosuch"]}[what]
    assert main([*QUICK, *argv]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert (str(afile) in err) if what.startswith("out") else ("nosuch" in err and f"--{what.replace('_', '-')}" in err)
    assert afile.read_text() == "keep me" and not (tmp_path / "o").exists()


@pytest.mark.parametrize("option", ["--arch", "--shapes", "--modes"])
@pytest.mark.parametrize("value", ["", ",", " , "])
def test_compile_matrix_empty_selection_is_a_usage_error(capsys, no_compiling, option, value):
    from glm5_fp4.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["compile-matrix", "--strict", option, value])
    assert exc.value.code == 2 and option in capsys.readouterr().err


def test_compile_matrix_jobs_must_be_positive(capsys, no_compiling):
    from glm5_fp4.cli import main

    with pytest.raises(SystemExit) as exc:
        main([*QUICK, "--jobs", "0"])
    assert exc.value.code == 2 and "--jobs" in capsys.readouterr().err


def test_compile_matrix_that_compiled_no_kernel_is_an_error_not_a_pass(tmp_path, capsys, monkeypatch):
    """Whatever the selection, a run that compiled nothing checked nothing: --strict must not read it as a pass."""
    import glm5_fp4.sm120.matrix as M
    from glm5_fp4.cli import main

    monkeypatch.setattr(M, "run_matrix", lambda **kw: MatrixResult({"archs": ["sm120"], "distinct_kernels": 0,
                                                                     "elapsed_s": 0.0}, {"sm120": SM120_LIMIT}, []))
    assert main([*QUICK, "--strict", "--out", str(tmp_path / "o")]) == 1
    assert "no kernel" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_a_kernel_the_compiler_could_not_build_fails_the_run(tmp_path, capsys, monkeypatch):
    """A compiler exception is a row verdict ("error") in the report, but a run that could not check a kernel has
    partly failed: exit 1 with or without --strict (it used to exit 0 without it)."""
    import glm5_fp4.sm120.matrix as M
    from glm5_fp4.cli import main

    real = M.compile_specialized
    calls = []

    def flaky(sp):
        calls.append(sp)
        if len(calls) == 1:
            raise RuntimeError("ptxas died")
        return real(sp)

    monkeypatch.setattr(M, "compile_specialized", flaky)
    assert main([*QUICK, "--jobs", "1", "--out", str(tmp_path / "o")]) == 1
    out = capsys.readouterr()
    assert "1 kernel(s) could not be compiled" in out.err and "ptxas died" in out.err, out
    assert (tmp_path / "o").exists()  # the report of what was checked is still written


def test_a_target_named_twice_is_compiled_and_reported_once():
    """--arch sm120,sm120 printed the summary twice and named each row's origins twice."""
    from glm5_fp4.sm120.cli import _csv

    assert _csv(("sm120", "sm100", "sm90"))("sm120,sm90,sm120") == ["sm120", "sm90"]


def test_markdown_header_says_what_ran():
    """A run for sm_120 and W4A16 alone was headed 'for sm_120, sm_100 and sm_90 ... W4A16 and W4A4', and a dirty
    tree's '-dirty' was cut off by the SHA's truncation."""
    res = MatrixResult({"triton": "x", "date": "d", "shapes": [], "distinct_kernels": 0, "elapsed_s": 1.0,
                        "fresh_cache": True, "cpu_count": 2, "archs": ["sm120"], "modes": ["w4a16"],
                        "git_sha": "c0082289eb89" + "0" * 28 + "-dirty"}, {"sm120": SM120_LIMIT}, [])
    head = "\n".join(markdown(res.to_dict()).splitlines()[:4])
    assert "for sm_120" in head and "sm_100" not in head and "sm_90" not in head, head
    assert "W4A16" in head and "W4A4" not in head, head
    assert "c0082289eb89-dirty" in head, head
