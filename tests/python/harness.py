"""Starts worker processes for the Python tests (workers.py) and checks how they end.

Every wait has a deadline; a worker still running at the end is killed, and its output
is part of the failure message.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def env_with_path(extra=None):
    env = dict(os.environ)
    parts = [str(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    env.update(extra or {})
    return env


def spawn_python(name, rank, world, init, role="serve", extra_env=None):
    return subprocess.Popen(
        [sys.executable, "-c", "import workers; workers.main()", name, str(rank), str(world), init, role],
        env=env_with_path(extra_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def cpp_peer_path():
    path = os.environ.get("FERRY_CPP_PEER")
    if not path or not os.path.exists(path):
        raise RuntimeError("FERRY_CPP_PEER must name the built python_cpp_peer (ctest sets it; "
                           "by hand: FERRY_CPP_PEER=build/python/python_cpp_peer)")
    return path


def spawn_cpp(name, rank, world, init, *extra):
    return subprocess.Popen([cpp_peer_path(), name, str(rank), str(world), init, *extra],
                            env=env_with_path(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs, timeout=30.0, expect=None):
    """Waits for every process (at most `timeout` seconds in all), kills stragglers and
    asserts each exit code (0 unless `expect` maps its index to another)."""
    deadline = time.monotonic() + timeout
    outputs = []
    failures = []
    for i, p in enumerate(procs):
        left = max(0.1, deadline - time.monotonic())
        try:
            out, _ = p.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            out, _ = p.communicate()
            failures.append(f"process {i} ({' '.join(map(str, p.args[-5:]))}) still running after {timeout} s; "
                            "killed")
            outputs.append(out)
            continue
        outputs.append(out)
        want = (expect or {}).get(i, 0)
        if p.returncode != want:
            failures.append(f"process {i} exited {p.returncode}, expected {want}")
    if failures:
        detail = "\n".join(f"--- process {i} output:\n{o}" for i, o in enumerate(outputs))
        raise AssertionError("; ".join(failures) + "\n" + detail)
    return outputs


def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what}: not true after {timeout} s")
