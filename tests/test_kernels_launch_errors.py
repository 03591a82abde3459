"""A GPU that refuses a compiled kernel (Triton's OutOfResources at launch: a config that does not fit under the
user's compiler, e.g. Triton 3.8's larger GEMM2, improvements/16) gets one error naming the kernel, its sizing
constexprs, Triton's numbers and a way out; other launch errors pass through unchanged."""

from __future__ import annotations

import pytest
import triton
from triton.runtime.errors import OutOfResources

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.kernels.launch import Launch


class _Refused:
    """Stands in for a JITFunction: ``fn[grid](...)`` raises what the launch would."""

    __name__ = "moe_gemm2_grouped_kernel"

    def __init__(self, exc: Exception):
        self.exc = exc
        self.calls = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls += 1
            raise self.exc
        return launch


KWARGS = dict(H=6144, I=2048, BN=64, BM=16, KC=512, MERGED=False, N_SPLIT=3, W4A4=False, USE_PDL=True,
              num_warps=4, num_stages=3)


def test_out_of_resources_names_the_kernel_the_config_and_the_compiler():
    fn = _Refused(OutOfResources(126_976, 101_376, "shared memory"))
    with pytest.raises(Glm5Fp4Error) as info:
        Launch(fn, (48, 3), (), dict(KWARGS), stage="gemm2")()
    msg = str(info.value)
    assert fn.calls == 1
    for part in ("moe_gemm2_grouped_kernel", "BN=64", "BM=16", "KC=512", "MERGED=False", "num_warps=4",
                 "num_stages=3", "126976 of shared memory", "limit is 101376", f"Triton {triton.__version__}",
                 "--stock"):
        assert part in msg, (part, msg)
    assert "USE_PDL" not in msg  # switches do not size a kernel
    assert isinstance(info.value.__cause__, OutOfResources)


def test_other_launch_errors_pass_through():
    err = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError) as info:
        Launch(_Refused(err), (1,), (), dict(KWARGS))()
    assert info.value is err
