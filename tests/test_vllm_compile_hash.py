"""vLLM keys its compile cache (and AOT-compiled bytecode) by its config's hash, which covers ``additional_config``
but not our environment variables: a server started with GLM5_FP4_BACKEND / GLM5_FP4_EXPERT_LAYOUT set by hand
(not through ``glm5-fp4 serve``, which writes the backend into --additional-config) would reuse a graph compiled
for other weights. Where the plugin resolves its settings, what changes the compiled model goes into the hash."""

from __future__ import annotations

import pytest

from glm5_fp4.envvars import VARS

vllm_config = pytest.importorskip("vllm.config")


def _hash_after_settings(monkeypatch, env: dict[str, str], additional: dict | None = None) -> str:
    from glm5_fp4.engines.vllm import settings

    for name in VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = vllm_config.VllmConfig(additional_config=dict(additional or {}))
    with vllm_config.set_current_vllm_config(config):
        settings.current()
    return config.compute_hash()


@pytest.mark.parametrize("env", [{"GLM5_FP4_BACKEND": "dequant"}, {"GLM5_FP4_MODE": "w4a4"},
                                 {"GLM5_FP4_EXPERT_LAYOUT": "split"}, {"GLM5_FP4_NATIVE_FP4": "1"}])
def test_an_environment_setting_changes_the_compile_hash(monkeypatch, env):
    assert _hash_after_settings(monkeypatch, env) != _hash_after_settings(monkeypatch, {})


def test_the_same_settings_keep_the_hash_whatever_their_spelling(monkeypatch):
    """The cache is still reused run to run, and a value spelled differently (True / on) is the same value."""
    a = _hash_after_settings(monkeypatch, {"GLM5_FP4_NATIVE_FP4": "1", "GLM5_FP4_BACKEND": "triton"})
    b = _hash_after_settings(monkeypatch, {"GLM5_FP4_NATIVE_FP4": "on", "GLM5_FP4_BACKEND": "TRITON"})
    assert a == b
    # what does not change the compiled model (where results go, how often the host is sampled) leaves it alone
    assert _hash_after_settings(monkeypatch, {"GLM5_FP4_SLOW_CALL_MS": "7", "GLM5_FP4_GIT_SHA": "abc"}) == \
        _hash_after_settings(monkeypatch, {})


def test_the_users_additional_config_is_kept(monkeypatch):
    from glm5_fp4.engines.vllm import settings

    config = vllm_config.VllmConfig(additional_config={"glm5_fp4": {"backend": "dequant"}, "other": 1})
    with vllm_config.set_current_vllm_config(config):
        first = settings.current()
        again = settings.current()  # what was folded in reads back as the same settings
    assert first.backend == again.backend == "dequant" and first.source == again.source
    assert config.additional_config["glm5_fp4"] == {"backend": "dequant"} and config.additional_config["other"] == 1
