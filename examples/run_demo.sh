#!/usr/bin/env bash
# Runs the main example from a build directory (argument 1, default build).
set -euo pipefail
build=${1:-build}
exec "$build/examples/01_tensor"
