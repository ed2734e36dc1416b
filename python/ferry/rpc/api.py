"""The functions of ferry.rpc (see the package's docstring and docs/python.md)."""

import atexit
import enum
import os
import threading

from .. import _ferry, _serde
from ..futures import Future

# PyTorch's defaults (torch.distributed.rpc.constants).
DEFAULT_RPC_TIMEOUT_SEC = 60.0
DEFAULT_INIT_METHOD = "env://"
DEFAULT_NUM_WORKER_THREADS = 16
DEFAULT_SHUTDOWN_TIMEOUT = 300.0
UNSET_RPC_TIMEOUT = -1.0


class RpcError(RuntimeError):
    """An RPC failed in ferry (not in the remote function): `code` is the canonical status
    code's name (NOT_FOUND, UNAVAILABLE, DEADLINE_EXCEEDED, FAILED_PRECONDITION,
    INVALID_ARGUMENT, CANCELLED, ...), and the message says what, where and why. A
    RuntimeError, as PyTorch's RPC errors are."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


class RpcTimeoutError(RpcError, TimeoutError):
    """An RPC (or a wait) ran past its timeout."""


class BackendType(enum.Enum):
    """The RPC backends ferry.rpc offers: TENSORPIPE (ferry's agent, whose transports
    include TensorPipe's and ferry's shared-memory ring)."""

    TENSORPIPE = "TENSORPIPE"


class WorkerInfo:
    """A worker of the group: its unique `name` and its `id` (its rank)."""

    __slots__ = ("name", "id")

    def __init__(self, name, id):
        self.name = name
        self.id = id

    def __eq__(self, other):
        return isinstance(other, WorkerInfo) and (self.name, self.id) == (other.name, other.id)

    def __hash__(self):
        return hash((self.name, self.id))

    def __repr__(self):
        return f"WorkerInfo(id={self.id}, name={self.name})"

    def __reduce__(self):
        return (WorkerInfo, (self.name, self.id))


def _device_name(d):
    if isinstance(d, int):
        return f"cuda:{d}"
    return str(d)  # "cpu", "cuda:1", or a torch.device


class TensorPipeRpcBackendOptions:
    """The options of init_rpc, as PyTorch's: `num_worker_threads` (the pool serving calls),
    `rpc_timeout` (seconds; the default per call; 0: none), `init_method` (env://,
    tcp://HOST:PORT, file://PATH), `device_maps` ({worker: {my device: its device}}),
    `devices` (this worker's devices; default: those the maps name). `_transports` and
    `_channels` pick ferry's transports (ring, tcp, shm, uv, ibv) and TensorPipe's channels."""

    def __init__(self, *, num_worker_threads=DEFAULT_NUM_WORKER_THREADS, rpc_timeout=DEFAULT_RPC_TIMEOUT_SEC,
                 init_method=DEFAULT_INIT_METHOD, device_maps=None, devices=None, _transports=None,
                 _channels=None):
        self.num_worker_threads = num_worker_threads
        self.rpc_timeout = rpc_timeout
        self.init_method = init_method
        self.device_maps = {}
        for worker, m in (device_maps or {}).items():
            self.set_device_map(worker, m)
        self.devices = [_device_name(d) for d in devices] if devices else []
        self._transports = _transports
        self._channels = _channels

    def set_device_map(self, to, device_map):
        """Maps this worker's devices to worker `to`'s: a CUDA tensor on my device d arrives
        on device_map[d] there (and results come back through the reverse map). Merges
        into the map already set; a source given a second, different target is an error."""
        current = self.device_maps.setdefault(to, {})
        for src, dst in device_map.items():
            s, d = _device_name(src), _device_name(dst)
            if s in current and current[s] != d:
                raise ValueError(f"set_device_map to {to!r}: {s} is already mapped to {current[s]}, not to {d}")
            current[s] = d

    def set_devices(self, devices):
        self.devices = [_device_name(d) for d in devices]


_lock = threading.Lock()


def _env_int(name):
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def init_rpc(name, backend=None, rank=-1, world_size=None, rpc_backend_options=None):
    """Starts this process's worker `name` and joins the group; returns once every worker
    of a static group has started. `rank` -1 reads RANK from the environment (env://);
    `world_size` None reads WORLD_SIZE with env://, and without it joins a dynamic group
    (workers join and leave while it runs; docs/dynamic_groups.md). Raises RpcError,
    naming what was wrong: a second init, a bad name, rank or world size, a rendezvous
    or device-map error (which every worker reports alike)."""
    if backend is None:
        backend = BackendType.TENSORPIPE
    if backend != BackendType.TENSORPIPE and str(backend) not in ("TENSORPIPE", "BackendType.TENSORPIPE"):
        raise ValueError(f"init_rpc: backend {backend!r} is not offered by ferry.rpc; use BackendType.TENSORPIPE")
    options = rpc_backend_options or TensorPipeRpcBackendOptions()
    if not isinstance(options, TensorPipeRpcBackendOptions):
        raise TypeError(f"init_rpc: rpc_backend_options must be TensorPipeRpcBackendOptions, got "
                        f"{type(options).__name__}")
    env = options.init_method.startswith("env://")
    if rank is None or rank < 0:
        rank = _env_int("RANK") if env else None
        if rank is None:
            raise ValueError(f"init_rpc({name!r}): no rank given (and RANK is not set for env://)")
    if world_size is None and env:
        world_size = _env_int("WORLD_SIZE")
    with _lock:
        _ferry.init_rpc(name, int(rank), None if world_size is None else int(world_size), options.init_method,
                        float(options.rpc_timeout), int(options.num_worker_threads), options.device_maps,
                        options.devices, options._transports, options._channels)


def shutdown(graceful=True, timeout=DEFAULT_SHUTDOWN_TIMEOUT):
    """Stops this worker. Graceful (the default): waits, at most `timeout` seconds, until
    every worker has called shutdown and no calls are in flight anywhere (in a dynamic
    group: leaves it). Not graceful: pending calls fail at once. Raises RpcError when
    there is no worker, or when waiting failed (the worker is stopped all the same)."""
    with _lock:
        _ferry.shutdown(bool(graceful), float(timeout))


def is_initialized():
    return _ferry.is_initialized()


def get_worker_info(worker_name=None):
    """This worker's WorkerInfo, or the one of `worker_name` (RpcError NOT_FOUND when the
    group has no such worker)."""
    if worker_name is None:
        return WorkerInfo(*_ferry.self_info())
    return WorkerInfo(*_ferry.worker_info(worker_name))


def get_worker_infos():
    """Every worker of the group now (a dynamic group's changes over time)."""
    return [WorkerInfo(*w) for w in _ferry.worker_infos()]


def _to_name(to):
    if isinstance(to, WorkerInfo):
        return to.name
    if isinstance(to, str):
        return to
    if isinstance(to, int):
        for w in _ferry.worker_infos():
            if w[1] == to:
                return w[0]
        raise RpcError("NOT_FOUND", f"no worker has id {to}")
    raise TypeError(f"the destination must be a worker name, a WorkerInfo or an id, got {type(to).__name__}")


def _timeout(timeout):
    return None if timeout is None or timeout == UNSET_RPC_TIMEOUT else float(timeout)


def _check_cpp_call(func, kwargs):
    if kwargs:
        raise TypeError(f"function {func!r} is a C++ function: it takes positional arguments only")


def _py_payload(func, args, kwargs):
    if not callable(func):
        raise TypeError(f"func must be a callable or the name of a C++ function, got {type(func).__name__}")
    return _serde.dumps((func, tuple(args or ()), dict(kwargs or {})))


def rpc_async(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """Calls ``func(*args, **kwargs)`` on worker `to` and returns a ferry.futures.Future of
    the result. `func` is a Python callable, pickled by reference (its module and name:
    the callee must be able to import it), or a string naming a function registered in
    C++ on the callee. `timeout` in seconds (0: none; -1: the init_rpc default).
    An unpicklable argument raises here; everything else arrives through the future."""
    name = _to_name(to)
    if isinstance(func, str):
        _check_cpp_call(func, kwargs)
        try:
            native = _ferry.call_cpp(name, func, tuple(args or ()), _timeout(timeout))
        except RpcError as e:  # the signature could not be had: the future carries it
            f = Future()
            f.set_exception(e)
            return f
        return Future._from_native(native, _identity)
    native = _ferry.call_py(name, _py_payload(func, args, kwargs), _timeout(timeout))
    return Future._from_native(native, _serde.decode_reply)


def _identity(x):
    return x


def rpc_sync(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """rpc_async(...).wait(): returns the result, or raises the remote function's exception
    (same type, its message saying "On WorkerInfo(...)" and the remote traceback), or
    RpcError (unknown worker, timeout, lost worker, ...)."""
    name = _to_name(to)
    if isinstance(func, str):
        _check_cpp_call(func, kwargs)
        return _ferry.call_cpp(name, func, tuple(args or ()), _timeout(timeout)).wait()
    native = _ferry.call_py(name, _py_payload(func, args, kwargs), _timeout(timeout))
    return _serde.decode_reply(native.wait())


def remote(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """Runs ``func(*args, **kwargs)`` on worker `to` and returns at once an RRef to the
    result, which stays there. Errors (an unknown worker, the function raising) come out
    of to_here() and the calls through the RRef. `timeout` bounds the to_here() calls
    that pass none."""
    name = _to_name(to)
    if isinstance(func, str):
        _check_cpp_call(func, kwargs)
        rref = _ferry.remote_cpp(name, func, tuple(args or ()), _timeout(timeout))
    else:
        rref = _ferry.remote_py(name, _py_payload(func, args, kwargs))
    rref._timeout = _timeout(timeout)
    return rref


def register_function(name, func, signature):
    """Registers `func` under `name` for C++ callers, which call it with the C++
    `signature` they use, e.g. "(int64, Tensor) -> Tensor" (serialization/types.h spells
    the types). The arguments arrive as Python values (Tensors as numpy arrays, or torch
    tensors when torch is imported), and the result is converted to the signature's type.
    Python callers call Python functions directly instead."""
    _ferry.register_function(name, signature, func)


# ---- RRef


def _invoke_rref_method(rref, method, args, kwargs):
    return getattr(rref.local_value(), method)(*args, **kwargs)


class _Proxy:
    def __init__(self, rref, kind, timeout):
        self._rref = rref
        self._kind = kind
        self._timeout = timeout

    def __getattr__(self, method):
        rref, kind, timeout = self._rref, self._kind, self._timeout

        def call(*args, **kwargs):
            fn = {"sync": rpc_sync, "async": rpc_async, "remote": remote}[kind]
            return fn(rref.owner_name(), _invoke_rref_method, args=(rref, method, args, kwargs), timeout=timeout)

        return call


class RRef:
    """A reference to a value on its owner worker (torch.distributed.rpc.RRef). RRef(value)
    makes a local one, owned here. Pass RRefs in the arguments of calls to share them; the
    owner frees the value once no worker holds a reference any more."""

    __slots__ = ("_native", "_timeout", "__weakref__")

    def __init__(self, value=None, type_hint=None, *, _native=None):
        if _native is None:
            _native = _ferry.make_local_rref(value)._native
        self._native = _native
        self._timeout = None

    @classmethod
    def _wrap(cls, native):
        return cls(_native=native)

    def owner(self):
        """The WorkerInfo of the worker the value lives on."""
        return WorkerInfo(*self._native.owner())

    def owner_name(self):
        return self._native.owner()[0]

    def is_owner(self):
        return self._native.is_owner()

    def local_value(self):
        """On the owner: the value itself (the live object). RpcError elsewhere."""
        is_exception, value = self._native.local_value()
        if is_exception:
            raise _serde.rebuild_exception(value)
        return value

    def to_here(self, timeout=UNSET_RPC_TIMEOUT):
        """A copy of the value, fetched from the owner (on the owner: the value itself).
        Raises the creation's error (the function's exception, an unknown worker)."""
        t = _timeout(timeout)
        if t is None:
            t = self._timeout
        is_exception, value = self._native.to_here(t)
        if is_exception:
            raise _serde.rebuild_exception(value)
        if is_exception is None and isinstance(value, tuple) and self._native.type() == "PyObject":
            return _serde.decode_reply(value)
        return value

    def rpc_sync(self, timeout=UNSET_RPC_TIMEOUT):
        """rref.rpc_sync().method(*args) runs method on the value, on its owner, and waits."""
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout=UNSET_RPC_TIMEOUT):
        """rref.rpc_async().method(*args): a Future of the method's result, run on the owner."""
        return _Proxy(self, "async", timeout)

    def remote(self, timeout=UNSET_RPC_TIMEOUT):
        """rref.remote().method(*args): an RRef to the method's result, on the owner."""
        return _Proxy(self, "remote", timeout)

    def __reduce__(self):
        raise TypeError("an RRef travels only inside the arguments of ferry.rpc calls, not through pickle")

    def __repr__(self):
        return f"RRef({self._native.describe()})"


def _serve(data, tensors, rrefs, defer):
    """Runs one call from a Python caller, on ferry's pool (the GIL held)."""
    try:
        func, args, kwargs = _serde.loads(data, tensors, rrefs)
        result = func(*args, **kwargs)
        if getattr(func, "_ferry_async_execution", False):
            if not isinstance(result, Future):
                raise TypeError(f"{getattr(func, '__qualname__', func)} is marked async_execution but returned "
                                f"{type(result).__name__}, not a ferry.futures.Future")
            reply = defer()
            result.add_done_callback(lambda f: reply.send(_result_payload(f)))
            return None
        return _serde.dumps(result)
    except BaseException as e:
        return _serde.exception_payload(e, _self_description())


def _result_payload(fut):
    try:
        return _serde.dumps(fut.wait())
    except BaseException as e:
        return _serde.exception_payload(e, _self_description())


def _make_value(data, tensors, rrefs):
    """Runs the function of a remote() call for the value its RRef keeps."""
    try:
        func, args, kwargs = _serde.loads(data, tensors, rrefs)
        result = func(*args, **kwargs)
        if getattr(func, "_ferry_async_execution", False) and isinstance(result, Future):
            result = result.wait()
        return (False, result)
    except BaseException as e:
        return (True, _serde.exception_info(e, _self_description()))


def _pickle_value(value, is_exception):
    if is_exception:
        import pickle

        return (1, pickle.dumps(value), [], [])
    return _serde.dumps(value)


def _self_description():
    try:
        return repr(get_worker_info())
    except Exception:
        return "an unknown worker"


def _tensor_to_ferry(obj, where):
    cls = type(obj)
    if cls is _ferry.Tensor:
        return obj
    if _serde._ndarray is not None and isinstance(obj, _serde._ndarray):
        t = _ferry.Tensor.from_numpy(obj)
        if t is None:
            t = _ferry.Tensor.from_numpy(_serde._np.ascontiguousarray(obj))
        if t is None:
            raise TypeError(f"{where}: numpy dtype {obj.dtype} has no ferry dtype")
        return t
    torch = _serde._torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        return _serde._torch_to_ferry(obj)
    raise TypeError(f"{where}: expected a tensor (numpy array or torch tensor), got {cls.__name__}")


def _tensor_from_ferry(t):
    torch = _serde._torch()
    if torch is not None:
        return torch.utils.dlpack.from_dlpack(t.to_dlpack())
    return t.numpy()


def _wrap_native_rref(native):
    return RRef._wrap(native)


_serde._rref_class = RRef
_ferry.set_hooks(_serve, _make_value, _pickle_value, RpcError, RpcTimeoutError, _wrap_native_rref,
                 _tensor_to_ferry, _tensor_from_ferry)


@atexit.register
def _at_exit():
    # A worker still running when Python exits stops without waiting (pending calls fail)
    # before the interpreter goes, so that ferry's threads never call into a dead one.
    try:
        if _ferry.is_initialized():
            _ferry.shutdown(False, 5.0)
    finally:
        _ferry.set_finalizing()
