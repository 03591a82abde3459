"""`glm5-fp4 selftest` without a GPU: one clear message, exit status 2, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from glm5_fp4.cli import COMMANDS
from glm5_fp4.selftest import NO_GPU_EXIT

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_machine_gets_one_clear_message_and_exit_2(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this runs the same on GPU machines
    out = tmp_path / "report"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "glm5_fp4.cli", "selftest", "--out", str(out), "--quick"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == NO_GPU_EXIT == 2
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "no CUDA GPU" in lines[0] and "compile-matrix" in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not out.exists()


def test_commands_registered():
    assert COMMANDS["selftest"][0] == "glm5_fp4.selftest.cli"
    assert COMMANDS["compile-matrix"][0] == "glm5_fp4.sm120.cli"


def test_a_bad_out_is_refused_before_any_gpu_work(tmp_path):
    """--out that cannot hold the report is named at once, not after minutes of checks and benchmarks whose results
    would then be lost (the GPU check comes after it, so this runs the same on any machine)."""
    blocker = tmp_path / "report"
    blocker.write_text("a file, not a directory")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "glm5_fp4.cli", "selftest", "--out", str(blocker / "sub"), "--quick"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "--out" in proc.stderr and "exists and is not a directory" in proc.stderr and "Traceback" not in proc.stderr
    assert "no CUDA GPU" not in proc.stderr
