#!/usr/bin/env bash
# THERE, one call per piece: copy the piece this call carried (.ship/pN) to /tmp/ship, checked against its sha256.
set -euo pipefail
cd "$(dirname "$0")/../.."
t0=$SECONDS
python3 benchmarks/h200_vllm/ship.py receive "$@"
echo "[ship] receive took $((SECONDS - t0)) s; /tmp/ship holds: $(ls /tmp/ship | tr '\n' ' ')"
