#!/usr/bin/env python3
"""Python RPC, measured in one run: ferry.rpc with a Python function, ferry.rpc calling a
C++-registered function, and torch.distributed.rpc (when importable), each as

  - a small call: median round trip of rpc_sync of a no-op, in microseconds;
  - calls in flight: rpc_async calls per second with 64 outstanding;
  - a tensor echo: 64 MiB there and back, GB/s (2 x bytes / median round trip).

    PYTHONPATH=build/python python3 bench/python_rpc.py [--cpp-peer build/python/python_cpp_peer]
        [--iterations 2000] [--inflight-calls 20000] [--echo-repeat 5] [--json FILE]

Every group runs on 127.0.0.1: the callee is a second process (a Python one, or the C++
worker tests/python/cpp_peer.cc). Ratios to PyTorch are printed last.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ECHO_BYTES = 64 << 20
WINDOW = 64


def noop():
    return None


def echo(x):
    return x


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tensor():
    try:
        import torch

        return torch.ones(ECHO_BYTES // 4, dtype=torch.float32)
    except ImportError:
        import numpy as np

        return np.ones(ECHO_BYTES // 4, dtype=np.float32)


def measure(rpc, to, fn_noop, fn_echo, args):
    """The three numbers for one API; fn_* are what rpc_sync/rpc_async are given."""
    for _ in range(200):
        rpc.rpc_sync(to, fn_noop)
    samples = []
    for _ in range(args.iterations):
        t0 = time.perf_counter()
        rpc.rpc_sync(to, fn_noop)
        samples.append(time.perf_counter() - t0)
    small_us = statistics.median(samples) * 1e6

    calls = args.inflight_calls
    t0 = time.perf_counter()
    done = 0
    while done < calls:
        futs = [rpc.rpc_async(to, fn_noop) for _ in range(WINDOW)]
        for f in futs:
            f.wait()
        done += WINDOW
    per_s = done / (time.perf_counter() - t0)

    t = make_tensor()
    rpc.rpc_sync(to, fn_echo, args=(t,))
    rts = []
    for _ in range(args.echo_repeat):
        t0 = time.perf_counter()
        back = rpc.rpc_sync(to, fn_echo, args=(t,))
        rts.append(time.perf_counter() - t0)
        assert back.shape == t.shape
    gbs = 2 * ECHO_BYTES / statistics.median(rts) / 1e9
    return {"small_call_us": small_us, "calls_per_s_64": per_s, "echo_64mib_gb_s": gbs}


def serve(kind, rank, world, init):
    """A callee: joins, serves until the driver shuts down."""
    if kind == "torch":
        import torch.distributed.rpc as rpc

        opts = rpc.TensorPipeRpcBackendOptions(init_method=init, num_worker_threads=16, rpc_timeout=120)
    else:
        import ferry.rpc as rpc

        opts = rpc.TensorPipeRpcBackendOptions(init_method=init, num_worker_threads=16, rpc_timeout=120)
    rpc.init_rpc(f"callee{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    rpc.shutdown()


def spawn(argv):
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.Popen(argv, env=env)


def run_ferry(args):
    import ferry.rpc as rpc

    import python_rpc as me  # this file, by module name, so the callee can import what it pickles

    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "store")
        world = 3 if args.cpp_peer else 2
        procs = [spawn([sys.executable, "-m", "python_rpc", "--serve", "ferry", "1", str(world), init])]
        if args.cpp_peer:
            procs.append(subprocess.Popen([args.cpp_peer, "callee2", "2", str(world), init]))
        opts = rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=120)
        rpc.init_rpc("driver", rank=0, world_size=world, rpc_backend_options=opts)
        out = {"ferry (Python function)": measure(rpc, "callee1", me.noop, me.echo, args)}
        if args.cpp_peer:
            out["ferry (C++ function)"] = measure(rpc, "callee2", "noop", "echo", args)
        rpc.shutdown()
        for p in procs:
            p.wait(timeout=60)
    return out


def run_torch(args):
    try:
        import torch.distributed.rpc as rpc
    except ImportError:
        return {}
    import python_rpc as me

    init = f"tcp://127.0.0.1:{free_port()}"
    callee = spawn([sys.executable, "-m", "python_rpc", "--serve", "torch", "1", "2", init])
    opts = rpc.TensorPipeRpcBackendOptions(init_method=init, num_worker_threads=16, rpc_timeout=120)
    rpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=opts)
    out = {"torch.distributed.rpc": measure(rpc, "callee1", me.noop, me.echo, args)}
    rpc.shutdown()
    callee.wait(timeout=60)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--serve", nargs=4, metavar=("KIND", "RANK", "WORLD", "INIT"), help=argparse.SUPPRESS)
    p.add_argument("--cpp-peer", default=os.environ.get("FERRY_CPP_PEER"),
                   help="the built python_cpp_peer (its C++ functions are measured too)")
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--inflight-calls", type=int, default=20000)
    p.add_argument("--echo-repeat", type=int, default=5)
    p.add_argument("--no-torch", action="store_true", help="skip torch.distributed.rpc")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.serve:
        kind, rank, world, init = args.serve
        serve(kind, int(rank), int(world), init)
        return 0
    # The torch run goes in a process of its own, so the two libraries never share one.
    results = {}
    if not args.no_torch:
        code = ("import sys, json, python_rpc as m; "
                "print(json.dumps(m.run_torch(m._args(sys.argv[1:]))))")
        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
        child = subprocess.run([sys.executable, "-c", code, "--iterations", str(args.iterations),
                                "--inflight-calls", str(args.inflight_calls), "--echo-repeat", str(args.echo_repeat)],
                               env=env, capture_output=True, text=True, timeout=600)
        if child.returncode != 0:
            print(child.stderr, file=sys.stderr)
            return 1
        results.update(json.loads(child.stdout.strip().splitlines()[-1]))
    results.update(run_ferry(args))
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int)
    p.add_argument("--inflight-calls", type=int)
    p.add_argument("--echo-repeat", type=int)
    return p.parse_args(argv)


def report(results):
    print(f"{'':28} {'small call (us)':>16} {'calls/s, 64 in flight':>22} {'64 MiB echo (GB/s)':>19}")
    for name, r in results.items():
        print(f"{name:28} {r['small_call_us']:16.1f} {r['calls_per_s_64']:22.0f} {r['echo_64mib_gb_s']:19.2f}")
    base = results.get("torch.distributed.rpc")
    if base:
        print("ratios to torch.distributed.rpc (small call: lower is better; the others: higher):")
        for name, r in results.items():
            if name == "torch.distributed.rpc":
                continue
            print(f"  {name:26} small call {r['small_call_us'] / base['small_call_us']:.3f}x, "
                  f"calls in flight {r['calls_per_s_64'] / base['calls_per_s_64']:.2f}x, "
                  f"64 MiB echo {r['echo_64mib_gb_s'] / base['echo_64mib_gb_s']:.2f}x")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
