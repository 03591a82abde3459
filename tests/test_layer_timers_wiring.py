"""Engine wiring of the per-layer timers (glm5_fp4/engines/layer_timers.py) on a toy model shaped like vLLM's.

No server: the toy has what the wiring looks for (``model.layers.<i>`` with ``self_attn`` and ``mlp``,
``compute_logits`` through a ``logits_processor`` module). A sublayer that sleeps a random, known time is
the independent reference for the measured durations.
"""

from __future__ import annotations

import json
import random
import time

import pytest
import torch
from torch import nn

from glm5_fp4.engines import layer_timers as wiring
from glm5_fp4.profiling.layer_timers import LayerTimer, read_dumps, report_dir

HIDDEN = 16


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, positions, hidden_states):
        return self.proj(hidden_states)


class Experts(nn.Module):
    def __init__(self, sleep_s: float = 0.0):
        super().__init__()
        self.w = nn.Linear(HIDDEN, HIDDEN)
        self.sleep_s = sleep_s

    def forward(self, x):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.w(x)


class MoE(nn.Module):
    def __init__(self, sleep_s: float = 0.0):
        super().__init__()
        self.experts = Experts(sleep_s)

    def forward(self, x):
        return self.experts(x)


class DenseMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.gate_up_proj(x)


class DecoderLayer(nn.Module):
    def __init__(self, dense: bool, sleep_s: float = 0.0):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attn = Attention()
        self.mlp = DenseMlp() if dense else MoE(sleep_s)

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states if residual is None else hidden_states + residual
        h = self.self_attn(positions=positions, hidden_states=self.input_layernorm(residual))
        return self.mlp(h), residual


class Inner(nn.Module):
    def __init__(self, n_layers: int, first_dense: int, sleepy: int | None, sleep_s: float):
        super().__init__()
        self.embed_tokens = nn.Embedding(32, HIDDEN)
        # a pipeline stand-in (no self_attn/mlp) must not be taken for a decoder layer
        self.layers = nn.ModuleList([DecoderLayer(i < first_dense, sleep_s if i == sleepy else 0.0)
                                     for i in range(n_layers)] + [nn.Identity()])

    def forward(self, ids):
        h, residual = self.embed_tokens(ids), None
        for layer in self.layers[:-1]:
            h, residual = layer(ids, h, residual)
        return h + residual


class LogitsProcessor(nn.Module):
    def forward(self, lm_head, hidden_states):
        return hidden_states @ lm_head.weight.T


class ToyForCausalLM(nn.Module):
    def __init__(self, n_layers=4, first_dense=1, sleepy=None, sleep_s=0.0):
        super().__init__()
        self.model = Inner(n_layers, first_dense, sleepy, sleep_s)
        self.lm_head = nn.Linear(HIDDEN, 32, bias=False)
        self.logits_processor = LogitsProcessor()

    def forward(self, ids):
        return self.model(ids)

    def compute_logits(self, hidden_states):
        return self.logits_processor(self.lm_head, hidden_states)


def step(model, n_tokens=3, sampled=None):
    """One engine step: the layers run ``n_tokens`` rows, the logits ``sampled`` of them (vLLM samples one row per
    request: a prefill's last token)."""
    ids = torch.randint(0, 32, (n_tokens,))
    with torch.no_grad():
        hidden = model(ids)
        return model.compute_logits(hidden if sampled is None else hidden[-sampled:])


def _dummy_sampler_run(model):  # same name as vLLM's sampler warm-up
    return step(model)


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def installer(monkeypatch, tmp_path):
    monkeypatch.setenv("GLM5_FP4_LAYER_TIMERS_OUT", str(tmp_path / "dumps"))
    inst = wiring._VllmInstaller()
    yield inst
    inst.uninstall()


def global_pre_hooks() -> int:
    return len(torch.nn.modules.module._global_forward_pre_hooks)


