"""ferry.rpc between real processes: this test process is worker "driver" (rank 0) of a
static group of three, with two Python workers ("w1", "w2") started by harness.py."""

import gc
import os
import pickle
import signal
import threading
import time

import numpy as np
import pytest

import ferry.rpc as rpc
from ferry.futures import Future, collect_all, wait_all

import harness
import workers


@pytest.fixture(scope="module", autouse=True)
def group(tmp_path_factory):
    init = "file://" + str(tmp_path_factory.mktemp("rdzv") / "store")
    procs = [harness.spawn_python(f"w{r}", r, 3, init) for r in (1, 2)]
    opts = rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=20, num_worker_threads=8)
    try:
        rpc.init_rpc("driver", rank=0, world_size=3, rpc_backend_options=opts)
    except BaseException:
        for p in procs:
            p.kill()
        harness.finish(procs, timeout=5)
        raise
    yield
    rpc.shutdown(timeout=30)
    harness.finish(procs, timeout=30)


def test_rpc_sync_runs_the_function_on_the_callee():
    assert rpc.rpc_sync("w1", workers.add, args=(1, 2)) == 3
    assert rpc.rpc_sync("w1", workers.whoami) == "w1"
    assert rpc.rpc_sync("w2", workers.whoami) == "w2"
    assert rpc.rpc_sync("w1", workers.add_kw, args=(1,), kwargs={"b": 2, "c": 3}) == 6
    # The destination as a WorkerInfo or an id; builtins pickle by reference too.
    assert rpc.rpc_sync(rpc.get_worker_info("w2"), max, args=(3, 9)) == 9
    assert rpc.rpc_sync(1, workers.whoami) == "w1"


def test_rpc_async_future():
    futs = [rpc.rpc_async("w1", workers.add, args=(i, i)) for i in range(50)]
    assert [f.wait() for f in futs] == [2 * i for i in range(50)]
    f = rpc.rpc_async("w2", workers.sleep_then, args=(0.2, "late"))
    assert not f.done()
    assert f.wait() == "late"
    assert f.done() and f.value() == "late"


def test_future_then_and_callbacks():
    f = rpc.rpc_async("w1", workers.sleep_then, args=(0.1, 20))
    seen = []
    done = threading.Event()
    f.add_done_callback(lambda fut: (seen.append(fut.value()), done.set()))
    g = f.then(lambda fut: fut.value() + 1).then(lambda fut: fut.value() * 2)
    assert g.wait() == 42
    assert done.wait(5) and seen == [20]
    # A callback added after completion runs at once.
    late = []
    f.add_done_callback(lambda fut: late.append(fut.wait()))
    assert late == [20]
    # then() sees the remote error as the future's exception.
    err = rpc.rpc_async("w1", workers.raise_value_error, args=("nope",))
    h = err.then(lambda fut: fut.wait())
    with pytest.raises(ValueError, match="nope"):
        h.wait()
    assert collect_all([rpc.rpc_async("w1", workers.add, args=(1, 1))]).wait()[0].value() == 2
    assert wait_all([rpc.rpc_async("w2", workers.add, args=(2, 2))]) == [4]


def test_plain_future_set_result_and_errors():
    f = Future()
    assert not f.done()
    with pytest.raises(RuntimeError, match="not complete"):
        f.value()
    with pytest.raises(rpc.RpcTimeoutError):
        f.wait(timeout=0.05)
    threading.Timer(0.05, lambda: f.set_result(7)).start()
    assert f.wait(timeout=5) == 7
    with pytest.raises(RuntimeError, match="already complete"):
        f.set_result(8)
    g = Future()
    g.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        g.wait()


def test_worker_infos():
    me = rpc.get_worker_info()
    assert (me.name, me.id) == ("driver", 0)
    w1 = rpc.get_worker_info("w1")
    assert w1 == rpc.WorkerInfo("w1", 1) and repr(w1) == "WorkerInfo(id=1, name=w1)"
    assert sorted(w.name for w in rpc.get_worker_infos()) == ["driver", "w1", "w2"]
    assert pickle.loads(pickle.dumps(w1)) == w1
    with pytest.raises(rpc.RpcError) as e:
        rpc.get_worker_info("nobody")
    assert e.value.code == "NOT_FOUND" and "nobody" in str(e.value)


