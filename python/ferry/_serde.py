"""How Python values travel: a pickle, with tensors and RRefs out of band.

numpy arrays and torch tensors found anywhere inside a value become ferry tensors that
share their memory (no copy on either side) and travel beside the pickle; the receiver
gets arrays and tensors of the same kinds, sharing the received buffer. A tensor ferry
cannot hold (an object array, a non-contiguous view of a dtype it lacks) is pickled as
usual. RRefs travel as references (the owner counts them, rpc/rref.h).
"""

import importlib
import io
import pickle
import sys
import traceback

from . import _ferry

try:  # numpy is a dependency of the package, but ferry works without it
    import numpy as _np

    _ndarray = _np.ndarray
except ImportError:  # pragma: no cover
    _np = None
    _ndarray = None

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_rref_class = None  # set by ferry.rpc


def _torch():
    return sys.modules.get("torch")


def _torch_to_ferry(t):
    torch = _torch()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)  # DLPack 0.6 has no bool
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return _ferry.Tensor.from_dlpack(torch.utils.dlpack.to_dlpack(t))


class _Pickler(pickle.Pickler):
    def __init__(self, buf, tensors, rrefs):
        super().__init__(buf, protocol=_PROTOCOL)
        self._tensors = tensors
        self._rrefs = rrefs
        torch = _torch()
        self._torch_tensor = torch.Tensor if torch is not None else None

    def persistent_id(self, obj):
        cls = type(obj)
        if cls is _ndarray:
            t = _ferry.Tensor.from_numpy(obj)
            if t is None:
                return None
            self._tensors.append(t)
            return ("n", len(self._tensors) - 1)
        if cls is _rref_class:
            self._rrefs.append(obj)
            return ("r", len(self._rrefs) - 1)
        if self._torch_tensor is not None and isinstance(obj, self._torch_tensor):
            torch = _torch()
            if cls is not torch.Tensor and cls is not torch.nn.Parameter:
                return None  # a subclass: pickled as its class says
            if obj.is_sparse or obj.is_quantized:
                return None
            try:
                t = _torch_to_ferry(obj)
            except (TypeError, RuntimeError, BufferError):
                return None
            self._tensors.append(t)
            return ("t", len(self._tensors) - 1, obj.requires_grad, obj.dtype == torch.bool,
                    cls is torch.nn.Parameter)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, buf, tensors, rrefs):
        super().__init__(buf)
        self._tensors = tensors
        self._rrefs = rrefs

    def persistent_load(self, pid):
        tag = pid[0]
        if tag == "n":
            return self._tensors[pid[1]].numpy()
        if tag == "r":
            return self._rrefs[pid[1]]
        if tag == "t":
            torch = importlib.import_module("torch")
            t = torch.utils.dlpack.from_dlpack(self._tensors[pid[1]].to_dlpack())
            _, _, requires_grad, is_bool, is_param = pid
            if is_bool:
                t = t.to(torch.bool)
            if is_param:
                return torch.nn.Parameter(t, requires_grad=requires_grad)
            if requires_grad:
                t.requires_grad_(True)
            return t
        raise pickle.UnpicklingError(f"unknown out-of-band object {tag!r}")


def dumps(obj):
    """(kind 0, pickle bytes, ferry tensors, RRefs) for `obj`; raises what pickle raises
    for an object it cannot pickle."""
    buf = io.BytesIO()
    tensors = []
    rrefs = []
    _Pickler(buf, tensors, rrefs).dump(obj)
    return (0, buf.getvalue(), tensors, rrefs)


def loads(data, tensors, rrefs):
    return _Unpickler(io.BytesIO(data), tensors, rrefs).load()


def exception_info(exc, worker):
    """What travels for an exception raised on `worker`: (module, qualname, text), the text
    being "On <worker>:" and the whole remote traceback."""
    cls = type(exc)
    text = f"On {worker}:\n" + "".join(traceback.format_exception(cls, exc, exc.__traceback__)).rstrip()
    return (cls.__module__, cls.__qualname__, text)


def exception_payload(exc, worker):
    return (1, pickle.dumps(exception_info(exc, worker), protocol=_PROTOCOL), [], [])


def rebuild_exception(info):
    """The exception to raise for `info` (exception_info's): the same type when it can be
    imported here and made from one message, else a RuntimeError naming the type."""
    module, qualname, text = info
    try:
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            return cls(text)
    except Exception:
        pass
    return RuntimeError(f"{module}.{qualname}: {text}")


def decode_reply(raw):
    """The value of a reply tuple (kind, bytes, tensors, rrefs); raises the remote
    exception for kind 1."""
    kind, data, tensors, rrefs = raw
    if kind == 1:
        raise rebuild_exception(pickle.loads(data))
    return loads(data, tensors, rrefs)
