#!/usr/bin/env bash
# HERE (network): benchmarks/h200/prepare.sh for vLLM 0.26.0 (.ship/p0 .ship/p1 ...; ~6 min).
exec bash "$(dirname "$0")/../h200/prepare.sh" vllm "$@"