def test_numpy_arrays_travel_out_of_band():
    a = np.arange(1 << 16, dtype=np.float32).reshape(256, 256)  # 256 KiB: beyond the inline size
    b = rpc.rpc_sync("w1", workers.scale_array, args=(a, 2.0))
    assert isinstance(b, np.ndarray) and b.dtype == np.float32 and b.shape == (256, 256)
    np.testing.assert_array_equal(b, a * 2)
    # What arrives is a writable array over the received buffer.
    dtype, shape, writeable, total = rpc.rpc_sync("w1", workers.array_info, args=(a,))
    assert (dtype, shape, writeable, total) == ("<f4", (256, 256), True, float(a.sum()))
    # Inside containers, several dtypes, a view that is not contiguous (pickled as usual).
    value = {"i": np.arange(10, dtype=np.int64), "b": np.array([True, False]),
             "t": [np.ones(3, dtype=np.float16)], "view": np.arange(12).reshape(3, 4)[:, 1],
             "obj": np.array([None, "x"], dtype=object)}
    back = rpc.rpc_sync("w2", workers.echo, args=(value,))
    assert set(back) == set(value)
    np.testing.assert_array_equal(back["i"], value["i"])
    np.testing.assert_array_equal(back["b"], value["b"])
    assert back["b"].dtype == np.bool_
    np.testing.assert_array_equal(back["t"][0], value["t"][0])
    np.testing.assert_array_equal(back["view"], value["view"])
    assert list(back["obj"]) == [None, "x"]


def test_torch_tensors_travel_out_of_band():
    torch = pytest.importorskip("torch")
    t = torch.arange(100000, dtype=torch.float64)
    back = rpc.rpc_sync("w1", workers.echo, args=({"t": t, "n": 3},))
    assert isinstance(back["t"], torch.Tensor) and torch.equal(back["t"], t) and back["n"] == 3
    g = torch.ones(4, requires_grad=True)
    b = torch.tensor([True, False, True])
    p = torch.nn.Parameter(torch.zeros(2))
    g2, b2, p2 = rpc.rpc_sync("w2", workers.echo, args=((g, b, p),))
    assert g2.requires_grad and torch.equal(g2.detach(), g.detach())
    assert b2.dtype == torch.bool and torch.equal(b2, b)
    assert isinstance(p2, torch.nn.Parameter)
    # A non-contiguous view arrives as the values it shows.
    v = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(rpc.rpc_sync("w1", workers.echo, args=(v,)), v)


def test_remote_exception_keeps_type_message_traceback_and_worker():
    with pytest.raises(ValueError) as e:
        rpc.rpc_sync("w1", workers.raise_value_error, args=("bad input 17",))
    text = str(e.value)
    assert "On WorkerInfo(id=1, name=w1)" in text
    assert "bad input 17" in text
    assert "Traceback (most recent call last)" in text and "raise_value_error" in text
    with pytest.raises(workers.CustomError, match="custom"):
        rpc.rpc_async("w2", workers.raise_custom, args=("custom",)).wait()


def test_unknown_worker():
    with pytest.raises(rpc.RpcError) as e:
        rpc.rpc_sync("nobody", workers.add, args=(1, 2))
    assert e.value.code == "NOT_FOUND" and "nobody" in str(e.value)
    f = rpc.rpc_async("nobody", workers.add, args=(1, 2))
    with pytest.raises(rpc.RpcError, match="nobody"):
        f.wait()
    with pytest.raises(rpc.RpcError, match="nobody"):
        rpc.remote("nobody", workers.add, args=(1, 2)).to_here()


def test_unpicklable_argument_raises_before_sending():
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        rpc.rpc_sync("w1", workers.echo, args=(lambda: 1,))
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        rpc.rpc_async("w1", lambda: 1)
    with pytest.raises(TypeError, match="lock"):
        rpc.rpc_sync("w1", workers.echo, args=(threading.Lock(),))
    # The group is unharmed.
    assert rpc.rpc_sync("w1", workers.add, args=(2, 2)) == 4


def test_unpicklable_result_is_the_callers_error():
    with pytest.raises(Exception, match="lock"):
        rpc.rpc_sync("w1", threading.Lock)


def test_timeout():
    start = time.monotonic()
    with pytest.raises(rpc.RpcTimeoutError) as e:
        rpc.rpc_sync("w2", workers.sleep_then, args=(3, None), timeout=0.3)
    assert time.monotonic() - start < 2.5
    assert e.value.code == "DEADLINE_EXCEEDED"
    assert isinstance(e.value, TimeoutError) and isinstance(e.value, RuntimeError)
    with pytest.raises(rpc.RpcTimeoutError):
        rpc.rpc_async("w2", workers.sleep_then, args=(3, None), timeout=0.3).wait()


def test_unknown_cpp_function_on_a_python_worker():
    with pytest.raises(rpc.RpcError, match="no function named \"no_such\""):
        rpc.rpc_sync("w1", "no_such", args=(1,))


def test_nested_calls_run_on_the_pool():
    assert rpc.rpc_sync("w1", workers.nested_add, args=("w2", 5, 6)) == 11
    # A call back into the caller, served by the driver's pool while it waits.
    assert rpc.rpc_sync("w1", workers.nested_add, args=("driver", 1, 1)) == 2