def test_decoder_layers_found_by_index_and_sublayers():
    model = ToyForCausalLM(n_layers=5, first_dense=2)
    layers = wiring.decoder_layers(model)
    assert [i for i, _ in layers] == [0, 1, 2, 3, 4]
    assert all(m is model.model.layers[i] for i, m in layers)


def test_vllm_installer_times_every_layer_each_step(installer, tmp_path):
    rng = random.Random(16)  # a fixed draw: the median below is over the steps, and 3 steps is too few
    n_layers, sleepy, sleep_s = 4, rng.randrange(1, 4), rng.uniform(0.004, 0.008)
    model = ToyForCausalLM(n_layers, first_dense=1, sleepy=sleepy, sleep_s=sleep_s)
    before = global_pre_hooks()
    installer.install()
    assert global_pre_hooks() == before + 1
    nn.Linear(2, 2)(torch.zeros(1, 2))  # an unrelated module call must not be taken for the model
    assert installer.recorder is None
    steps = rng.randint(5, 8)
    tokens = [rng.randint(2, 9) for _ in range(steps)]
    for t in tokens:
        step(model, n_tokens=t, sampled=1)
    assert global_pre_hooks() == before  # removed itself at the model's first forward
    recs = records(tmp_path / "dumps" / "rank0.jsonl")
    assert len(recs) == steps and [r["step"] for r in recs] == list(range(1, steps + 1))
    for r in recs:
        regions = r["regions_us"]
        expected = []
        for i in range(n_layers):
            expected += [f"layer{i:02d}", f"layer{i:02d}/attention", f"layer{i:02d}/{'mlp' if i < 1 else 'moe'}"]
        assert list(regions) == expected + [wiring.ALL_LAYERS]
        assert all(v > 0 for v in regions.values())
        for i in range(n_layers):
            parts = [v for k, v in regions.items() if k.startswith(f"layer{i:02d}/")]
            assert regions[f"layer{i:02d}"] == pytest.approx(sum(parts))
        assert regions[wiring.ALL_LAYERS] == pytest.approx(sum(regions[f"layer{i:02d}"] for i in range(n_layers)))
        assert regions[f"layer{sleepy:02d}/moe"] >= sleep_s * 1e6  # the sleeping experts, against time.sleep
    assert [r["rows"] for r in recs] == [1] * steps and [r["tokens"] for r in recs] == tokens
    # the other regions far below the sleep (median over steps: a shared 2-core box has hiccups)
    medians = read_dumps([tmp_path / "dumps" / "rank0.jsonl"]).summary()
    others = [row["median_us"] for row in medians if row["region"].endswith("/attention")]
    assert max(others) < sleep_s * 1e6 / 2


def test_vllm_warmup_logits_are_not_recorded(installer, tmp_path):
    model = ToyForCausalLM()
    installer.install()
    _dummy_sampler_run(model)
    _dummy_sampler_run(model)
    path = tmp_path / "dumps" / "rank0.jsonl"
    assert path.read_text() == "" and installer.recorder.skipped == 2
    step(model)
    assert len(records(path)) == 1


def test_model_without_decoder_layers_is_left_alone(installer, tmp_path):
    class NoLayers(ToyForCausalLM):
        def __init__(self):
            super().__init__()
            self.model.layers = nn.ModuleList([nn.Identity()])

        def forward(self, ids):
            return self.model.embed_tokens(ids)

    installer.install()
    step(NoLayers())
    assert installer.recorder is None and installer.handle is None
    assert not (tmp_path / "dumps").exists()


def test_stamps_survive_torch_compile_after_instrumentation(tmp_path):
    """vLLM compiles the inner model after the first forward: the hooks' stamps must be in the compiled code."""
    torch._dynamo.reset()
    model = ToyForCausalLM(n_layers=3, first_dense=1)
    timer = LayerTimer("cpu")
    wiring.instrument(wiring.decoder_layers(model), timer)
    compiled = torch.compile(model.model, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, 32, (4,))
    with torch.no_grad():
        for _ in range(3):
            compiled(ids)
            regions = timer.read()
            assert list(regions) == ["layer00/attention", "layer00/mlp", "layer01/attention", "layer01/moe",
                                     "layer02/attention", "layer02/moe"]
            assert all(v > 0 for v in regions.values())


