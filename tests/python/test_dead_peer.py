"""A worker that dies fails its callers' calls at once, not at their timeout."""

import time

import pytest

import ferry.rpc as rpc

import harness
import workers


def test_dead_peer_fails_pending_and_later_calls_at_once(tmp_path):
    init = "file://" + str(tmp_path / "store")
    victim = harness.spawn_python("victim", 1, 2, init)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=30)
    try:
        rpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=opts)
    except BaseException:
        victim.kill()
        harness.finish([victim], timeout=5, expect={0: victim.returncode})
        raise
    try:
        assert rpc.rpc_sync("victim", workers.add, args=(1, 1)) == 2
        pending = rpc.rpc_async("victim", workers.sleep_then, args=(20, "never"))
        time.sleep(0.2)
        start = time.monotonic()
        victim.kill()
        with pytest.raises(rpc.RpcError) as e:
            pending.wait()
        assert time.monotonic() - start < 5, "the pending call waited for its timeout"
        assert e.value.code == "UNAVAILABLE" and "victim" in str(e.value)
        start = time.monotonic()
        with pytest.raises(rpc.RpcError, match="victim"):
            rpc.rpc_sync("victim", workers.add, args=(1, 1))
        assert time.monotonic() - start < 2
    finally:
        rpc.shutdown(graceful=False)
        harness.finish([victim], timeout=5, expect={0: -9})