def test_calls_run_concurrently_and_waits_release_the_gil():
    # Four 0.5 s calls to one worker finish together: its pool runs them at once and
    # holds the GIL only while Python runs (time.sleep releases it).
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    t = threading.Thread(target=spin)
    t.start()
    start = time.monotonic()
    futs = [rpc.rpc_async("w1", workers.sleep_then, args=(0.5, i)) for i in range(4)]
    assert rpc.rpc_sync("w2", workers.sleep_then, args=(0.5, "sync")) == "sync"
    assert [f.wait() for f in futs] == [0, 1, 2, 3]
    elapsed = time.monotonic() - start
    stop.set()
    t.join()
    assert elapsed < 1.5, f"four 0.5 s calls took {elapsed:.2f} s"
    # This thread kept running Python while the main thread waited.
    assert ticks[0] > 50, ticks[0]


def test_remote_and_rref_api():
    r = rpc.remote("w1", workers.Counter, args=(10,))
    assert r.owner() == rpc.get_worker_info("w1") and r.owner_name() == "w1"
    assert not r.is_owner()
    assert r.rpc_sync().bump(5) == 15
    assert r.rpc_async().bump(1).wait() == 16
    v = r.remote().value()
    assert v.owner_name() == "w1" and v.to_here() == 16
    # A value that cannot be pickled cannot be fetched; the error says why.
    with pytest.raises(rpc.RpcError, match="cannot pickle the RRef's value: .*lock"):
        r.to_here()
    with pytest.raises(rpc.RpcError, match="owner|not"):
        r.local_value()
    # An RRef in the arguments of a call to a third worker.
    data = rpc.remote("w2", workers.echo, args=([1, 2, 3],))
    assert data.to_here() == [1, 2, 3]
    assert rpc.rpc_sync("w1", workers.rref_sum, args=(data, 4)) == 10
    # The creation's error comes out of to_here().
    bad = rpc.remote("w1", workers.raise_value_error, args=("no value",))
    with pytest.raises(ValueError, match="no value"):
        bad.to_here()
    with pytest.raises(ValueError, match="no value"):
        bad.rpc_sync().anything()
    with pytest.raises(TypeError, match="RRef"):
        pickle.dumps(r)


def test_local_rref():
    obj = workers.Counter(1)
    r = rpc.RRef(obj)
    assert r.is_owner() and r.owner_name() == "driver"
    assert r.local_value() is obj and r.to_here() is obj
    # A worker fetches it and calls through it.
    assert rpc.rpc_sync("w1", workers.rref_sum, args=(rpc.RRef([5, 6]), 0)) == 11
    # remote() to oneself keeps the live value here.
    me = rpc.remote("driver", workers.Counter, args=(3,))
    assert me.is_owner() and me.local_value().bump(1) == 4


def test_rref_lifetime_owner_frees_when_last_user_drops():
    r = rpc.remote("w2", workers.make_tracked, args=("x" * 10,))
    assert r.to_here().payload == "x" * 10
    assert rpc.rpc_sync("w2", workers.live_tracked) == 1
    # Shared with w1, which drops its reference when its call ends.
    assert rpc.rpc_sync("w1", workers.rref_sum, args=(rpc.remote("w2", workers.echo, args=([1],)), 0)) == 1
    del r
    gc.collect()
    harness.wait_until(lambda: rpc.rpc_sync("w2", workers.live_tracked) == 0, 10, "w2 freed the value")


def test_async_execution():
    f = rpc.rpc_async("w1", workers.add_later, args=("k1", 40))
    harness.wait_until(lambda: rpc.rpc_sync("w1", workers.pending_count) == 1, 10, "add_later ran on w1")
    assert not f.done()  # the reply waits for the future on w1
    assert rpc.rpc_sync("w1", workers.release_later, args=("k1", 2))
    assert f.wait() == 42
    assert rpc.rpc_sync("w1", workers.chained_add, args=("w2", 1, 2)) == 30
    # Many held at once with a pool of 8 threads: none of them blocks a thread.
    futs = [rpc.rpc_async("w2", workers.add_later, args=(f"m{i}", i)) for i in range(20)]
    harness.wait_until(lambda: rpc.rpc_sync("w2", workers.pending_count) == 20, 10, "20 replies held on w2")
    for i in range(20):
        rpc.rpc_sync("w2", workers.release_later, args=(f"m{i}", 1))
    assert [f.wait() for f in futs] == [i + 1 for i in range(20)]


def test_ctrl_c_interrupts_a_wait():
    # SIGINT while blocked in rpc_sync (and in Future.wait) raises KeyboardInterrupt in
    # the waiting thread soon after, not when the call ends.
    for wait in (lambda: rpc.rpc_sync("w1", workers.sleep_then, args=(3, None)),
                 lambda: rpc.rpc_async("w2", workers.sleep_then, args=(3, None)).wait()):
        timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            wait()
        timer.join()
        assert time.monotonic() - start < 2
