"""Bad input fails at load inside real vLLM with one clear message naming the checkpoint tensor.

The launcher's pre-flight (``check=True``) would catch both before vLLM starts; these run with it off to
prove vLLM itself, with the plugin, fails cleanly (the path users of plain ``vllm serve`` take).
"""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from glm5_fp4.errors import Glm5Fp4Error

pytestmark = pytest.mark.server

BAD_TENSOR = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def expert_shape_mismatch(checkpoints, tmp_path_factory):
    """The tiny GLM-4.5 NVFP4 checkpoint with one expert's up_proj 32 rows short of moe_intermediate_size."""
    bad = tmp_path_factory.mktemp("bad") / "glm4moe-short-expert"
    shutil.copytree(checkpoints["glm4moe"], bad)
    tensors = load_file(bad / "model.safetensors")
    assert tensors[BAD_TENSOR].shape == (128, 128)
    tensors[BAD_TENSOR] = tensors[BAD_TENSOR][:96].contiguous()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    return bad


def _fails_with(pool, key, model) -> str:
    with pytest.raises(Glm5Fp4Error) as info:
        pool.start(key, model, quantization="glm5_nvfp4")
    pool.stop_active()
    return str(info.value)


def test_expert_shape_mismatch_names_the_tensor(pool, expert_shape_mismatch):
    msg = _fails_with(pool, "bad-expert-shape", expert_shape_mismatch)
    assert (f"checkpoint tensor {BAD_TENSOR} is uint8 (packed NVFP4) [96, 128], expected uint8 (packed NVFP4) "
            "[128, 128] (config.json: hidden_size=256, moe_intermediate_size=128)") in msg


def test_a_bf16_checkpoint_served_as_glm5_nvfp4_names_a_tensor(pool, checkpoints):
    msg = _fails_with(pool, "bad-not-nvfp4", checkpoints["glm4moe-bf16"])
    assert "checkpoint tensor " in msg and " is bfloat16 [" in msg and "expected uint8 (packed NVFP4)" in msg
    assert "declares no ModelOpt quantization config" in msg and "without --quantization glm5_nvfp4" in msg
