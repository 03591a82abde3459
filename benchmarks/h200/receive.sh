#!/usr/bin/env bash
# THERE, one call per piece: copy the piece this call carried (.ship/pN, .ship-sglang/pN) to the engine's /tmp
# ship folder, checked against its sha256.   Usage: bash benchmarks/h200/receive.sh ENGINE   (vllm | sglang)
set -euo pipefail
cd "$(dirname "$0")/../.."
engine=${1:?usage: receive.sh vllm|sglang}; shift
t0=$SECONDS
python3 benchmarks/h200/ship.py --engine "$engine" receive "$@"
echo "[ship] receive took $((SECONDS - t0)) s"
