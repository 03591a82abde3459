"""GLM-5 spec (against the figures derived by hand in the reference notes) and the hardware table."""

import json

import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.hardware import arch_limits, get_gpu, list_gpus, load_gpus, sm_count_guess, smem_limit
from glm5_fp4.spec import GLM5, Glm5Spec


def test_glm5_parameter_counts_match_hand_derivation():
    # Hand-derived in shared/reference/glm5.md section 4.
    assert GLM5.moe_layers == 75 and GLM5.dense_layers == 3
    assert GLM5.expert_params == 3 * 6144 * 2048 == 37_748_736
    assert GLM5.attention_params == pytest.approx(165.0e6, rel=1e-3)
    assert GLM5.indexer_params == pytest.approx(9.4e6, rel=0.01)
    assert GLM5.routed_expert_params == pytest.approx(724.8e9, rel=1e-3)
    assert GLM5.total_params == pytest.approx(743.9e9, rel=1e-3)
    assert GLM5.routed_expert_params / GLM5.total_params == pytest.approx(0.974, abs=1e-3)
    assert GLM5.active_params_per_token == pytest.approx(40.8e9, rel=5e-3)


def test_glm5_bytes_and_kv():
    # Routed experts at TP8 in NVFP4: 724.8e9 * 9/16 / 8 = 50.96 GB per GPU.
    assert GLM5.routed_expert_bytes(tp=8) / 1e9 == pytest.approx(50.96, rel=1e-3)
    assert GLM5.kv_bytes_per_token(include_indexer=False) == 89_856
    assert GLM5.kv_bytes_per_token() == 89_856 + 78 * 132
    assert GLM5.expected_experts_touched(512) == pytest.approx(256, abs=0.5)
    assert GLM5.expected_experts_touched(32) == pytest.approx(163, abs=1)
    assert GLM5.expected_experts_touched(64) == pytest.approx(222, abs=1)
    assert GLM5.expected_experts_touched(1) == pytest.approx(8, abs=1e-9)


def test_spec_from_config_json(tmp_path):
    cfg = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 256,
           "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 16, "num_experts_per_tok": 4,
           "moe_intermediate_size": 128, "intermediate_size": 512, "kv_lora_rank": 512, "index_topk": 2048,
           "unrelated_key": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = Glm5Spec.from_config_json(tmp_path)
    assert spec.hidden_size == 256 and spec.num_layers == 3 and spec.moe_layers == 2
    assert spec.expert_params == 3 * 256 * 128
    cfg["num_experts_per_tok"] = 32
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Glm5Fp4Error, match="num_experts_per_tok"):
        Glm5Spec.from_config_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(Glm5Fp4Error, match="config.json: not valid JSON"):
        Glm5Spec.from_config_json(tmp_path)


def test_dense_attention_view_has_no_indexer():
    view = Glm5Spec(index_topk=None)
    assert view.indexer_params == 0
    assert view.kv_bytes_per_token() == 89_856


def test_hardware_table_dense_and_sparse():
    assert {"rtx-pro-6000-ws", "rtx-pro-6000-server", "h200", "b200"} <= set(list_gpus())
    rtx = get_gpu("rtx-pro-6000-ws")
    # NVIDIA's "4 PFLOPS FP4" is the sparse figure; dense is half.
    assert rtx.peak_tflops("nvfp4", sparse=True) == 4000
    assert rtx.peak_tflops("nvfp4") == pytest.approx(2015)
    assert rtx.smem_per_block_bytes == 101_376 and rtx.sm_count == 188
    assert get_gpu("RTX_PRO_6000_WS") == rtx
    h200 = get_gpu("h200")
    assert h200.peak_tflops("nvfp4") is None  # no FP4 tensor cores
    assert h200.ridge_flop_per_byte("bf16") == pytest.approx(989e12 / 4.8e12)
    for name in list_gpus():
        assert get_gpu(name).source, f"{name} has no source"
    with pytest.raises(Glm5Fp4Error, match="unknown GPU"):
        get_gpu("voodoo2")


