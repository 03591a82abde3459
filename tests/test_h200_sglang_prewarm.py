"""The SGLang JIT pre-warm (benchmarks/h200_sglang/prewarm_jit.py) and the gate that makes stock servers wait for it
(benchmarks/h200/fleet.py PrewarmGate): which modules, named as SGLang 0.5.15 names them; the status file; the
bounded wait (done, died, late, absent); ours never waits."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks" / "h200_sglang"), str(ROOT / "benchmarks" / "h200")]

import prewarm_jit  # noqa: E402
from fleet import PrewarmGate, SglangSpec, needs_prewarm  # noqa: E402

SRC_0515 = os.environ.get("GLM5_FP4_SGLANG0515_SRC") or str(ROOT / ".cache" / "sglang-0.5.15")


def test_builders_exist_in_sglang_0515():
    """Each module's builder is a cache_once function of 0.5.15's jit_kernel (a rename shows here, not on the GPU)."""
    if not (Path(SRC_0515) / "sglang" / "jit_kernel").is_dir():
        pytest.skip("set GLM5_FP4_SGLANG0515_SRC to unpacked sglang-0.5.15 sources (make test does)")
    for name, (module, fn, _why) in prewarm_jit.MODULES.items():
        tree = ast.parse((Path(SRC_0515) / (module.replace(".", "/") + ".py")).read_text())
        defs = {d.name: d for d in tree.body if isinstance(d, ast.FunctionDef)}
        assert fn in defs, (name, module, fn)
        assert any(getattr(d, "id", None) == "cache_once" for d in defs[fn].decorator_list), name
        assert len(defs[fn].args.args) <= 1, name  # dtype or nothing: what build_one passes
    # The two Marlin GEMMs the first H200 run waited on, and which one only the glm5 recipe needs
    assert "moe_wna16_marlin" in prewarm_jit.wanted(False) and "gptq_marlin" not in prewarm_jit.wanted(False)
    assert "gptq_marlin" in prewarm_jit.wanted(True)


def _spec(name, backend, quant="modelopt_fp4"):
    return SglangSpec(name, Path("/m"), backend, quant)


def test_only_stock_nvfp4_servers_wait():
    assert needs_prewarm(_spec("marlin", "marlin"))
    assert not needs_prewarm(_spec("ours", "glm5_fp4"))
    assert not needs_prewarm(_spec("bf16", "auto", "none"))


def _status(path: Path, state: str, pid: int) -> None:
    prewarm_jit.write_status(path, {"state": state, "pid": pid, "modules": {}})


def test_gate_waits_until_done(tmp_path):
    status = tmp_path / "prewarm.json"
    _status(status, "running", os.getpid())
    seen = []
    gate = PrewarmGate(30, status, poll_s=0.05, on_record=seen.append)
    gate(_spec("ours", "glm5_fp4"))  # ours: no wait, nothing recorded
    assert gate.record is None
    threading.Timer(0.3, lambda: _status(status, "done", os.getpid())).start()
    t = time.monotonic()
    gate(_spec("marlin", "marlin"))
    assert 0.2 < time.monotonic() - t < 5 and gate.record["state"] == "done" and seen == [gate.record]
    t = time.monotonic()
    gate(_spec("marlin2", "marlin"))  # once only
    assert time.monotonic() - t < 0.1


def test_gate_ends_when_absent_died_or_late(tmp_path):
    status = tmp_path / "prewarm.json"
    gate = PrewarmGate(30, status, poll_s=0.05)
    gate(_spec("marlin", "marlin"))
    assert gate.record["state"] == "absent" and gate.record["waited_s"] < 1
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _status(status, "running", dead.pid)
    gate = PrewarmGate(30, status, poll_s=0.05)
    gate(_spec("marlin", "marlin"))
    assert gate.record["state"] == "died"
    _status(status, "running", os.getpid())
    gate = PrewarmGate(0.3, status, poll_s=0.05)
    gate(_spec("marlin", "marlin"))
    assert gate.record["state"] == "late" and gate.record["waited_s"] >= 0.3


def test_background_start_writes_status_and_reports_no_gpu(tmp_path):
    """--background returns at once with state running; the child records why it could not build (no CUDA here)."""
    status = tmp_path / "prewarm.json"
    t = time.monotonic()
    rc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "h200_sglang" / "prewarm_jit.py"), "--background",
                         "--status", str(status)], timeout=60).returncode
    assert rc == 0 and time.monotonic() - t < 30
    assert json.loads(status.read_text())["state"] in ("running", "done")
    deadline = time.monotonic() + 60
    while json.loads(status.read_text())["state"] != "done" and time.monotonic() < deadline:
        time.sleep(0.2)
    got = json.loads(status.read_text())
    assert got["state"] == "done"
    if "error" in got:  # a CPU machine: nothing built, said why
        assert "CUDA" in got["error"]
    assert (tmp_path / "prewarm.log").is_file()


def test_seed_copies_prebuilt_modules_once(tmp_path):
    """Prebuilt .so files land under their own content-addressed folder names, never over one already there."""
    src, dst = tmp_path / "seed", tmp_path / "cache"
    (src / "sgl_kernel_jit_moe_wna16_marlin_bf16_abc__arch_9.0__tvmffi_0.1.11").mkdir(parents=True)
    so = src / "sgl_kernel_jit_moe_wna16_marlin_bf16_abc__arch_9.0__tvmffi_0.1.11" / "sgl_kernel_jit_moe_wna16_marlin_bf16_abc.so"
    so.write_bytes(b"\x7fELF")
    (src / "built.json").write_text("{}")
    assert prewarm_jit.seed(src, dst) == [f"{so.parent.name}/{so.name}"]
    assert (dst / so.parent.name / so.name).read_bytes() == b"\x7fELF"
    assert prewarm_jit.seed(src, dst) == [] and prewarm_jit.seed(tmp_path / "absent", dst) == []
    env = {**os.environ, "TVM_FFI_CACHE_DIR": str(tmp_path / "cache2")}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "h200_sglang" / "prewarm_jit.py"), "--seed-only",
                          "--seed-from", str(src)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and (tmp_path / "cache2" / so.parent.name / so.name).is_file(), out.stdout + out.stderr
