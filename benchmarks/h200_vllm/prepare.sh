#!/usr/bin/env bash
# HERE (network): download vLLM 0.26.0 + requirements.txt for cp312 manylinux, strip what SM90 never loads,
# pack and split into .ship/p0 .ship/p1 ... (<= 58 MiB each, manifest with sha256). ~6 min (xz -9 on 2 cores).
# Usage (repo root): bash benchmarks/h200_vllm/prepare.sh [--piece-mib 58]     PY=python3 picks the pip used.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PY:-python3}" benchmarks/h200_vllm/ship.py prepare "$@"
