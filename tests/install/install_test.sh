#!/usr/bin/env bash
# usage: install_test.sh CMAKE BUILD_DIR CONSUMER_SRC WORK_DIR [TORCH_CONSUMER_SRC]
# With TORCH_CONSUMER_SRC (a build with the torch component), that project must find
# find_package(ferry COMPONENTS torch) and run.
set -euo pipefail
cmake=$1 build=$2 consumer=$3 work=$4 torch_consumer=${5:-}
rm -rf "$work"
mkdir -p "$work"
"$cmake" --install "$build" --prefix "$work/prefix" >"$work/install.log"
test -f "$work/prefix/lib/cmake/ferry/ferryConfig.cmake"
test -f "$work/prefix/lib/cmake/ferry/ferryConfigVersion.cmake"
test -f "$work/prefix/include/ferry/tensor/tensor.h"
"$cmake" -S "$consumer" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" >"$work/configure.log"
"$cmake" --build "$work/build" >"$work/build.log"
out=$("$work/build/consumer")
echo "$out"
test "$out" = "consumer: Tensor(float32, [2, 2], cpu) sum 20"
# A version the install cannot satisfy must be refused.
if "$cmake" -S "$consumer" -B "$work/build-v" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
     -DFERRY_WANTED_VERSION=99.0 >"$work/configure-v.log" 2>&1; then
  echo "find_package(ferry 99.0) unexpectedly succeeded" >&2
  exit 1
fi
if [ -n "$torch_consumer" ]; then
  test -f "$work/prefix/lib/cmake/ferry/ferryTorchTargets.cmake"
  test -f "$work/prefix/include/ferry/torch/wire.h"
  "$cmake" -S "$torch_consumer" -B "$work/build-torch" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
    >"$work/configure-torch.log"
  "$cmake" --build "$work/build-torch" >"$work/build-torch.log"
  out=$("$work/build-torch/consumer_torch")
  echo "$out"
  test "$out" = "consumer_torch: same pointer"
fi
# The README's example, copied as it stands, builds against the install and runs under
# the installed `ferry run`, printing what the README says it prints.
if [ -n "${FERRY_README:-}" ]; then
  mkdir -p "$work/readme"
  awk '/^## A short example/{found=1} found && /^```cpp/{inside=1; next} inside && /^```/{exit} inside{print}' \
    "$FERRY_README" >"$work/readme/main.cc"
  test -s "$work/readme/main.cc"
  cat >"$work/readme/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.25)
project(readme_example LANGUAGES CXX)
find_package(ferry REQUIRED)
add_executable(example main.cc)
target_link_libraries(example PRIVATE ferry::ferry)
CMAKE
  "$cmake" -S "$work/readme" -B "$work/build-readme" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
    >"$work/configure-readme.log"
  "$cmake" --build "$work/build-readme" >"$work/build-readme.log"
  expected='[rank0]: add(1, 2) = 3; scale({1, 2, 3}, 2) = {2, 4, 6}'
  grep -qF "$expected" "$FERRY_README" || { echo "the README no longer says it prints: $expected" >&2; exit 1; }
  out=$(timeout 60 "$work/prefix/bin/ferry" run --standalone --nproc-per-node 2 "$work/build-readme/example")
  echo "$out"
  test "$out" = "$expected"
fi
echo "install test passed"
