# Sourced (repo root) by the device scripts that import glm5_fp4 without an engine (run_moe_h200.sh,
# run_gpu_batch.sh): the lent image lacks pydantic (glm5_fp4.hardware needs it) and has no registry. Makes it
# importable from, in order: the image itself; the shipped vLLM site (/tmp/site, benchmarks/h200_vllm, while the
# machine is warm); the wheels of .whl/ (carry [".whl"]; made here with `python3 -m pip download --only-binary=:all:
# --python-version 3.12 --platform manylinux2014_x86_64 -d .whl pydantic`). Returns 2 with what to do otherwise:
# on 2026-12-02 a call without it ran 42 GPU tests that all failed on the import.
_deps_ok() { python3 -c "import pydantic" 2>/dev/null; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! _deps_ok && [ -d /tmp/site/pydantic ]; then
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
if ! _deps_ok && compgen -G ".whl/pydantic-*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/glm5-deps .whl/*.whl &&
    export PYTHONPATH=$PYTHONPATH:/tmp/glm5-deps
fi
if ! _deps_ok; then
  echo "gpu_deps: pydantic is not importable here and neither /tmp/site (the shipped vLLM) nor .whl/ has it:" \
       "carry [\".whl\"] (see benchmarks/gpu_deps.sh for how to make it)" >&2
  unset -f _deps_ok
  return 2
fi
unset -f _deps_ok
