#!/usr/bin/env bash
# THERE, after the last piece: verify every piece and the whole, extract onto /tmp/site, install glm5-fp4 from
# this working tree (no deps), smoke-test vLLM 0.26.0 + native libraries + our entry point; timings to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -f /tmp/site/.glm5_fp4_installed ] && [ "${FORCE:-0}" != 1 ]; then
  echo "[ship] /tmp/site already installed (FORCE=1 reinstalls)"; exit 0
fi
python3 benchmarks/h200_vllm/ship.py install "$@"
touch /tmp/site/.glm5_fp4_installed
