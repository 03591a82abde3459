#!/usr/bin/env bash
# HERE (network), once per engine: download the engine + its requirements.txt for cp312 manylinux, strip what SM90
# never loads, pack and split into .ship/pN (vllm) or .ship-sglang/pN (sglang), each as large as a call carries beside the working tree, manifest with
# sha256. Minutes (xz -9 on 2 cores).   Usage (any folder): bash benchmarks/h200/prepare.sh ENGINE [--piece-mib 58]
# PY=python3 picks the interpreter whose pip downloads.
set -euo pipefail
cd "$(dirname "$0")/../.."
engine=${1:?usage: prepare.sh vllm|sglang}; shift
exec "${PY:-python3}" benchmarks/h200/ship.py --engine "$engine" prepare "$@"
