#!/usr/bin/env bash
# THERE, after the last piece: benchmarks/h200/install.sh for vLLM (onto /tmp/site).
exec bash "$(dirname "$0")/../h200/install.sh" vllm "$@"
