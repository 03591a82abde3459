import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the root conftest.py
    raise pytest.UsageError("tests/interpreter needs TRITON_INTERPRET=1 (see the root conftest.py)")


@pytest.fixture
def gen():
    """A fresh random stream per test, seeded from the OS: every run draws new inputs."""
    import torch

    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)
