"""ferry.rpc used before init_rpc, and init_rpc's argument errors (one process)."""

import pytest

import ferry.rpc as rpc
from ferry.futures import Future

import workers


def test_calls_before_init_fail_naming_init_rpc():
    assert not rpc.is_initialized()
    with pytest.raises(rpc.RpcError) as e:
        rpc.rpc_sync("w1", workers.add, args=(1, 2))
    assert e.value.code == "FAILED_PRECONDITION" and "init_rpc" in str(e.value)
    f = rpc.rpc_async("w1", workers.add, args=(1, 2))
    assert isinstance(f, Future)
    with pytest.raises(rpc.RpcError, match="init_rpc"):
        f.wait()
    with pytest.raises(rpc.RpcError, match="init_rpc"):
        rpc.rpc_sync("w1", "add", args=(1, 2))
    with pytest.raises(rpc.RpcError, match="init_rpc"):
        rpc.get_worker_info()
    with pytest.raises(rpc.RpcError, match="init_rpc"):
        rpc.remote("w1", workers.add, args=(1, 2)).to_here()
    with pytest.raises(rpc.RpcError, match="init_rpc"):
        rpc.RRef(3)
    with pytest.raises(rpc.RpcError, match="no worker is running"):
        rpc.shutdown()


def test_init_rpc_argument_errors(tmp_path):
    init = "file://" + str(tmp_path / "store")
    opts = rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=5)
    with pytest.raises(rpc.RpcError, match="rank 3 out of range for world_size 2"):
        rpc.init_rpc("a", rank=3, world_size=2, rpc_backend_options=opts)
    with pytest.raises(rpc.RpcError, match="may contain only"):
        rpc.init_rpc("bad name", rank=0, world_size=1, rpc_backend_options=opts)
    with pytest.raises(ValueError, match="no rank"):
        rpc.init_rpc("a", rpc_backend_options=opts)
    with pytest.raises(ValueError, match="TENSORPIPE"):
        rpc.init_rpc("a", backend="GLOO", rank=0, world_size=1, rpc_backend_options=opts)
    with pytest.raises(TypeError, match="TensorPipeRpcBackendOptions"):
        rpc.init_rpc("a", rank=0, world_size=1, rpc_backend_options={"init_method": init})
    with pytest.raises(rpc.RpcError, match="cuda:x|device"):
        bad = rpc.TensorPipeRpcBackendOptions(init_method=init, device_maps={"b": {"cuda:x": 0}})
        rpc.init_rpc("a", rank=0, world_size=1, rpc_backend_options=bad)
    opts.set_device_map("b", {0: 1})
    with pytest.raises(ValueError, match="already mapped"):
        opts.set_device_map("b", {0: 2})
    assert opts.device_maps == {"b": {"cuda:0": "cuda:1"}}


def test_a_group_of_one_and_a_second_init(tmp_path):
    init = "file://" + str(tmp_path / "store1")
    opts = rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=5)
    rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=opts)
    try:
        assert rpc.is_initialized()
        assert rpc.rpc_sync("solo", workers.add, args=(2, 3)) == 5
        with pytest.raises(rpc.RpcError, match="already runs worker \"solo\""):
            rpc.init_rpc("again", rank=0, world_size=1, rpc_backend_options=opts)
    finally:
        rpc.shutdown()
    assert not rpc.is_initialized()
