import os

# tests/interpreter runs the Triton kernels through Triton's CPU interpreter, which must be switched on
# before triton.jit decorates them (i.e. before glm5_fp4.kernels is imported): its own pytest process,
# started by `make test` with TRITON_INTERPRET=1. In an ordinary run it is not collected. (This file sits
# at the repository root, not in tests/: a tests/conftest.py would put tests/ on sys.path, where
# tests/sglang would pass for the sglang package.)
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["tests/interpreter"]
