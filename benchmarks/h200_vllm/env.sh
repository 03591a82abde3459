# Sourced by the device commands after install.sh (vLLM): benchmarks/h200/env.sh for vLLM.
. "$(dirname "${BASH_SOURCE[0]}")/../h200/env.sh" vllm
