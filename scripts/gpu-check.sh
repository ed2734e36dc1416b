#!/bin/sh
# scripts/gpu-check.sh: the one prepared check to run on a machine with a GPU, from a
# build made elsewhere (docs/performance.md, "Carrying a build to a GPU machine", says
# how to carry it). In one command, under 8 minutes:
#   1. the gpu-labelled tests (their binaries, run directly: ctest's files name the
#      paths of the machine that built them);
#   2. ferry bench rpc --device cuda on the ring (CUDA tensors over the cuda_ipc channel)
#      and on TensorPipe's shm (over pinned staging), which measures, in the same run,
#      the CPU echo, the CUDA echo, a pinned cudaMemcpy there and back and a
#      device-to-device copy there and back;
#   3. PyTorch's CUDA RPC (../shared/bench/torch_cuda_rpc.py, or $TORCH_BENCH), when
#      python3 can import torch with CUDA.
# It writes gpu-check.json (every step, its exit code and time, the bench's JSON, the
# PyTorch figures) and summary.txt (the CUDA echoes beside their floors) into the output folder.
#
#   scripts/gpu-check.sh [BUILD_DIR] [OUT_DIR]        # defaults: build, gpu-check-<time>
#   FERRY_EMULATE_CUDA=1 scripts/gpu-check.sh         # the same on the emulated runtime
#   scripts/gpu-check.sh --pack [BUILD_DIR] [TARBALL] # what to carry to the GPU machine
#
# --pack writes a tarball holding this script, the binaries the check runs (under
# build/) and the shared libraries they load from this machine (under lib/), except
# the C library's own and the GPU driver's (libcuda), which the GPU machine has. There:
#   tar xzf ferry-gpu-check.tar.gz && cd ferry-gpu-check
#   LD_LIBRARY_PATH=$PWD/lib scripts/gpu-check.sh build
#
# With FERRY_EMULATE_CUDA set, every step runs on ferry's emulated CUDA runtime
# (tensor/emulated_cuda.h): that is how the script itself is tested without a GPU.
# Exit code: 0 when every step passed, 1 otherwise (the summary says which).
set -u

# The binaries the check runs, relative to the build folder.
BINARIES="tools/ferry tests/tensor/cuda_test tests/tensor/emulated_cuda_test tests/rpc/cuda_transfer_test \
  tests/rpc/cuda_ordering_test tests/rpc/device_map_test examples/02_model_parallel"

