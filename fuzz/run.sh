#!/usr/bin/env bash
# Runs one libFuzzer target for a bounded time over its seed corpus (fuzz/corpus/NAME,
# read only) plus a working corpus in the build directory, and fails on any crash,
# leak or hang (an input that runs longer than 10 s). Prints the execution count.
# Inputs reach 1 MiB, so counts and sizes can pass the decoders' up-front reserves.
#   fuzz/run.sh BUILD_DIR NAME SECONDS
set -euo pipefail
build=$1 name=$2 seconds=$3
here=$(cd "$(dirname "$0")" && pwd)
work="$build/fuzz-corpus/$name"
artifacts="$build/fuzz-artifacts"
mkdir -p "$work" "$artifacts"
log="$build/fuzz-$name.log"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:protect_shadow_gap=0}
export FERRY_LOG_LEVEL=${FERRY_LOG_LEVEL:-off}  # the targets log every connection they close
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
if ! "$build/fuzz/${name}_fuzz" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=1048576 \
     -print_final_stats=1 -artifact_prefix="$artifacts/$name-" "$work" "$here/corpus/$name" >"$log" 2>&1; then
  tail -n 60 "$log"
  echo "fuzz: $name FAILED (log: $log, inputs: $artifacts)" >&2
  exit 1
fi
runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
echo "fuzz: $name: ${runs:-?} executions in ${seconds} s, no crash, leak or hang"
