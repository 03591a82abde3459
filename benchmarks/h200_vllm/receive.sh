#!/usr/bin/env bash
# THERE, one call per piece: benchmarks/h200/receive.sh for vLLM (.ship/pN -> /tmp/ship).
exec bash "$(dirname "$0")/../h200/receive.sh" vllm "$@"
