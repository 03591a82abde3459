"""The user's hardware file (GLM5_FP4_HARDWARE) off the happy path: an entry that overrides a built-in GPU keeps the
fields it does not give and wins device matching, an arch override reaches the GPUs that inherit its figures, and
every malformed file, value or name is one error naming the file, the entry and the field."""

from __future__ import annotations

import pytest

from glm5_fp4 import hardware as H
from glm5_fp4.errors import Glm5Fp4Error

MINE = ("gpus:\n  {name}:\n    display_name: My GPU\n    arch: sm_120\n    compute_capability: [12, 0]\n"
        "    sm_count: 188\n    memory_gb: 96\n    mem_bandwidth_gbs: 1792\n    allreduce_bus_bandwidth_gbs: 38\n"
        "    allreduce_latency_us: 24\n    p2p_bandwidth_gbs: 55\n"
        "    peaks_tflops: {{nvfp4: {{dense: 2015}}, bf16: {{dense: 503.8}}}}\n    source: me\n")


@pytest.fixture
def hw(tmp_path, monkeypatch):
    def write(text: str, name: str = "gpus.yaml"):
        f = tmp_path / name
        f.write_text(text)
        monkeypatch.setenv(H.ENV_VAR, str(f))
        return f
    return write


def test_an_override_keeps_the_fields_it_does_not_give(hw):
    """Before: the override replaced the whole entry, so 'display_name' was required, and with it given the
    built-in device_names went: 'NVIDIA H200' traces no longer found their GPU."""
    builtin = H.get_gpu("h200")
    hw("gpus:\n  h200:\n    mem_bandwidth_gbs: 4000\n")
    mine = H.get_gpu("h200")
    assert mine.mem_bandwidth_gbs == 4000
    assert mine.device_names == builtin.device_names and mine.measured_copy_bandwidth_gbs == \
        builtin.measured_copy_bandwidth_gbs and mine.peaks_tflops == builtin.peaks_tflops
    assert H.detect_gpu_name("NVIDIA H200") == "h200"


def test_the_users_entry_wins_device_matching(hw):
    """Before: an overridden key kept its built-in place, and the built-in entry after it claimed the device."""
    hw("gpus:\n  rtx-pro-6000-ws:\n    display_name: NVIDIA RTX PRO 6000 Blackwell Server Edition\n"
       "    mem_bandwidth_gbs: 1500\n")
    assert H.detect_gpu_name("NVIDIA RTX PRO 6000 Blackwell Server Edition") == "rtx-pro-6000-ws"
    hw(MINE.format(name="my-h200").replace("display_name: My GPU", "display_name: NVIDIA H200"), "b.yaml")
    assert H.detect_gpu_name("nvidia  h200") == "my-h200"


def test_an_arch_override_reaches_the_gpus_that_inherit_it(hw):
    """Before: built-in GPUs kept the built-in arch's shared memory while smem_limit gave the user's."""
    hw("archs:\n  sm120:\n    smem_per_block_optin_bytes: 65536\n    sm_count_guess: 188\n    source: m\n")
    assert H.smem_limit("sm120") == 65536 == H.get_gpu("rtx-pro-6000-ws").smem_per_block_bytes


