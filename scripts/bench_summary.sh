#!/usr/bin/env bash
# The README's figures, from one run: ferry beside the raw transport it replaces and
# beside PyTorch's RPC, on this host.
#
#   scripts/bench_summary.sh [BUILD] [OUT]      (defaults: build, bench-summary)
#
# Runs, one after the other:
#   1. ferry bench rpc --transports ring,tcp --repeat 3 --iterations 5000 --json: ferry
#      in C++ on the ring (beside a raw TensorPipe shm ping-pong) and on tcp (beside
#      raw TensorPipe uv and a plain TCP socket);
#   2. bench/python_rpc.py: ferry.rpc from Python and torch.distributed.rpc (when
#      Debian's python3 imports torch), a small call, 64 calls in flight, a 64 MiB echo;
#   3. ferry bench init --workers N --calls for N = 16, 64, 256.
# It writes each tool's JSON and summary.md (the tables) under OUT, and prints the
# tables. Needs the plain build (ferry, the Python package, python_cpp_peer): about 10
# minutes on 2 cores. Run it with nothing else busy: its figures are medians, and the
# ratios of one run are what to compare.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-build}
OUT=${2:-bench-summary}
PYTHON=${PYTHON:-/usr/bin/python3}
# QUICK=1: a short run that checks the script itself, not figures to keep.
RPC_ARGS=(--repeat 3 --iterations 5000)
PY_ARGS=()
WORKERS=(16 64 256)
if [ "${QUICK:-0}" = 1 ]; then
  RPC_ARGS=(--quick)
  PY_ARGS=(--iterations 200 --inflight-calls 1000 --echo-repeat 1)
  WORKERS=(4)
fi
FERRY="$BUILD/tools/ferry"
[ -x "$FERRY" ] || { echo "bench_summary: $FERRY is not built (cmake --build $BUILD)" >&2; exit 2; }
mkdir -p "$OUT"

{
  echo "date: $(date -u +%Y-%m-%d)"
  echo "machine: $(nproc) cores, $(uname -sr), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
  echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "commit: $(git -C "$HERE" rev-parse --short HEAD 2>/dev/null || echo unknown)"
} > "$OUT/machine.txt"

echo "bench_summary: ferry bench rpc (ring, tcp)" >&2
"$FERRY" bench rpc --transports ring,tcp "${RPC_ARGS[@]}" --json > "$OUT/rpc.json"
echo "bench_summary: python_rpc.py (ferry.rpc and torch.distributed.rpc)" >&2
PYTHONPATH="$BUILD/python" "$PYTHON" "$HERE/bench/python_rpc.py" --cpp-peer "$BUILD/python/python_cpp_peer" \
  ${PY_ARGS[@]+"${PY_ARGS[@]}"} --json "$OUT/python.json" > "$OUT/python.txt"
for n in "${WORKERS[@]}"; do
  echo "bench_summary: ferry bench init --workers $n --calls" >&2
  "$FERRY" bench init --workers "$n" --calls --timeout 300 --json > "$OUT/init_$n.json"
done

"$PYTHON" - "$OUT" <<'PY' | tee "$OUT/summary.md"
import json, os, sys
out = sys.argv[1]
rpc = json.load(open(os.path.join(out, "rpc.json")))
py = json.load(open(os.path.join(out, "python.json")))
machine = open(os.path.join(out, "machine.txt")).read().strip().splitlines()

def m(transport, key):
    return rpc["transports"][transport]["metrics"][key]

def us(v):
    return f"{v:.1f} µs" if v < 100 else f"{v:.0f} µs"

def rate(v):
    return f"{v / 1000:.0f}k" if v >= 10000 else f"{v / 1000:.1f}k"

def gbs(v):
    return f"{v:.2f} GB/s"

torch = py.get("torch.distributed.rpc")
pyferry = py.get("ferry (Python function)")
print("\n".join("- " + line for line in machine))
print()
print("| one host | ferry, C++ (ring) | raw TensorPipe shm | ferry.rpc, Python | PyTorch RPC, Python |")
print("| --- | ---: | ---: | ---: | ---: |")
small = m("ring", "small_call_rtt_median")
print(f"| small call, median round trip | {us(small['ferry'])} | {us(small['raw'])} | "
      f"{us(pyferry['small_call_us']) if pyferry else '—'} | {us(torch['small_call_us']) if torch else 'not importable'} |")
inline = m("ring", "small_call_inline_rtt_median")
print(f"| small call to an inline function | {us(inline['ferry'])} | {us(inline['raw'])} | | |")
for n in (16, 256):
    c = m("ring", f"pooled_calls_per_s_outstanding_{n}")
    extra = ""
    if n == 16:
        extra = (f" {rate(pyferry['calls_per_s_64'])} (64 in flight) |" if pyferry else " — |") + \
                (f" {rate(torch['calls_per_s_64'])} (64 in flight) |" if torch else " — |")
    else:
        extra = " | |"
    print(f"| calls/s, {n} in flight | {rate(c['ferry'])} | {rate(c['raw'])} |{extra}")
e = m("ring", "echo_1MiB_bandwidth")
print(f"| echo 1 MiB, both ways | {gbs(e['ferry'])} | {gbs(e['raw'])} | | |")
if "echo_64MiB_bandwidth" in rpc["transports"]["ring"]["metrics"]:
    e = m("ring", "echo_64MiB_bandwidth")
    print(f"| echo 64 MiB, both ways | {gbs(e['ferry'])} | {gbs(e['raw'])} | "
          f"{gbs(pyferry['echo_64mib_gb_s']) if pyferry else '—'} | {gbs(torch['echo_64mib_gb_s']) if torch else '—'} |")
print()
print("| across hosts (loopback here) | ferry, C++ (tcp) | raw TensorPipe uv | plain TCP socket |")
print("| --- | ---: | ---: | ---: |")
small = m("tcp", "small_call_rtt_median")
sock = rpc["transports"]["tcp"]["metrics"].get("small_call_vs_socket_rtt_median")
print(f"| small call, median round trip | {us(small['ferry'])} | {us(small['raw'])} | {us(sock['raw']) if sock else ''} |")
for n in (16, 256):
    c = m("tcp", f"pooled_calls_per_s_outstanding_{n}")
    print(f"| calls/s, {n} in flight | {rate(c['ferry'])} | {rate(c['raw'])} | |")
for size in ("1MiB", "64MiB"):
    key = f"echo_{size}_bandwidth"
    if key in rpc["transports"]["tcp"]["metrics"]:
        e = m("tcp", key)
        s = rpc["transports"]["tcp"]["metrics"].get(f"echo_{size}_bandwidth_vs_socket")
        print(f"| echo {size[:-3]} MiB, both ways | {gbs(e['ferry'])} | {gbs(e['raw'])} | {gbs(s['raw']) if s else ''} |")
print()
print("| workers on this host, all-to-all calls | init_rpc, median / slowest | all-to-all calls, median | shutdown, median | whole job |")
print("| --- | ---: | ---: | ---: | ---: |")
for n in sorted(int(f[5:-5]) for f in os.listdir(out) if f.startswith("init_") and f.endswith(".json")):
    path = os.path.join(out, f"init_{n}.json")
    if not os.path.exists(path):
        continue
    j = json.load(open(path))
    print(f"| {n} | {j['init_ms']['median'] / 1000:.2f} / {j['init_ms']['max'] / 1000:.2f} s | "
          f"{j['calls_ms']['median'] / 1000:.2f} s | {j['shutdown_ms']['median'] / 1000:.2f} s | {j['job_ms'] / 1000:.1f} s |")
PY
