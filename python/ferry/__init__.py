"""ferry: RPC for distributed tensor programs.

``ferry.rpc`` mirrors ``torch.distributed.rpc``: a program changes only its import.
``ferry.futures.Future`` is what ``rpc_async`` returns. docs/python.md says more.
"""

__version__ = "0.1.0"

__all__ = ["futures", "rpc"]


def __getattr__(name):
    # Submodules load on first use, so that `import ferry` stays cheap.
    if name in __all__:
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'ferry' has no attribute {name!r}")