@pytest.mark.parametrize(("edit", "field"), [
    (("allreduce_latency_us: 24", "allreduce_latency_us: -1000"), "allreduce_latency_us"),
    (("allreduce_bus_bandwidth_gbs: 38", "allreduce_bus_bandwidth_gbs: 0"), "allreduce_bus_bandwidth_gbs"),
    (("p2p_bandwidth_gbs: 55", "p2p_bandwidth_gbs: 0"), "p2p_bandwidth_gbs"),
    (("bf16: {dense: 503.8}", "bf16: {dense: 0}"), "peaks_tflops.bf16.dense"),
    (("bf16: {dense: 503.8}", "bf16: {dense: 503.8, sparse: -1}"), "peaks_tflops.bf16.sparse"),
    (("mem_bandwidth_gbs: 1792", "mem_bandwidth_gbs: .inf"), "mem_bandwidth_gbs"),
    (("memory_gb: 96", "memory_gb: 1e300"), "memory_gb"),
    (("memory_gb: 96", "memory_gb: .nan"), "memory_gb"),
    (("nvfp4: {dense: 2015}", "fp4: {dense: 2015}"), "peaks_tflops"),
    (("nvfp4: {dense: 2015}", "NVFP4: {dense: 2015}"), "peaks_tflops"),
])
def test_a_value_no_gpu_can_have_names_file_gpu_and_field(hw, edit, field):
    f = hw(MINE.format(name="mygpu").replace(*edit))
    with pytest.raises(Glm5Fp4Error) as e:
        H.get_gpu("mygpu")
    assert str(f) in str(e.value) and "'mygpu'" in str(e.value) and f"'{field}" in str(e.value)


@pytest.mark.parametrize(("text", "said"), [
    ('gpus:\n  mygpu: "see wiki"\n', "gpu 'mygpu' must be a mapping"),
    ("gpus:\n  mygpu:\n    - 1\n", "gpu 'mygpu' must be a mapping"),
    ("archs: {}\ngpus:\n  - mygpu\n", "'gpus' must be a mapping"),
    ("archs:\n  - sm89\n", "'archs' must be a mapping"),
    ("gpus: {}\nGPUs: {}\n", "unknown top-level key 'GPUs'"),
    (MINE.format(name="mygpu") + "  mygpu:\n    memory_gb: 1\n", "'mygpu' is given twice"),
])
def test_a_malformed_file_is_one_error(hw, text, said):
    f = hw(text)
    with pytest.raises(Glm5Fp4Error) as e:
        H.list_gpus()
    assert str(f) in str(e.value) and said in str(e.value)


def test_a_folder_for_a_file_is_one_error(tmp_path, monkeypatch):
    monkeypatch.setenv(H.ENV_VAR, str(tmp_path))
    with pytest.raises(Glm5Fp4Error, match="is a folder, not a hardware file"):
        H.list_gpus()


def test_an_entry_is_selected_by_the_name_it_lists_as(hw):
    """Before: 'My_GPU' was listed among the known GPUs and could not be selected by that name."""
    hw(MINE.format(name="My_GPU"))
    assert "my-gpu" in H.list_gpus()
    assert H.get_gpu("My_GPU").display_name == "My GPU" == H.get_gpu("my-gpu").display_name


def test_an_entry_spelled_like_a_builtin_overrides_it(hw):
    """Before: 'H200' was a second entry that --gpu H200 never reached (the built-in h200 answered)."""
    hw("gpus:\n  H200:\n    mem_bandwidth_gbs: 4000\n")
    assert H.get_gpu("H200").mem_bandwidth_gbs == 4000 and H.list_gpus().count("h200") == 1


def test_a_new_entry_still_needs_its_fields(hw):
    f = hw("gpus:\n  newgpu:\n    mem_bandwidth_gbs: 4000\n")
    with pytest.raises(Glm5Fp4Error) as e:
        H.list_gpus()
    assert str(f) in str(e.value) and "'newgpu'" in str(e.value) and "'display_name'" in str(e.value)


def test_an_override_of_memory_or_one_peak_means_what_it_says(hw):
    """Review: `memory_gb: 96` over the H200 kept the built-in driver figure, which plan prefers (no effect); one
    dtype under peaks_tflops replaced every other dtype's peak (plan then found no bf16 peak)."""
    hw("gpus:\n  h200:\n    memory_gb: 96\n    peaks_tflops: {fp8: {dense: 1500}}\n")
    g = H.get_gpu("h200")
    assert g.memory_gb == 96 and g.memory_total_bytes is None
    assert g.peak_tflops("fp8") == 1500 and g.peak_tflops("fp8", sparse=True) == 3958 and g.peak_tflops("bf16") == 989
