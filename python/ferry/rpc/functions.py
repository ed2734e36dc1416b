"""ferry.rpc.functions.async_execution, as torch.distributed.rpc.functions's."""

import functools

__all__ = ["async_execution"]


def async_execution(fn):
    """Marks `fn` as returning a ferry.futures.Future: when it runs as a remote call, the
    reply goes once that future completes (with its value or exception), and no pool
    thread waits meanwhile. Put it innermost under @staticmethod or @classmethod.
    remote() of such a function waits for the future on the owner's pool thread.

        @rpc.functions.async_execution
        def add_later(x):
            fut = ferry.futures.Future()
            ...                       # someone calls fut.set_result(x + 1) later
            return fut
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    wrapper._ferry_async_execution = True
    return wrapper