def test_report_from_engine_dumps(installer, tmp_path):
    model = ToyForCausalLM(n_layers=3)
    installer.install()
    for _ in range(5):
        step(model)
    paths = report_dir(tmp_path / "dumps", tmp_path / "report")
    assert {"json", "markdown", "png"} <= set(paths) and paths["png"].stat().st_size > 0
    summary = json.loads(paths["json"].read_text())
    layer_rows = [r for r in summary["regions"] if r["region"].startswith("layer") and "/" not in r["region"]]
    assert [r["region"] for r in layer_rows] == ["layer00", "layer01", "layer02"]
    assert all(r["n"] == 5 and r["p90_us"] >= r["median_us"] > 0 for r in layer_rows)
    assert "| layer01/moe |" in paths["markdown"].read_text()
    assert read_dumps([tmp_path / "dumps" / "rank0.jsonl"]).steps == 5


def test_report_dir_without_dumps_names_the_directory(tmp_path):
    from glm5_fp4.errors import Glm5Fp4Error

    with pytest.raises(Glm5Fp4Error, match="no layer-timer dumps"):
        report_dir(tmp_path)


def test_env_switch_for_both_plugins(monkeypatch):
    monkeypatch.delenv("GLM5_FP4_LAYER_TIMERS", raising=False)
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    assert wiring.install_vllm() is False and wiring.sglang_hooks() == {}
    assert "VLLM_DISABLE_COMPILE_CACHE" not in __import__("os").environ
    monkeypatch.setenv("GLM5_FP4_LAYER_TIMERS", "1")
    try:
        assert wiring.install_vllm() is True
        assert wiring.VLLM_INSTALLER.handle is not None
        assert __import__("os").environ["VLLM_DISABLE_COMPILE_CACHE"] == "1"
    finally:
        wiring.VLLM_INSTALLER.uninstall()
    assert set(wiring.sglang_hooks()) == {f"{wiring.SGLANG_MODEL_RUNNER}.load_model",
                                          f"{wiring.SGLANG_MODEL_RUNNER}.forward"}


def test_sglang_hooks_time_each_forward(monkeypatch, tmp_path):
    monkeypatch.setenv("GLM5_FP4_LAYER_TIMERS_OUT", str(tmp_path / "sg"))

    class Runner:  # what the hooks read of SGLang's ModelRunner
        model = ToyForCausalLM(n_layers=2)

    class Mode:
        name = "DECODE"

    class Batch:
        batch_size = 2
        input_ids = torch.zeros(2, dtype=torch.long)
        forward_mode = Mode()

    runner = Runner()
    wiring.sglang_after_load_model(None, runner)
    for _ in range(3):
        step(runner.model, n_tokens=2)
        wiring.sglang_after_forward(None, runner, Batch())
    recs = records(tmp_path / "sg" / "rank0.jsonl")
    assert len(recs) == 3 and all(r["rows"] == 2 and r["regions_us"]["layer01/moe"] > 0 for r in recs)
    assert all(r["tokens"] == 2 and r["phase"] == "DECODE" for r in recs)


def test_stamps_are_ordered_after_the_hidden_states_not_the_positions():
    """vLLM's GLM-5 layer calls self_attn(positions, hidden_states, ...) positionally: a stamp anchored on positions
    (ready from the step's start) was hoisted above the previous layer's MoE by Inductor on the H200."""
    positions = torch.arange(4)
    hidden = torch.randn(4, HIDDEN)
    assert wiring._hidden((positions, hidden, None), {}) is hidden
    assert wiring._hidden((positions,), {"hidden_states": hidden}) is hidden
    assert wiring._hidden((hidden,), {}) is hidden  # mlp(x)
    assert wiring._hidden((positions,), {}) is positions  # no float tensor: still something to order after
    assert wiring._hidden((), {}) is None
