"""Which hardware-table entry a CUDA device name is: only the part the entry describes, never a lookalike."""

import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.hardware import detect_gpu_name, load_gpus

# torch.cuda.get_device_name of the parts the table describes
REAL = [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "rtx-pro-6000-ws"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx-pro-6000-server"),
    ("nvidia  h200", "h200"),  # case and spacing are no part of the name
]
# other parts whose names contain, or are contained in, one of those: other peaks, bandwidth and SM counts
OTHERS = [
    "NVIDIA H20",
    "NVIDIA GH200 480GB",
    "NVIDIA H200 NVL",
    "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
    "NVIDIA GB200",
    "NVIDIA H100 PCIe",
    "NVIDIA H100 NVL",
    "NVIDIA",
    "",
]


@pytest.mark.parametrize("device_name, want", REAL)
def test_the_names_real_devices_report_find_their_entry(device_name, want):
    assert detect_gpu_name(device_name) == want


@pytest.mark.parametrize("device_name", OTHERS)
def test_a_lookalike_name_finds_no_entry(device_name):
    """Substring matching gave 'NVIDIA H20' and 'NVIDIA GH200 480GB' the H200's ceilings, 'NVIDIA GB200' the B200's:
    a name that is no entry's falls through to `profile analyze`'s "pass --gpu"."""
    assert detect_gpu_name(device_name) is None


GPU = ("gpus:\n  {key}:\n    display_name: {display}\n    arch: sm_90\n    compute_capability: [9, 0]\n"
       "    sm_count: 78\n    memory_gb: 96\n    mem_bandwidth_gbs: 4000\n    peaks_tflops: {{}}\n    source: s\n{extra}")


def test_a_users_entry_names_its_devices(tmp_path, monkeypatch):
    f = tmp_path / "gpus.yaml"
    f.write_text(GPU.format(key="h20", display="NVIDIA H20 (HGX)", extra="    device_names: [NVIDIA H20]\n"))
    monkeypatch.setenv("GLM5_FP4_HARDWARE", str(f))
    assert detect_gpu_name("NVIDIA H20") == "h20" and detect_gpu_name("NVIDIA H20 (HGX)") == "h20"
    assert detect_gpu_name("NVIDIA H200") == "h200"  # the built-ins keep theirs


def test_device_names_not_a_list_are_named(tmp_path):
    f = tmp_path / "gpus.yaml"
    f.write_text(GPU.format(key="h20", display="X", extra="    device_names: NVIDIA H20\n"))
    with pytest.raises(Glm5Fp4Error, match=rf"{f}: gpu 'h20', field 'device_names'"):
        load_gpus(str(f))


def test_two_entries_claiming_one_device_are_refused(tmp_path):
    f = tmp_path / "gpus.yaml"
    one = GPU.format(key="a", display="A", extra="    device_names: [NVIDIA Z9]\n")
    two = GPU.format(key="b", display="NVIDIA Z9", extra="").removeprefix("gpus:\n")
    f.write_text(one + two)
    with pytest.raises(Glm5Fp4Error, match=rf"{f}: .*'a' and 'b'.*'NVIDIA Z9'"):
        load_gpus(str(f))
