"""ferry.rpc: torch.distributed.rpc's API over ferry (docs/python.md).

    import ferry.rpc as rpc              # instead of: import torch.distributed.rpc as rpc
    rpc.init_rpc("worker0", rank=0, world_size=2)
    three = rpc.rpc_sync("worker1", operator.add, args=(1, 2))
    rpc.shutdown()
"""

from . import functions
from .api import (
    BackendType,
    RRef,
    RpcError,
    RpcTimeoutError,
    TensorPipeRpcBackendOptions,
    WorkerInfo,
    get_worker_info,
    get_worker_infos,
    init_rpc,
    is_initialized,
    register_function,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)

__all__ = [
    "BackendType",
    "RRef",
    "RpcError",
    "RpcTimeoutError",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "functions",
    "get_worker_info",
    "get_worker_infos",
    "init_rpc",
    "is_initialized",
    "register_function",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
