#!/usr/bin/env bash
# THERE, in the first shipping call: benchmarks/h200/make_true_ckpt.sh (the checkpoint is the same for both engines).
exec bash "$(dirname "$0")/../h200/make_true_ckpt.sh" "$@"
