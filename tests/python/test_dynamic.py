"""A dynamic group (init_rpc without a world size): workers join and leave while it runs."""

import ferry.rpc as rpc

import harness
import workers


def test_workers_join_and_leave(tmp_path):
    init = "file://" + str(tmp_path / "store")
    opts = rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=20)
    rpc.init_rpc("host", rank=0, world_size=None, rpc_backend_options=opts)
    try:
        assert [w.name for w in rpc.get_worker_infos()] == ["host"]
        a = harness.spawn_python("a", 1, "dynamic", init)
        harness.wait_until(lambda: "a" in [w.name for w in rpc.get_worker_infos()], 20, "a joined")
        assert rpc.rpc_sync("a", workers.whoami) == "a"
        b = harness.spawn_python("b", 2, "dynamic", init)
        harness.wait_until(lambda: "b" in [w.name for w in rpc.get_worker_infos()], 20, "b joined")
        # Members call each other, also one that joined after them.
        assert rpc.rpc_sync("a", workers.nested_add, args=("b", 2, 3)) == 5
        assert rpc.rpc_sync("b", workers.nested_add, args=("host", 4, 4)) == 8
        # Released, a and b shut down, which for a dynamic member means leaving the group
        # (it need not wait for the others).
        assert rpc.rpc_sync("a", workers.release) and rpc.rpc_sync("b", workers.release)
        harness.finish([a, b], timeout=30)
        harness.wait_until(lambda: [w.name for w in rpc.get_worker_infos()] == ["host"], 10, "a and b left")
        try:
            rpc.rpc_sync("a", workers.whoami)
        except rpc.RpcError as e:
            assert e.code in ("NOT_FOUND", "UNAVAILABLE") and "\"a\"" in str(e)
        else:
            raise AssertionError("a call to a worker that left succeeded")
    finally:
        rpc.shutdown()