def test_user_gpu_yaml(tmp_path, monkeypatch):
    f = tmp_path / "gpus.yaml"
    f.write_text("gpus:\n  my-gpu:\n    display_name: My GPU\n    arch: sm_89\n    compute_capability: [8, 9]\n"
                 "    sm_count: 128\n    memory_gb: 48\n    mem_bandwidth_gbs: 960\n    smem_per_block_bytes: 101376\n"
                 "    peaks_tflops: {fp8: {dense: 660, sparse: 1320}}\n    source: my datasheet\n")
    gpus = load_gpus(str(f))
    assert gpus["my-gpu"].peak_tflops("fp8", sparse=True) == 1320 and "h200" in gpus
    monkeypatch.setenv("GLM5_FP4_HARDWARE", str(f))
    assert get_gpu("my-gpu").mem_bandwidth_gbs == 960
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus:\n  broken:\n    display_name: X\n    arch: sm_89\n    compute_capability: [8, 9]\n"
                   "    sm_count: -1\n    memory_gb: 1\n    mem_bandwidth_gbs: 1\n    smem_per_block_bytes: 1\n"
                   "    peaks_tflops: {}\n    source: s\n")
    with pytest.raises(Glm5Fp4Error, match="broken.*sm_count"):
        load_gpus(str(bad))


# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability": opt-in shared memory per block
CUDA_GUIDE_SMEM_KB = {"sm80": 163, "sm90": 227, "sm100": 227, "sm120": 99}


@pytest.mark.parametrize("arch", sorted(CUDA_GUIDE_SMEM_KB))
def test_arch_limits(arch):
    assert smem_limit(arch) == CUDA_GUIDE_SMEM_KB[arch] * 1024
    assert smem_limit(arch.replace("sm", "sm_")) == smem_limit(arch.upper()) == smem_limit(arch)
    assert arch_limits(arch).source
    # the SM-count guess is a real GPU of that architecture where the table has one
    table = [g for g in map(get_gpu, list_gpus()) if g.arch.replace("_", "") == arch]
    if table:
        assert sm_count_guess(arch) in {g.sm_count for g in table}
        assert {g.smem_per_block_bytes for g in table} == {smem_limit(arch)}  # GPUs take their arch's
    with pytest.raises(Glm5Fp4Error, match="unknown GPU architecture 'sm75'"):
        arch_limits("sm75")


def test_user_file_adds_an_arch_its_gpus_inherit(tmp_path, monkeypatch):
    gpu = ("gpus:\n  ada:\n    display_name: Ada\n    arch: {arch}\n    compute_capability: [8, 9]\n"
           "    sm_count: 128\n    memory_gb: 48\n    mem_bandwidth_gbs: 960\n    peaks_tflops: {{}}\n    source: s\n")
    f = tmp_path / "gpus.yaml"
    f.write_text("archs:\n  sm89:\n    smem_per_block_optin_bytes: 101376\n    sm_count_guess: 128\n    source: guide\n"
                 + gpu.format(arch="sm_89"))
    assert load_gpus(str(f))["ada"].smem_per_block_bytes == 101376
    monkeypatch.setenv("GLM5_FP4_HARDWARE", str(f))
    assert sm_count_guess("sm89") == 128 and smem_limit("sm120") == 99 * 1024  # built-ins stay
    orphan = tmp_path / "orphan.yaml"
    orphan.write_text(gpu.format(arch="sm_75"))  # an arch the table does not know, no figure of its own
    with pytest.raises(Glm5Fp4Error, match="ada.*smem_per_block_bytes"):
        load_gpus(str(orphan))


@pytest.mark.parametrize("device_name, want", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),   # what torch names the lent H100 SXM (2026-12-07)
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 PCIe", None),              # another part (2 TB/s, 114 SMs): no entry rather than the SXM's peaks
    ("NVIDIA H100 NVL", None),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx-pro-6000-server"),
])
def test_device_names_map_to_their_own_entry(device_name, want):
    from glm5_fp4.hardware import detect_gpu_name

    assert detect_gpu_name(device_name) == want


def test_the_h100_sxm_entry():
    h100 = get_gpu("h100-sxm")
    assert h100.peak_tflops("nvfp4") is None and h100.peak_tflops("bf16") == pytest.approx(989.4)
    assert h100.mem_bandwidth_gbs == 3350 and h100.sm_count == 132
    assert h100.measured_copy_bandwidth_gbs < h100.mem_bandwidth_gbs
