"""One job, two languages: this process ("driver", Python), a C++ worker ("cpp",
tests/python/cpp_peer.cc) and a Python worker ("py") that registered functions for C++
callers. Python calls C++ functions by name; C++ calls Python functions by name."""

import sys

import numpy as np
import pytest

import ferry.rpc as rpc

import harness
import workers


@pytest.fixture(scope="module", autouse=True)
def group(tmp_path_factory):
    init = "file://" + str(tmp_path_factory.mktemp("rdzv") / "store")
    procs = [harness.spawn_cpp("cpp", 1, 3, init, "--call-python", "py"),
             harness.spawn_python("py", 2, 3, init, role="py_for_cpp")]
    opts = rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=20)
    try:
        rpc.init_rpc("driver", rank=0, world_size=3, rpc_backend_options=opts)
    except BaseException:
        for p in procs:
            p.kill()
        harness.finish(procs, timeout=5)
        raise
    yield procs
    rpc.shutdown(timeout=30)
    outputs = harness.finish(procs, timeout=30)
    # The C++ worker called the Python worker's functions and checked their answers.
    assert "python answered py_triple=42" in outputs[0], outputs[0]


def test_python_calls_cpp_functions_by_name():
    assert rpc.rpc_sync("cpp", "add", args=(40, 2)) == 42
    assert rpc.rpc_sync("cpp", "noop") is None
    assert rpc.rpc_async("cpp", "add", args=(1, 2)).wait() == 3
    label, total, n = rpc.rpc_sync("cpp", "summary", args=([1.5, 2.5], "s", {"x": 3}))
    assert (label, total, n) == ("s", 4.0, 5)
    assert rpc.rpc_sync("cpp", "summary", args=([], None, {}))[0] == "none"


def test_tensors_to_cpp_functions():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = rpc.rpc_sync("cpp", "scale", args=(a, 3.0))
    if "torch" in sys.modules:  # C++ results come back as torch tensors then
        b = b.numpy()
    assert isinstance(b, np.ndarray) and b.dtype == np.float32
    np.testing.assert_array_equal(b, a * 3)
    big = np.random.default_rng(0).random(1 << 18)  # 2 MiB of float64
    back = rpc.rpc_sync("cpp", "echo", args=(big,))
    np.testing.assert_array_equal(back.numpy() if "torch" in sys.modules else back, big)


def test_cpp_errors():
    with pytest.raises(rpc.RpcError) as e:
        rpc.rpc_sync("cpp", "fail", args=("out of spoons",))
    assert "out of spoons" in str(e.value) and "cpp" in str(e.value)
    with pytest.raises(rpc.RpcError, match="no function named \"missing\""):
        rpc.rpc_sync("cpp", "missing", args=(1,))
    with pytest.raises(TypeError, match="argument 2 of \"add\": expected int64, got str"):
        rpc.rpc_sync("cpp", "add", args=(1, "2"))
    with pytest.raises(TypeError, match="takes 2 arguments, got 1"):
        rpc.rpc_sync("cpp", "add", args=(1,))
    with pytest.raises(ValueError, match="does not fit in int64"):
        rpc.rpc_sync("cpp", "add", args=(1, 1 << 70))
    with pytest.raises(TypeError, match="positional"):
        rpc.rpc_sync("cpp", "add", args=(1,), kwargs={"b": 2})
    # A Python function cannot run on a C++ worker: it says so.
    with pytest.raises(rpc.RpcError, match="ferry.python"):
        rpc.rpc_sync("cpp", workers.add, args=(1, 2))


def test_cpp_calls_python_inside_a_python_call():
    # driver -> cpp (C++ "relay_triple") -> py (Python "py_triple", registered for C++).
    assert rpc.rpc_sync("cpp", "relay_triple", args=("py", 5)) == 15


def test_remote_of_a_cpp_function():
    r = rpc.remote("cpp", "add", args=(20, 22))
    assert r.owner_name() == "cpp" and r.to_here() == 42


def test_torch_tensors_to_cpp():
    torch = pytest.importorskip("torch")
    t = torch.arange(5, dtype=torch.float64)
    out = rpc.rpc_sync("cpp", "scale", args=(t, 2.0))
    # With torch imported, C++ tensors come back as torch tensors.
    assert isinstance(out, torch.Tensor) and torch.equal(out, t * 2)