if [ "${1:-}" = "--pack" ]; then
  BUILD=${2:-build}
  TARBALL=${3:-ferry-gpu-check.tar.gz}
  case "$TARBALL" in /*) ;; *) TARBALL="$PWD/$TARBALL" ;; esac
  work=$(mktemp -d) || exit 2
  root="$work/ferry-gpu-check"
  mkdir -p "$root/lib" "$root/scripts" || exit 2
  cp "$0" "$root/scripts/gpu-check.sh" || exit 2
  for b in $BINARIES; do
    if [ ! -x "$BUILD/$b" ]; then
      echo "gpu-check --pack: $BUILD/$b not built (cmake --build $BUILD --target $(basename "$b"))" >&2
      rm -rf "$work"
      exit 2
    fi
    mkdir -p "$root/build/$(dirname "$b")"
    cp "$BUILD/$b" "$root/build/$b" || exit 2
    ldd "$BUILD/$b" | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
  done | sort -u | grep -v -E '/(libc|libm|libpthread|libdl|librt|libresolv|libcuda)\.so|/ld-linux' |
    while read -r lib; do cp -L "$lib" "$root/lib/"; done
  tar czf "$TARBALL" -C "$work" ferry-gpu-check || exit 2
  rm -rf "$work"
  echo "gpu-check --pack: $TARBALL ($(du -h "$TARBALL" | cut -f1)); on the GPU machine:" >&2
  echo "  tar xzf $(basename "$TARBALL") && cd ferry-gpu-check && LD_LIBRARY_PATH=\$PWD/lib scripts/gpu-check.sh build" >&2
  exit 0
fi

BUILD=${1:-build}
OUT=${2:-gpu-check-$(date +%Y%m%d-%H%M%S)}
HERE=$(cd "$(dirname "$0")/.." && pwd)
TORCH_BENCH=${TORCH_BENCH:-$HERE/../shared/bench/torch_cuda_rpc.py}
ITERATIONS=${GPU_CHECK_ITERATIONS:-2000}

if [ ! -x "$BUILD/tools/ferry" ]; then
  echo "gpu-check: $BUILD/tools/ferry not found: give the build folder as the first argument" >&2
  exit 2
fi
mkdir -p "$OUT" || exit 2
STEPS="$OUT/steps.txt"
: > "$STEPS"

# step NAME LIMIT_SECONDS COMMAND...: runs it with its output in $OUT/NAME.log and a
# line "NAME rc seconds" in steps.txt.
step() {
  name=$1
  limit=$2
  shift 2
  echo "gpu-check: $name" >&2
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name $rc $(( $(date +%s) - start ))" >> "$STEPS"
  return $rc
}

# 1. The gpu-labelled tests (and the emulated ordering tests, which are quick).
step test_cuda 60 "$BUILD/tests/tensor/cuda_test"
step test_emulated_cuda 60 "$BUILD/tests/tensor/emulated_cuda_test"
step test_cuda_transfer 120 "$BUILD/tests/rpc/cuda_transfer_test"
step test_cuda_ordering 120 "$BUILD/tests/rpc/cuda_ordering_test"
step test_device_maps 120 "$BUILD/tests/rpc/device_map_test"
# With a device the example must succeed with its activations on cuda:0.
step example_02_cuda 120 sh -c 'out=$("$0" 3 --device cuda 2>&1); rc=$?; echo "$out"; \
  test $rc -eq 0 && echo "$out" | grep -q "on cuda:0"' "$BUILD/examples/02_model_parallel"

# 2. ferry's figures, with the floors in the same run.
EMULATE=""
if [ -n "${FERRY_EMULATE_CUDA:-}" ]; then EMULATE="--emulate-cuda"; fi
step bench_rpc_cuda 330 "$BUILD/tools/ferry" bench rpc --device cuda $EMULATE --transports ring,shm \
  --iterations "$ITERATIONS" --json
# The log holds the progress lines on stderr too: keep the JSON object alone.
sed -n '/^{/,/^}/p' "$OUT/bench_rpc_cuda.log" > "$OUT/ferry_bench_rpc_cuda.json"

# 3. PyTorch beside it, when it can run here.
if [ -f "$TORCH_BENCH" ] && python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    > /dev/null 2>&1; then
  step torch_cuda_rpc 150 python3 "$TORCH_BENCH" --quick
  grep '^{' "$OUT/torch_cuda_rpc.log" > "$OUT/torch_cuda_rpc.jsonl"
else
  echo "torch_cuda_rpc skipped 0" >> "$STEPS"
  echo "PyTorch with CUDA is not importable by python3 (or $TORCH_BENCH is missing)" > "$OUT/torch_cuda_rpc.log"
fi

# The JSON and the summary.
python3 - "$OUT" <<'EOF'
import json, os, platform, subprocess, sys

out = sys.argv[1]
steps = []
for line in open(os.path.join(out, "steps.txt")):
    name, rc, seconds = line.split()
    steps.append({"name": name, "rc": None if rc == "skipped" else int(rc), "seconds": int(seconds),
                  "log": name + ".log"})
    if rc == "skipped":
        steps[-1]["skipped"] = True


def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


bench = load("ferry_bench_rpc_cuda.json")
torch = []
try:
    for line in open(os.path.join(out, "torch_cuda_rpc.jsonl")):
        torch.append(json.loads(line))
except (OSError, ValueError):
    pass
try:
    gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.SubprocessError):
    gpus = ""
report = {"host": platform.node(), "gpus": gpus, "emulated_cuda": bool(os.environ.get("FERRY_EMULATE_CUDA")),
          "steps": steps, "ferry_bench_rpc": bench, "torch_cuda_rpc": torch}
with open(os.path.join(out, "gpu-check.json"), "w") as f:
    json.dump(report, f, indent=2)

lines = ["gpu-check on %s%s" % (platform.node(), " (EMULATED CUDA)" if report["emulated_cuda"] else ""),
         "gpus: %s" % (gpus or "none reported by nvidia-smi"), ""]
for s in steps:
    state = "skipped" if s.get("skipped") else ("ok" if s["rc"] == 0 else "FAILED (rc %d)" % s["rc"])
    lines.append("%-22s %-16s %4d s" % (s["name"], state, s["seconds"]))
if bench:
    for transport, t in bench.get("transports", {}).items():
        m = t["metrics"]
        lines += ["", "ferry on %s (GB/s both ways; RTT in us)" % transport,
                  "%-8s %10s %10s %8s %10s %10s %9s %9s" % ("size", "CUDA echo", "CPU echo", "CUDA/CPU",
                                                          "pinned", "CUDA/pin", "dev copy", "CUDA RTT")]
        for key in m:
            if not key.startswith("cuda_echo_") or not key.endswith("_bandwidth"):
                continue
            size = key[len("cuda_echo_"):-len("_bandwidth")]
            cuda = m[key]["ferry"]
            pinned = m[key]["raw"]
            cpu = m.get("echo_%s_bandwidth" % size, {}).get("ferry", 0.0)
            dev = m.get("cuda_device_copy_%s_bandwidth" % size, {}).get("ferry", 0.0)
            rtt = m.get("cuda_echo_%s_rtt_median" % size, {})
            lines.append("%-8s %10.3f %10.3f %8.2f %10.3f %10.2f %9.2f %9.1f" % (
                size, cuda, cpu, cuda / cpu if cpu else 0.0, pinned, cuda / pinned if pinned else 0.0, dev,
                rtt.get("ferry", 0.0)))
            if rtt:
                lines[-1] += "  (CPU %.1f us: x%.2f)" % (rtt["raw"], rtt["ferry"] / rtt["raw"] if rtt["raw"] else 0)
for r in torch:
    lines.append("torch: " + json.dumps(r)[:300])
text = "\n".join(lines) + "\n"
with open(os.path.join(out, "summary.txt"), "w") as f:
    f.write(text)
sys.stdout.write(text)
EOF

failed=$(awk '$2 != "0" && $2 != "skipped" {print $1}' "$STEPS")
if [ -n "$failed" ]; then
  echo "gpu-check: failed: $failed (logs in $OUT)" >&2
  exit 1
fi
echo "gpu-check: every step passed; $OUT/gpu-check.json and $OUT/summary.txt" >&2
exit 0
