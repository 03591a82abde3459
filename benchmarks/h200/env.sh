# Sourced by the device commands after install.sh: `. benchmarks/h200/env.sh ENGINE` (vllm | sglang).
# This tree's glm5_fp4 first, then what install.sh put on the engine's site folder (and the folders its .pth
# files name, which Python reads only in site directories), then the image's own packages.
case "${1:-}" in
  vllm) _site=/tmp/site ;;
  sglang) _site=/tmp/sglang/site ;;
  *) echo "usage: . benchmarks/h200/env.sh vllm|sglang" >&2; return 2 ;;
esac
_extra=$(cat "$_site/.pythonpath" 2>/dev/null || true)
export PYTHONPATH=$PWD:$_site${_extra:+:$_extra}${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
# Many servers compile at once on 16 cores: one Inductor compile worker each instead of one per core.
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
if [ "$1" = vllm ]; then
  export VLLM_NO_USAGE_STATS=1
else
  # Only our plugin among SGLang's entry points (nothing else is shipped; say so rather than rely on it).
  export SGLANG_PLUGINS=${SGLANG_PLUGINS:-glm5_fp4}
  # The JIT kernels (Marlin, DeepGEMM) compile once into /tmp, which the calls share while the machine is warm.
  export SGLANG_CACHE_DIR=${SGLANG_CACHE_DIR:-/tmp/sglang/cache} TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-/tmp/sglang/cache/tvm-ffi}
  export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/sglang/cache/deep_gemm}
fi
unset _site _extra
