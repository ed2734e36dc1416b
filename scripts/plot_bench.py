#!/usr/bin/env python3
"""Plots the output of `ferry bench rpc --json` as a PNG with two panels.

Left: median round trip against message size (the small call, the tiny-tensor call
and every echo size); right: echo bandwidth (payload counted both ways) against size.
ferry is drawn solid and raw TensorPipe dashed, one colour per transport, so the gap
between each pair of lines is what ferry costs over the transport.

    build/tools/ferry bench rpc --json > docs/bench_rpc.json
    scripts/plot_bench.py docs/bench_rpc.json -o docs/rpc_bench.png
    build/tools/ferry bench rpc --quick --json | scripts/plot_bench.py - -o /tmp/quick.png
"""

import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")  # no display on CI machines
import matplotlib.pyplot as plt  # noqa: E402  (must follow the backend choice)

COLOURS = {"shm": "tab:blue", "uv": "tab:orange"}


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
    # Median round trips of the waited-for calls; the callback-chained call has the
    # same size as the small call and would hide it.
    return m.get("kind") == "latency" and key.endswith("_rtt_median") and "chained" not in key and "bytes" in m


def is_bandwidth(key, m):
    return m.get("kind") == "bandwidth" and "bytes" in m


def plot(report, out_path):
    fig, (lat_ax, bw_ax) = plt.subplots(1, 2, figsize=(13, 5.2))
    for transport, entry in report["transports"].items():
        colour = COLOURS.get(transport)
        channels = ",".join(entry.get("channels", []))
        for ax, want in ((lat_ax, is_latency), (bw_ax, is_bandwidth)):
            points = series(entry["metrics"], want)
            if not points:
                continue
            sizes = [p[0] for p in points]
            ax.plot(sizes, [p[1] for p in points], "o-", color=colour, label=f"ferry {transport} ({channels})")
            ax.plot(sizes, [p[2] for p in points], "s--", color=colour, alpha=0.7,
                    label=f"raw TensorPipe {transport} ({channels})")

    for ax in (lat_ax, bw_ax):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes; small call 8 B, tiny tensor 16 B)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
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
    fig.suptitle(f"ferry bench rpc ({report.get('mode', '?')}): ferry vs raw TensorPipe, "
                 f"{machine.get('nproc', '?')} cores, load average {load_text} at start, "
                 f"{report.get('iterations', {}).get('latency', '?')} latency samples")
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", nargs="?", default="-", help="`ferry bench rpc --json` output; - for stdin")
    parser.add_argument("-o", "--output", default="rpc_bench.png", help="PNG to write (default: rpc_bench.png)")
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
    plot(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
