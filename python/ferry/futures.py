"""ferry.futures.Future: the result of an asynchronous call, as torch.futures.Future.

A future completes once, with a value or an exception. ``wait()`` blocks (releasing the
GIL; Ctrl-C interrupts it with KeyboardInterrupt) and returns the value or raises the
exception. ``then(cb)`` returns a new future completed with ``cb(self)``'s result (or the
exception it raised); ``add_done_callback(cb)`` runs ``cb(self)``. Callbacks run on the
thread that completes the future (for an RPC, one of ferry's pool threads), or at once
on the calling thread when the future is already complete; keep them short.
"""

import logging
import threading

__all__ = ["Future", "collect_all", "wait_all"]

_log = logging.getLogger(__name__)
_UNSET = object()


class Future:
    """A value that arrives later. Thread-safe: any method may be called from any thread."""

    __slots__ = ("_cond", "_done", "_value", "_exception", "_callbacks", "_native", "_decode", "__weakref__")

    def __init__(self, *, devices=None):
        # `devices` is accepted for torch.futures.Future's signature; ferry's futures
        # carry CPU values to Python (CUDA tensors follow the device maps).
        self._cond = threading.Condition(threading.Lock())
        self._done = False
        self._value = None
        self._exception = None
        self._callbacks = []
        self._native = None  # a _ferry.PendingCall when the value is an RPC's reply
        self._decode = None  # raw reply -> value (may raise the remote exception)

    @classmethod
    def _from_native(cls, native, decode):
        f = cls()
        f._native = native
        f._decode = decode
        return f

    def done(self):
        """Whether the future has completed (with a value or an exception)."""
        if self._done:
            return True
        return self._native is not None and self._native.done()

    def _settle_native(self, timeout=None):
        # Waits for the native reply and decodes it; the first thread to get here sets it.
        try:
            value = self._decode(self._native.wait(timeout))
        except BaseException as e:  # the remote exception, or ferry's RpcError
            if not self._native.done():
                raise  # the wait itself ran out or was interrupted: the call goes on
            self._complete(None, e)
        else:
            self._complete(value, None)

    def _on_native_done(self):
        if not self._done:
            self._settle_native()

    def wait(self, timeout=None):
        """Blocks until complete; returns the value or raises the exception.

        ``timeout`` (seconds; ferry's addition) raises ferry.rpc.RpcTimeoutError when the
        future is still not complete then; the future itself is unaffected.
        """
        if not self._done:
            if self._native is not None:
                self._settle_native(timeout)
            else:
                with self._cond:
                    if not self._cond.wait_for(lambda: self._done, timeout):
                        from .rpc import RpcTimeoutError

                        raise RpcTimeoutError("DEADLINE_EXCEEDED", f"future not complete after waiting {timeout} s")
        if self._exception is not None:
            raise self._exception
        return self._value

    def value(self):
        """The value of a completed future (raises its exception); raises RuntimeError if
        it is not complete yet: call wait() first, or use it inside a then() callback."""
        if not self.done():
            raise RuntimeError("Future.value(): the future is not complete yet; call wait() first")
        return self.wait()

    def set_result(self, result):
        """Completes the future with `result`; RuntimeError if it already completed."""
        if not self._complete(result, None):
            raise RuntimeError("Future.set_result: the future is already complete")

    def set_exception(self, result):
        """Completes the future with the exception `result` (wait() raises it)."""
        if not isinstance(result, BaseException):
            raise TypeError(f"Future.set_exception expects an exception, got {type(result).__name__}")
        if not self._complete(None, result):
            raise RuntimeError("Future.set_exception: the future is already complete")

    def _complete(self, value, exception):
        with self._cond:
            if self._done:
                return False
            self._value = value
            self._exception = exception
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        for cb in callbacks:  # outside the lock: a callback may use this future
            self._run_callback(cb)
        return True

    def _run_callback(self, cb):
        try:
            cb(self)
        except Exception:
            _log.exception("ferry.futures.Future: a done-callback raised; ignored")

    def add_done_callback(self, callback):
        """Runs ``callback(self)`` once the future completes (now, if it has)."""
        with self._cond:
            if not self._done:
                self._callbacks.append(callback)
                first = len(self._callbacks) == 1
            else:
                first = None
        if first is None:
            self._run_callback(callback)
        elif first and self._native is not None:
            self._native.add_done_callback(self._on_native_done)

    def then(self, callback):
        """A new future, completed with ``callback(self)``'s return value, or with the
        exception it raised. Inside the callback, ``fut.wait()``/``fut.value()`` give this
        future's value (or raise its exception)."""
        out = Future()

        def run(fut):
            try:
                result = callback(fut)
            except BaseException as e:
                out._complete(None, e)
            else:
                out._complete(result, None)

        self.add_done_callback(run)
        return out

    def __repr__(self):
        state = "done" if self.done() else "pending"
        return f"<ferry.futures.Future {state}>"


def collect_all(futures):
    """A future completed with the list of `futures` once all of them are complete."""
    futures = list(futures)
    out = Future()
    if not futures:
        out.set_result([])
        return out
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_):
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            out._complete(futures, None)

    for f in futures:
        f.add_done_callback(one_done)
    return out


def wait_all(futures):
    """Waits for every future and returns their values; raises the first error met."""
    return [f.wait() for f in futures]
