#!/usr/bin/env python3
"""Plots the output of `ferry bench rpc --json` as a PNG with three panels.

Left: median round trip against message size (the small call, the tiny-tensor call
and every echo size); middle: calls per second against calls in flight (1, 16, 256,
pooled); right: echo bandwidth (payload counted both ways) against size. ferry is
drawn solid and the raw transport it is compared with dashed, one colour per
transport, so the gap between each pair of lines is what ferry costs over it. With
--python (the JSON of bench/python_rpc.py), PyTorch's RPC is drawn too, where it was
measured: its small call, its calls/s at 64 in flight, its 64 MiB echo.

    scripts/bench_summary.sh build OUT
    scripts/plot_bench.py OUT/rpc.json --python OUT/python.json -o docs/rpc_bench.png
    build/tools/ferry bench rpc --quick --json | scripts/plot_bench.py - -o /tmp/quick.png
"""

import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")  # no display on CI machines
import matplotlib.pyplot as plt  # noqa: E402  (must follow the backend choice)

COLOURS = {"ring": "tab:green", "tcp": "tab:red", "shm": "tab:blue", "uv": "tab:orange"}
# What `ferry bench rpc` measures each transport beside.
RAW = {"ring": "raw TensorPipe shm", "tcp": "raw TensorPipe uv", "shm": "raw TensorPipe shm", "uv": "raw TensorPipe uv"}
TORCH = "torch.distributed.rpc"


def size_label(n):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def series(metrics, want):
    """(bytes, ferry, raw) points, by size, of the metrics `want` accepts."""
    points = [(m["bytes"], m["ferry"], m["raw"]) for key, m in metrics.items() if want(key, m)]
    return sorted(points)


def is_latency(key, m):
    # The pooled small call, the tiny-tensor call and the echoes: one point per size
    # (the inline, chained and floor figures share the small call's size).
    wanted = key in ("small_call_rtt_median", "tiny_tensor_rtt_median") or (
        key.startswith("echo_") and key.endswith("_rtt_median"))
    return wanted and m.get("kind") == "latency" and "bytes" in m


def is_bandwidth(key, m):
    # Beside the raw transport; tcp's figures beside a plain socket repeat the sizes.
    return m.get("kind") == "bandwidth" and "bytes" in m and "socket" not in key


def in_flight(metrics):
    """(calls in flight, ferry, raw) points of the pooled calls/s figures."""
    points = []
    for key, m in metrics.items():
        prefix = "pooled_calls_per_s_outstanding_"
        if key.startswith(prefix):
            points.append((int(key[len(prefix):]), m["ferry"], m["raw"]))
    return sorted(points)


def plot(report, out_path, python=None):
    fig, (lat_ax, rate_ax, bw_ax) = plt.subplots(1, 3, figsize=(18, 5.4))
    for transport, entry in report["transports"].items():
        colour = COLOURS.get(transport)
        raw = RAW.get(transport, f"raw {transport}")
        for ax, points in ((lat_ax, series(entry["metrics"], is_latency)), (rate_ax, in_flight(entry["metrics"])),
                           (bw_ax, series(entry["metrics"], is_bandwidth))):
            if not points:
                continue
            xs = [p[0] for p in points]
            ax.plot(xs, [p[1] for p in points], "o-", color=colour, label=f"ferry on {transport}")
            ax.plot(xs, [p[2] for p in points], "s--", color=colour, alpha=0.7, label=f"{raw} (beside {transport})")
    torch = (python or {}).get(TORCH)
    if torch:
        lat_ax.plot([8], [torch["small_call_us"]], "kX", markersize=10, label=f"{TORCH} (Python), small call")
        rate_ax.plot([64], [torch["calls_per_s_64"]], "kX", markersize=10, label=f"{TORCH} (Python), 64 in flight")
        bw_ax.plot([64 << 20], [torch["echo_64mib_gb_s"]], "kX", markersize=10, label=f"{TORCH} (Python)")

    for ax in (lat_ax, rate_ax, bw_ax):
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in (lat_ax, bw_ax):
        ax.set_xlabel("message size (bytes; small call 8 B, tiny tensor 16 B)")
    rate_ax.set_yscale("log")
    rate_ax.set_xlabel("calls in flight")
    rate_ax.set_ylabel("calls per second, pooled function")
    rate_ax.set_title("calls in flight (higher is better)")
    rate_ax.set_xticks([1, 16, 64, 256], ["1", "16", "64", "256"])
    lat_ax.set_yscale("log")
    lat_ax.set_ylabel("median round trip (us)")
    lat_ax.set_title("latency vs message size (lower is better)")
    bw_ax.set_ylabel("echo bandwidth, payload both ways (GB/s)")
    bw_ax.set_title("bandwidth vs message size (higher is better)")
    ticks = sorted({p[0] for e in report["transports"].values() for p in series(e["metrics"], is_latency)})
    if ticks:
        lat_ax.set_xticks(ticks, [size_label(t) for t in ticks], rotation=30, fontsize=8)
    bw_ticks = sorted({p[0] for e in report["transports"].values() for p in series(e["metrics"], is_bandwidth)})
    if bw_ticks:
        bw_ax.set_xticks(bw_ticks, [size_label(t) for t in bw_ticks], rotation=30, fontsize=8)

    machine = report.get("machine", {})
    load = machine.get("load_average_before") or []
    load_text = f"{load[0]:.2f}" if load else "?"
    fig.suptitle(f"ferry bench rpc ({report.get('mode', '?')}): ferry beside the raw transport, "
                 f"{machine.get('nproc', '?')} cores, load average {load_text} at start, "
                 f"{report.get('iterations', {}).get('latency', '?')} latency samples")
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", nargs="?", default="-", help="`ferry bench rpc --json` output; - for stdin")
    parser.add_argument("-o", "--output", default="rpc_bench.png", help="PNG to write (default: rpc_bench.png)")
    parser.add_argument("--python", help="bench/python_rpc.py --json output, for PyTorch's RPC")
    args = parser.parse_args()
    try:
        if args.input == "-":
            report = json.load(sys.stdin)
        else:
            with open(args.input, encoding="utf-8") as f:
                report = json.load(f)
    except (OSError, ValueError) as e:
        print(f"plot_bench.py: cannot read {args.input}: {e}", file=sys.stderr)
        return 2
    if "transports" not in report:
        print(f"plot_bench.py: {args.input} is not `ferry bench rpc --json` output (no \"transports\")",
              file=sys.stderr)
        return 2
    python = None
    if args.python:
        try:
            with open(args.python, encoding="utf-8") as f:
                python = json.load(f)
        except (OSError, ValueError) as e:
            print(f"plot_bench.py: cannot read {args.python}: {e}", file=sys.stderr)
            return 2
    plot(report, args.output, python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
