"""Worker processes of the Python tests, and the functions they call on each other.

A worker runs as ``python3 -c "import workers; workers.main()" NAME RANK WORLD INIT ROLE``
(harness.py starts it), so that the functions below are pickled as ``workers.<name>``
and are this same module on every side. A worker joins the group, does what its role
says, and leaves with a graceful shutdown (which returns once every worker has called
shutdown): its exit code is 0 only if all went as expected.
"""

import gc
import os
import sys
import threading
import time
import weakref

import numpy as np

import ferry.rpc as rpc
from ferry.futures import Future

RPC_TIMEOUT = 20.0


# ---- functions called remotely


def add(a, b):
    return a + b


def add_kw(a, b=0, *, c=0):
    return a + b + c


def whoami():
    return rpc.get_worker_info().name


def raise_value_error(msg):
    raise ValueError(msg)


class CustomError(Exception):
    pass


def raise_custom(msg):
    raise CustomError(msg)


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def scale_array(a, s):
    return a * s


def array_info(a):
    return (a.dtype.str, a.shape, bool(a.flags.writeable), float(a.sum()))


def echo(x):
    return x


def nested_add(to, a, b):
    # A call made from inside a call, on the pool.
    return rpc.rpc_sync(to, add, args=(a, b))


def rref_sum(rref, extra):
    # The RRef arrives in the arguments; its owner may be elsewhere.
    return sum(rref.to_here()) + extra


class Counter:
    def __init__(self, start):
        self.n = start
        self.lock = threading.Lock()

    def bump(self, by):
        with self.lock:
            self.n += by
            return self.n

    def value(self):
        return self.n


_live = weakref.WeakSet()


class Tracked:
    """A value whose liveness its worker can report (RRef lifetime)."""

    def __init__(self, payload):
        self.payload = payload
        _live.add(self)


def make_tracked(payload):
    return Tracked(payload)


def live_tracked():
    gc.collect()
    return len(_live)


_pending = {}
_pending_lock = threading.Lock()


@rpc.functions.async_execution
def add_later(key, x):
    # Replies only when release_later(key) runs: no pool thread waits meanwhile.
    fut = Future()
    with _pending_lock:
        _pending[key] = (fut, x)
    return fut


def pending_count():
    with _pending_lock:
        return len(_pending)


def release_later(key, y):
    with _pending_lock:
        fut, x = _pending.pop(key)
    fut.set_result(x + y)
    return True


@rpc.functions.async_execution
def chained_add(to, a, b):
    # async_execution over an RPC's own future: the reply follows it.
    return rpc.rpc_async(to, add, args=(a, b)).then(lambda f: f.value() * 10)


def py_triple(x):
    return 3 * x


def py_scale(t, s):
    return t * s


_released = threading.Event()


def release():
    """Lets a dynamic member leave (it waits for this after joining)."""
    _released.set()
    return True


# ---- roles


def serve(name):
    """Serves calls until everyone shuts down."""


def py_for_cpp(name):
    """Registers functions C++ callers call by name and signature."""
    rpc.register_function("py_triple", py_triple, "(int64) -> int64")
    rpc.register_function("py_scale", py_scale, "(Tensor, float64) -> Tensor")


ROLES_BEFORE_INIT = {"py_for_cpp": py_for_cpp}


def main():
    name, rank, world, init, role = sys.argv[1:6]
    world_size = None if world == "dynamic" else int(world)
    if role in ROLES_BEFORE_INIT:
        ROLES_BEFORE_INIT[role](name)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=RPC_TIMEOUT, num_worker_threads=8)
    rpc.init_rpc(name, rank=int(rank), world_size=world_size, rpc_backend_options=opts)
    print(f"{name}: up", flush=True)
    if world_size is None and not _released.wait(60):
        print(f"{name}: never released", flush=True)
        sys.exit(3)
    timeout = float(os.environ.get("FERRY_TEST_SHUTDOWN_TIMEOUT", "60"))
    rpc.shutdown(timeout=timeout)
    print(f"{name}: down", flush=True)
