"""The mma.sync stand-in's plumbing (glm5_fp4/bench/mma.py) and the side-by-side table script: that Triton's
DISABLE_MMA_V3 really turns sm_90's wgmma into mma.sync (compiled ahead of time here, no GPU), that the cache scan
reads what was built, and that benchmarks/moe_tables_compare.py lines up rows and says what is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glm5_fp4.bench import mma

ROOT = Path(__file__).resolve().parents[1]

_COMPILE = """
from glm5_fp4.kernels import configs as C
from glm5_fp4.sm120.aot import compile_gemm1
compile_gemm1(C.Gemm1Config(64, 32, 128, 4, 2), 90, 512, 128)
"""


def _compile_in(cache: Path, force: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != mma.MMA_SYNC_ENV}
    env["TRITON_CACHE_DIR"] = str(cache)
    if force:
        env[mma.MMA_SYNC_ENV] = "1"
    subprocess.run([sys.executable, "-c", _COMPILE], env=env, cwd=ROOT, check=True, capture_output=True, timeout=600)
    return mma.cached_mma(cache)


def test_the_variable_turns_wgmma_into_mma_sync(tmp_path):
    pytest.importorskip("triton")
    plain = _compile_in(tmp_path / "plain", force=False)
    forced = _compile_in(tmp_path / "forced", force=True)
    assert list(plain) == list(forced) == ["moe_gemm1_kernel"]
    assert all(f.startswith("wgmma") for f in plain["moe_gemm1_kernel"]), plain
    assert forced["moe_gemm1_kernel"] == ["mma.sync m16n8k16 f16"]
    assert mma.wgmma_kernels(plain) == ["moe_gemm1_kernel"] and mma.wgmma_kernels(forced) == []


def test_cache_scan_skips_kernels_without_a_dot(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "moe_finalize_kernel.ptx").write_text("ld.global.f32 %f1, [%rd1];\n")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "k.ptx").write_text(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2, %r3, %r4}, "
        "{%r5, %r6}, {%f5, %f6, %f7, %f8};\n")
    assert mma.cached_mma(tmp_path) == {"k": ["mma.sync m16n8k16 f16"]}


def test_force_uses_a_cache_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv(mma.MMA_SYNC_ENV, raising=False)
    assert not mma.mma_sync_forced()
    own = mma.force_mma_sync()
    assert own == tmp_path / "c-mma-sync" and os.environ["TRITON_CACHE_DIR"] == str(own)
    assert mma.mma_sync_forced()
    assert mma.force_mma_sync() == own  # a second call keeps the directory


def _table(path: Path, rows, **meta):
    path.write_text(json.dumps({"meta": {"gpu": "G", "copy_gbs": 4000.0, **meta}, "rows": rows}))
    return str(path)


def _row(t, routing, us, pct=50.0):
    return {"shard": "tp8", "tokens": t, "routing": routing, "us": us, "pct_copy_bw": pct}


def _compare(*args):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_tables_compare.py"), *args],
                          capture_output=True, text=True, timeout=60)


def test_tables_compare_lines_up_rows_and_ratios(tmp_path):
    a = _table(tmp_path / "a.json", [_row(1, "balanced", 20.0), _row(512, "same_k", 100.0)])
    b = _table(tmp_path / "b.json", [_row(512, "same_k", 150.0), {"shard": "tp8", "tokens": 1, "routing": "balanced",
                                                                   "error": "boom"}],
               mma="mma.sync (forced)", compiled_mma={"moe_gemm1_kernel": ["mma.sync m16n8k16 f16"]})
    r = _compare(a, b, "--labels", "A,B", "--md", str(tmp_path / "c.md"))
    assert r.returncode == 0, r.stderr
    lines = (tmp_path / "c.md").read_text().splitlines()
    assert "| tp8 | 512 | same_k | 100.0 (50 %) | 150.0 (50 %) | 1.50 |" in lines
    assert "| tp8 | 1 | balanced | 20.0 (50 %) | error | — |" in lines
    assert any(ln.startswith("- B:") and "mma.sync (forced)" in ln and "boom" in ln for ln in lines)


def test_tables_compare_names_what_it_cannot_read(tmp_path):
    a = _table(tmp_path / "a.json", [_row(1, "balanced", 20.0)])
    r = _compare(a, str(tmp_path / "missing.json"))
    assert r.returncode == 1 and "missing.json: missing" in r.stderr and "| tp8 | 1 |" in r.stdout
    (tmp_path / "bad.json").write_text("{not json")
    r = _compare(a, str(tmp_path / "bad.json"))
    assert r.returncode == 1 and "bad.json: not a readable" in r.stderr and "Traceback" not in r.stderr
    r = _compare(a, a, "--labels", "only-one")
    assert r.returncode == 2 and "1 labels for 2 tables" in r.stderr
