#!/usr/bin/env bash
# Runs the main example from a build directory (argument 1, default build): a 4-process
# model-parallel job on this host, its workers started by `ferry run`.
set -euo pipefail
build=${1:-build}
exec timeout 300 "$build/tools/ferry" run --standalone --nproc-per-node 4 "$build/examples/02_model_parallel" 50
