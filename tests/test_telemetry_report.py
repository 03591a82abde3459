"""Report rendering: the PNG really shows each GPU's lines, the markdown tables hold the numbers."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from glm5_fp4.telemetry import TelemetrySampler
from glm5_fp4.telemetry.fake_nvml import FakeNvml, SwitchedPower
from glm5_fp4.telemetry.report import render_report, summary_markdown
from glm5_fp4.telemetry.series import MARKDOWN_FILE, PNG_FILE, SUMMARY_FILE

matplotlib_image = pytest.importorskip("matplotlib.image")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    curves = [SwitchedPower(idle_w=80, load_w=600), SwitchedPower(idle_w=60, load_w=450)]
    fake = FakeNvml(n_gpus=2, curves=curves)
    with TelemetrySampler(out, interval_s=0.02, nvml=fake) as s:
        s.mark("warmup")
        time.sleep(0.15)
        s.mark("measure")
        for c in curves:
            c.switch(True, fake.elapsed())
        time.sleep(0.3)
        s.mark("cooldown")
        for c in curves:
            c.switch(False, fake.elapsed())
        time.sleep(0.15)
    return out


def _colour_pixels(img: np.ndarray, hex_colour: str) -> int:
    rgb = np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)]) / 255.0
    return int((np.abs(img[..., :3] - rgb).max(axis=-1) < 0.02).sum())


def test_png_shows_a_line_per_gpu(run_dir):
    files = render_report(run_dir, tokens=1000)
    assert files.png_path == run_dir / PNG_FILE
    assert files.png_path.stat().st_size > 20_000
    img = matplotlib_image.imread(files.png_path)
    h, w = img.shape[:2]
    assert w >= 800 and h >= 500
    # matplotlib's first two cycle colours: GPU 0 and GPU 1, in both panels
    assert _colour_pixels(img, "#1f77b4") > 500
    assert _colour_pixels(img, "#ff7f0e") > 500
    assert len(np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 50


def test_markdown_tables(run_dir):
    files = render_report(run_dir, tokens=1000)
    md = files.markdown_path.read_text()
    assert files.markdown_path == run_dir / MARKDOWN_FILE
    assert "![GPU power and SM clock](telemetry.png)" in md
    assert "tokens/J" in md and "Tokens 1,000" in md
    gpu_rows = [line for line in md.splitlines() if line.startswith("| 0 Fake GPU") or line.startswith("| 1 Fake GPU")]
    assert len(gpu_rows) == 2
    phase_rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    for name in ("warmup", "measure", "cooldown"):
        assert name in phase_rows
    # the measure phase's median power per GPU is the fake's load plateau
    assert "600 / 450" in phase_rows["measure"]
    assert "80 / 60" in phase_rows["warmup"]
    assert (run_dir / SUMMARY_FILE).is_file()
    assert files.summary["tokens"] == 1000


def test_phase_report(run_dir):
    files = render_report(run_dir, phase="measure", plot=False)
    assert files.summary["window"]["phase"] == "measure"
    assert "phase `measure`" in files.markdown_path.read_text()
    assert files.png_path is None


def test_no_telemetry_report(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with TelemetrySampler(tmp_path):
        pass
    files = render_report(tmp_path, tokens=5)
    assert files.png_path is None and not (tmp_path / PNG_FILE).exists()
    text = files.markdown_path.read_text()
    assert "no GPU telemetry" in text and "nvidia-ml-py" in text
    assert summary_markdown({}).count("no GPU telemetry") == 1
