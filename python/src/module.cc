// File: python/src/module.cc
//
// The `ferry._ferry` extension: the part of the Python package that talks to ferry's
// C++ API. ferry/rpc/*.py builds torch.distributed.rpc's API on top of it; nothing
// here is meant to be used directly.
//
// What a call from Python carries: the function "ferry.python" with signature
// "(PyObject) -> PyObject", whose one argument is a PyPayload: a pickle (of the
// function, the arguments and the keyword arguments), the tensors found inside them
// (out of band, as ferry tensors: no copy) and the RRefs. The callee's handler (set by
// the package) unpickles and runs it on ferry's pool, holding the GIL only while
// Python runs. A call of a C++-registered function is encoded by its signature
// (python/src/codec.h), which the callee tells once per (worker, function).
//
// Threads: every blocking wait releases the GIL and wakes every 100 ms to let Python
// handle signals (Ctrl-C raises KeyboardInterrupt in the waiting thread). Callbacks
// into Python from ferry's threads take the GIL; after the interpreter began to shut
// down they do nothing (finalizing()).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "python/src/codec.h"
#include "python/src/gil.h"
#include "python/src/tensors.h"
#include "rpc/call.h"
#include "rpc/internal/rref_context.h"
#include "rpc/rpc.h"
#include "rpc/rref.h"
#include "serialization/error.h"

namespace ferry::python {
namespace {

constexpr char kPyFunction[] = "ferry.python";
constexpr char kPyType[] = "PyObject";


// The package's Python callbacks and error types. Never destroyed: ferry's threads may
// look at them until the process exits.
struct Hooks {
  py::object serve;         // (bytes, tensors, rrefs, defer) -> (kind, bytes, tensors, rrefs) | None (deferred)
  py::object make_value;    // (bytes, tensors, rrefs) -> (is_exception, object)
  py::object pickle_value;  // (object, is_exception) -> (kind, bytes, tensors, rrefs)
  py::object rpc_error;     // ferry.rpc.RpcError(code, message)
  py::object timeout_error;
  py::object rref_class;    // ferry.rpc.RRef(_ferry.RRef) wraps the native handle
};
Hooks& hooks() {
  static Hooks* h = new Hooks();
  return *h;
}

// Raises the package's RpcError (RpcTimeoutError for kDeadlineExceeded) for `status`.
[[noreturn]] void raise_status(const absl::Status& status) {
  py::object cls = status.code() == absl::StatusCode::kDeadlineExceeded ? hooks().timeout_error : hooks().rpc_error;
  if (!cls) throw std::runtime_error(std::string(status.message()));
  py::object err = cls(std::string(absl::StatusCodeToString(status.code())), std::string(status.message()));
  PyErr_SetObject(cls.ptr(), err.ptr());
  throw py::error_already_set();
}

std::optional<std::chrono::milliseconds> to_timeout(std::optional<double> seconds) {
  // None or a negative value (PyTorch's UNSET_RPC_TIMEOUT is -1): the agent's default;
  // 0: no timeout.
  if (!seconds.has_value() || *seconds < 0) return std::nullopt;
  return std::chrono::milliseconds(static_cast<int64_t>(*seconds * 1000.0 + 0.5));
}

// Waits for `future` with the GIL released, waking every 100 ms for signals; a
// KeyboardInterrupt (or any signal handler's exception) propagates.
template <typename T>
void wait_interruptibly(const Future<T>& future, std::optional<double> timeout_s) {
  auto deadline = timeout_s.has_value() && *timeout_s >= 0
                      ? std::optional(std::chrono::steady_clock::now() +
                                      std::chrono::microseconds(static_cast<int64_t>(*timeout_s * 1e6)))
                      : std::nullopt;
  for (;;) {
    std::chrono::milliseconds slice(100);
    if (deadline.has_value()) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        if (future.is_ready()) return;
        raise_status(absl::DeadlineExceededError(absl::StrCat("future not complete after waiting ", *timeout_s, " s")));
      }
      slice = std::min(slice, left);
    }
    bool ready;
    {
      py::gil_scoped_release release;
      ready = future.wait_for(slice).code() != absl::StatusCode::kDeadlineExceeded || future.is_ready();
    }
    if (ready) return;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}


// ---- the payload of a Python call

class PyRRef;

struct RRefSlot {
  std::shared_ptr<internal::RRefState> state;
  std::string type;
};

struct PyPayload {
  uint8_t kind = 0;  // 0: a value; 1: an exception (pickled (module, qualname, text))
  std::string pickle;
  std::vector<Tensor> tensors;
  std::vector<RRefSlot> rrefs;

  void save(PayloadWriter& w) const {
    w(kind, pickle, tensors);
    w(cereal::make_size_tag(static_cast<cereal::size_type>(rrefs.size())));
    for (const RRefSlot& r : rrefs) {
      w(r.type);
      internal::rref_save(w, r.state, r.type);
    }
  }
  void load(PayloadReader& r) {
    r(kind, pickle, tensors);
    uint64_t n = 0;
    r(cereal::make_size_tag(n));
    rrefs.resize(n);
    for (RRefSlot& slot : rrefs) {
      r(slot.type);
      slot.state = internal::rref_load(r, slot.type);
    }
  }
};

}  // namespace
}  // namespace ferry::python

namespace ferry {
template <>
struct TypeName<python::PyPayload> {
  static std::string get() { return python::kPyType; }
};
}  // namespace ferry

namespace ferry::python {
namespace {

// The native half of ferry.rpc.RRef.
class PyRRef {
 public:
  PyRRef(std::shared_ptr<internal::RRefState> state, std::string type, std::optional<TypeNode> node)
      : state_(std::move(state)), type_(std::move(type)), node_(std::move(node)) {}
  PyRRef(const PyRRef&) = default;
  PyRRef& operator=(const PyRRef&) = default;
  // Dropping the last reference tells the owner (a message): never with the GIL held,
  // as a ferry thread may wait for the GIL while holding what sending needs.
  ~PyRRef() { without_gil([this] { state_.reset(); }); }

  const std::shared_ptr<internal::RRefState>& state() const { return state_; }
  const std::string& type() const { return type_; }
  const std::optional<TypeNode>& node() const { return node_; }

 private:
  std::shared_ptr<internal::RRefState> state_;
  std::string type_;
  std::optional<TypeNode> node_;  // for a C++ type; none for PyObject
};

// A Python value an RRef owner holds (OwnedValue::object for type PyObject).
struct PyBox {
  PyBox(py::object v, bool exception) : value(std::move(v)), is_exception(exception) {}
  PyRef value;
  bool is_exception;
};

py::list tensors_to_list(std::vector<Tensor>& tensors) {
  py::list out;
  for (Tensor& t : tensors) out.append(py::cast(std::move(t)));
  return out;
}

py::list rrefs_to_list(std::vector<RRefSlot>& rrefs) {
  py::list out;
  for (RRefSlot& r : rrefs) {
    std::optional<TypeNode> node;
    if (r.type != kPyType) {
      absl::StatusOr<TypeNode> parsed = parse_type(r.type);
      if (parsed.ok()) node = *std::move(parsed);
    }
    out.append(hooks().rref_class(py::cast(PyRRef(std::move(r.state), r.type, std::move(node)))));
  }
  return out;
}

// (kind, bytes, tensors, rrefs) from Python into a payload.
PyPayload payload_from_tuple(py::handle t) {
  py::tuple tup = py::reinterpret_borrow<py::tuple>(t);
  if (tup.size() != 4) throw py::value_error("a payload is (kind, bytes, tensors, rrefs)");
  PyPayload p;
  p.kind = tup[0].cast<uint8_t>();
  p.pickle = std::string(tup[1].cast<py::bytes>());
  for (py::handle h : tup[2]) p.tensors.push_back(h.cast<Tensor>());
  for (py::handle h : tup[3]) {
    const PyRRef& r = h.attr("_native").cast<const PyRRef&>();
    p.rrefs.push_back(RRefSlot{r.state(), r.type()});
  }
  return p;
}

py::tuple payload_to_tuple(PyPayload& p) {
  return py::make_tuple(p.kind, py::bytes(p.pickle), tensors_to_list(p.tensors), rrefs_to_list(p.rrefs));
}

void save_pybox(PayloadWriter& w, const void* object) {
  const auto* box = static_cast<const PyBox*>(object);
  if (finalizing()) throw cereal::Exception("the Python interpreter is shutting down");
  PyPayload p;
  {
    ThreadGil gil;
    try {
      p = payload_from_tuple(hooks().pickle_value(box->value.get(), box->is_exception));
    } catch (py::error_already_set& e) {
      throw cereal::Exception(absl::StrCat("cannot pickle the RRef's value: ", e.what()));
    }
  }
  w(p);
}

// The one function every Python worker serves for Python callers.
RegisteredFunction python_function() {
  RegisteredFunction f;
  f.signature = absl::StrCat("(", kPyType, ") -> ", kPyType);
  f.invoke = [](PayloadReader& reader, Message& response) -> absl::Status {
    PyPayload request;
    FERRY_RETURN_IF_ERROR(read_guarded("arguments", [&] { reader(request); }));
    if (finalizing()) return absl::UnavailableError("the Python interpreter is shutting down");
    PyPayload out;
    {
      ThreadGil gil;
      try {
        py::cpp_function defer([]() {
          DeferredReply d = defer_reply(std::nullopt);
          if (!d.valid()) throw std::runtime_error("defer_reply: not on a thread serving a request");
          return d;
        });
        py::object r = hooks().serve(py::bytes(request.pickle), tensors_to_list(request.tensors),
                                     rrefs_to_list(request.rrefs), defer);
        if (r.is_none()) return absl::OkStatus();  // deferred: the reply goes later
        out = payload_from_tuple(r);
      } catch (py::error_already_set& e) {
        return absl::InternalError(absl::StrCat("the Python call handler failed: ", e.what()));
      }
    }
    PayloadWriter w(response);
    w(out);
    return absl::OkStatus();
  };
  f.make_value = [](PayloadReader& reader) -> absl::StatusOr<OwnedValue> {
    PyPayload request;
    FERRY_RETURN_IF_ERROR(read_guarded("arguments", [&] { reader(request); }));
    if (finalizing()) return absl::UnavailableError("the Python interpreter is shutting down");
    ThreadGil gil;
    try {
      py::tuple r = hooks().make_value(py::bytes(request.pickle), tensors_to_list(request.tensors),
                                       rrefs_to_list(request.rrefs));
      OwnedValue v;
      v.object = std::make_shared<PyBox>(py::reinterpret_borrow<py::object>(r[1]), r[0].cast<bool>());
      v.type = kPyType;
      v.save = &save_pybox;
      return v;
    } catch (py::error_already_set& e) {
      return absl::InternalError(absl::StrCat("the Python value maker failed: ", e.what()));
    }
  };
  return f;
}

// A function registered from Python for C++ callers, with the signature they call it by.
RegisteredFunction python_typed_function(std::shared_ptr<PyRef> fn, Signature sig) {
  RegisteredFunction f;
  f.signature = sig.text;
  auto shared = std::make_shared<Signature>(std::move(sig));
  f.invoke = [fn, shared](PayloadReader& reader, Message& response) -> absl::Status {
    if (finalizing()) return absl::UnavailableError("the Python interpreter is shutting down");
    ThreadGil gil;
    try {
      py::tuple args(shared->args.size());
      FERRY_RETURN_IF_ERROR(read_guarded("arguments", [&] {
        for (size_t i = 0; i < shared->args.size(); ++i) args[i] = decode_value(reader, shared->args[i]);
        if (reader.remaining() != 0) {
          throw cereal::Exception(absl::StrCat(reader.remaining(), " unexpected bytes after the arguments"));
        }
      }));
      py::object result = fn->get()(*args);
      PayloadWriter w(response);
      encode_value(w, shared->result, result, "the result");
      return absl::OkStatus();
    } catch (py::error_already_set& e) {
      return absl::UnknownError(absl::StrCat("raised ", e.what()));
    }
  };
  f.make_value = [](PayloadReader&) -> absl::StatusOr<OwnedValue> {
    return absl::UnimplementedError("remote() of a function registered from Python for C++ callers");
  };
  return f;
}

// ---- calls

std::shared_ptr<RpcAgent> agent_or_raise(std::string_view what) {
  std::shared_ptr<RpcAgent> agent = current_agent();
  if (agent == nullptr) {
    raise_status(absl::FailedPreconditionError(
        absl::StrCat(std::string(what), ": RPC has not been initialized in this process; call ferry.rpc.init_rpc first")));
  }
  return agent;
}

Message py_request(const PyPayload& payload) {
  return internal::make_request<PyPayload>(kPyFunction, inline_tensor_bytes(), payload);
}

// Signatures of C++ functions, by (worker, function); asked once.
class SignatureCache {
 public:
  std::shared_ptr<const Signature> get(RpcAgent& agent, const std::string& to, const std::string& fn,
                                       std::optional<std::chrono::milliseconds> timeout) {
    std::string key = absl::StrCat(to, "\n", fn);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.find(key);
      if (it != cache_.end()) return it->second;
    }
    absl::StatusOr<std::shared_ptr<const Signature>> sig;
    {
      py::gil_scoped_release release;
      sig = fetch(agent, to, fn, timeout);
    }
    if (!sig.ok()) raise_status(sig.status());
    std::lock_guard<std::mutex> lock(mu_);
    cache_[key] = *sig;
    return *sig;
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    cache_.clear();
  }

 private:
  static absl::StatusOr<std::shared_ptr<const Signature>> fetch(RpcAgent& agent, const std::string& to,
                                                               const std::string& fn,
                                                               std::optional<std::chrono::milliseconds> timeout) {
    std::string text;
    try {
      text = call_sync<std::string>(agent, to, kSignatureOfFunction, timeout, fn);
    } catch (const RpcError& e) {
      return e.status();
    }
    absl::StatusOr<Signature> sig = parse_signature(text);
    if (!sig.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("function \"", fn, "\" on \"", to, "\": ", sig.status().message()));
    }
    return std::make_shared<const Signature>(*std::move(sig));
  }

  std::mutex mu_;
  std::map<std::string, std::shared_ptr<const Signature>> cache_;
};
SignatureCache& signatures() {
  static SignatureCache* c = new SignatureCache();
  return *c;
}

// A call in flight. The reply is decoded as a Python payload tuple, or by a C++
// signature's result type.
class PendingCall {
 public:
  PendingCall(Future<Message> reply, std::shared_ptr<const Signature> sig) : reply_(std::move(reply)), sig_(std::move(sig)) {}
  PendingCall(const PendingCall&) = default;
  PendingCall& operator=(const PendingCall&) = default;
  // The reply may hold the last references to RRefs the arguments carried (see ~PyRRef).
  ~PendingCall() { without_gil([this] { reply_ = Future<Message>(); }); }
  static PendingCall failed(absl::Status status) { return PendingCall(make_ready_future<Message>(std::move(status)), nullptr); }

  bool done() const { return reply_.is_ready(); }

  // Waits (GIL released) and returns the decoded reply, or raises.
  py::object wait(std::optional<double> timeout) const {
    wait_interruptibly(reply_, timeout);
    return decode();
  }

  // Runs `fn()` (with the GIL) on ferry's pool once the reply is in (at once, on this
  // thread, when it already is).
  void add_done_callback(py::function fn) const {
    auto ref = std::make_shared<PyRef>(std::move(fn));
    auto run = [ref](const absl::StatusOr<Message>&) {
      if (finalizing()) return;
      ThreadGil gil;
      try {
        ref->get()();
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("ferry future callback");
      }
    };
    if (reply_.is_ready()) {
      ref->get()();
      return;
    }
    py::gil_scoped_release release;
    reply_.add_callback(run);
  }

  py::object decode() const {
    const absl::StatusOr<Message>& r = reply_.result();
    if (!r.ok()) raise_status(r.status());
    if (sig_ == nullptr) {
      absl::StatusOr<std::tuple<PyPayload>> p = read_payload<PyPayload>(*r, "reply");
      if (!p.ok()) raise_status(p.status());
      return payload_to_tuple(std::get<0>(*p));
    }
    py::object out;
    absl::Status s = read_guarded("reply", [&] {
      PayloadReader reader(*r);
      out = decode_value(reader, sig_->result);
      if (reader.remaining() != 0) {
        throw cereal::Exception(absl::StrCat(reader.remaining(), " unexpected bytes after the result"));
      }
    });
    if (!s.ok()) raise_status(s);
    return out;
  }

 private:
  Future<Message> reply_;
  std::shared_ptr<const Signature> sig_;
};

// Sends a Python call; the GIL is released while it goes out.
PendingCall call_py(const std::string& to, py::handle payload, std::optional<double> timeout) {
  std::shared_ptr<RpcAgent> agent = current_agent();
  if (agent == nullptr) {
    return PendingCall::failed(absl::FailedPreconditionError(
        "rpc_async: RPC has not been initialized in this process; call ferry.rpc.init_rpc first"));
  }
  PyPayload p = payload_from_tuple(payload);
  py::gil_scoped_release release;
  absl::StatusOr<Destination> dst = agent->resolve(to);
  if (!dst.ok()) return PendingCall::failed(internal::no_such_worker(*agent, dst.status()));
  internal::OutgoingCall call(*agent, dst->id());
  std::optional<Message> request;
  try {
    request.emplace(py_request(p));
  } catch (const cereal::Exception& e) {
    return PendingCall::failed(absl::InvalidArgumentError(absl::StrCat("cannot send the arguments: ", e.what())));
  }
  std::vector<std::shared_ptr<const void>> keep = call.take_keep_alive();
  Future<Message> reply = agent->send(*dst, *std::move(request), to_timeout(timeout));
  if (!keep.empty()) reply.add_inline_callback([keep = std::move(keep)](const absl::StatusOr<Message>&) {});
  return PendingCall(std::move(reply), nullptr);
}

void encode_args(PayloadWriter& w, const Signature& sig, const std::string& fn, py::tuple args) {
  if (args.size() != sig.args.size()) {
    throw py::type_error(absl::StrCat("function \"", fn, "\" ", sig.text, " takes ", sig.args.size(),
                                      " arguments, got ", args.size()));
  }
  for (size_t i = 0; i < sig.args.size(); ++i) {
    encode_value(w, sig.args[i], args[i], absl::StrCat("argument ", i + 1, " of \"", fn, "\""));
  }
}

PendingCall call_cpp(const std::string& to, const std::string& fn, py::tuple args, std::optional<double> timeout) {
  std::shared_ptr<RpcAgent> agent = current_agent();
  if (agent == nullptr) {
    return PendingCall::failed(absl::FailedPreconditionError(
        "rpc_async: RPC has not been initialized in this process; call ferry.rpc.init_rpc first"));
  }
  std::shared_ptr<const Signature> sig = signatures().get(*agent, to, fn, to_timeout(timeout));
  absl::StatusOr<Destination> dst = agent->resolve(to);
  if (!dst.ok()) return PendingCall::failed(internal::no_such_worker(*agent, dst.status()));
  Message request(MessageType::kRequest, 0);
  {
    PayloadWriter w(request);
    internal::write_string(w, fn);
    request.set_function_size(fn.size());
    internal::write_string(w, sig->text);
    encode_args(w, *sig, fn, args);
  }
  py::gil_scoped_release release;
  return PendingCall(agent->send(*dst, std::move(request), to_timeout(timeout)), sig);
}

// ---- RRefs

py::object make_rref(std::shared_ptr<internal::RRefState> state, std::string type, std::optional<TypeNode> node) {
  return hooks().rref_class(py::cast(PyRRef(std::move(state), std::move(type), std::move(node))));
}

py::object remote_py(const std::string& to, py::handle payload) {
  PyPayload p = payload_from_tuple(payload);
  std::shared_ptr<internal::RRefState> state;
  {
    py::gil_scoped_release release;
    state = internal::rref_remote(to, kPyType, kPyFunction, absl::StrCat("(", kPyType, ") -> ", kPyType),
                                  [&](PayloadWriter& w) { w(p); });
  }
  return make_rref(std::move(state), kPyType, std::nullopt);
}

py::object remote_cpp(const std::string& to, const std::string& fn, py::tuple args, std::optional<double> timeout) {
  std::shared_ptr<RpcAgent> agent = agent_or_raise("remote");
  std::shared_ptr<const Signature> sig = signatures().get(*agent, to, fn, to_timeout(timeout));
  // Encoded first here, so that a wrong argument raises now rather than inside remote().
  {
    Message scratch(MessageType::kRequest, 0);
    PayloadWriter w(scratch);
    encode_args(w, *sig, fn, args);
  }
  std::shared_ptr<internal::RRefState> state;
  {
    py::gil_scoped_release release;
    state = internal::rref_remote(to, sig->result.text, fn, sig->text, [&](PayloadWriter& w) {
      // Encoded once above already: this cannot raise.
      ThreadGil gil;
      encode_args(w, *sig, fn, args);
    });
  }
  return make_rref(std::move(state), sig->result.text, sig->result);
}

py::object rref_to_here(const PyRRef& r, std::optional<double> timeout) {
  if (internal::rref_is_owner(*r.state())) {
    absl::StatusOr<std::shared_ptr<void>> object;
    {
      py::gil_scoped_release release;
      object = internal::rref_local_value(*r.state(), r.type(), to_timeout(timeout));
    }
    if (!object.ok()) raise_status(object.status());
    if (r.type() != kPyType) {
      throw py::type_error(absl::StrCat("to_here() on the owner of an RRef holding a C++ ", r.type(),
                                        " is not supported from Python"));
    }
    auto* box = static_cast<PyBox*>(object->get());
    return py::make_tuple(box->is_exception, box->value.get());
  }
  Future<Message> reply;
  {
    py::gil_scoped_release release;
    reply = internal::rref_fetch(r.state(), r.type(), to_timeout(timeout));
  }
  wait_interruptibly(reply, std::nullopt);
  PendingCall call(reply, r.node().has_value() ? std::make_shared<const Signature>(Signature{{}, *r.node(), r.type()})
                                               : nullptr);
  return py::make_tuple(py::none(), call.decode());
}

}  // namespace

PYBIND11_MODULE(_ferry, m) {
  m.doc() = "ferry's native module; use ferry.rpc";
  (void)FunctionRegistry::global().add(kPyFunction, python_function());

  py::class_<Tensor>(m, "Tensor", "A ferry tensor: the form numpy arrays and torch tensors travel in")
      .def_static("from_numpy",
                  [](py::array a) -> py::object {
                    std::optional<Tensor> t = tensor_from_numpy(a);
                    if (!t.has_value()) return py::none();
                    return py::cast(*std::move(t));
                  })
      .def_static("from_dlpack", &tensor_from_dlpack)
      .def("numpy", &tensor_to_numpy)
      .def("to_dlpack", &tensor_to_dlpack)
      .def_property_readonly("shape", [](const Tensor& t) { return py::tuple(py::cast(t.shape())); })
      .def_property_readonly("dtype", [](const Tensor& t) { return std::string(dtype_name(t.dtype())); })
      .def_property_readonly("device", [](const Tensor& t) { return t.device().to_string(); })
      .def_property_readonly("nbytes", &Tensor::nbytes)
      .def("data_ptr", [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()); })
      .def("__repr__", [](const Tensor& t) { return t.to_string(); });

  py::class_<DeferredReply>(m, "DeferredReply")
      .def("send", [](const DeferredReply& d, py::tuple payload) {
        PyPayload p = payload_from_tuple(payload);
        Message reply(MessageType::kResponse, 0);
        try {
          PayloadWriter w(reply);
          w(p);
        } catch (const cereal::Exception& e) {
          Message err = make_error_message(0, "", absl::InvalidArgumentError(
                                                      absl::StrCat("cannot send the result: ", e.what())));
          py::gil_scoped_release release;
          d.send(std::move(err));
          return;
        }
        py::gil_scoped_release release;
        d.send(std::move(reply));
      });

  py::class_<PendingCall>(m, "PendingCall")
      .def("done", &PendingCall::done)
      .def("wait", &PendingCall::wait, py::arg("timeout") = py::none())
      .def("add_done_callback", &PendingCall::add_done_callback);

  py::class_<PyRRef>(m, "RRef")
      .def("owner", [](const PyRRef& r) {
        WorkerInfo w = internal::rref_owner(*r.state());
        return py::make_tuple(w.name, w.id);
      })
      .def("is_owner", [](const PyRRef& r) { return internal::rref_is_owner(*r.state()); })
      .def("type", &PyRRef::type)
      .def("describe", [](const PyRRef& r) { return internal::rref_describe(*r.state()); })
      .def("to_here", &rref_to_here, py::arg("timeout") = py::none())
      .def("local_value", [](const PyRRef& r) {
        if (r.type() != kPyType) {
          throw py::type_error(absl::StrCat("local_value() of an RRef holding a C++ ", r.type(),
                                            " is not supported from Python"));
        }
        absl::StatusOr<std::shared_ptr<void>> object;
        {
          py::gil_scoped_release release;
          object = internal::rref_local_value(*r.state(), r.type(), std::nullopt);
        }
        if (!object.ok()) raise_status(object.status());
        auto* box = static_cast<PyBox*>(object->get());
        return py::make_tuple(box->is_exception, box->value.get());
      });

  m.def("set_hooks", [](py::object serve, py::object make_value, py::object pickle_value, py::object rpc_error,
                        py::object timeout_error, py::object rref_class, py::object to_ferry, py::object from_ferry) {
    Hooks& h = hooks();
    h.serve = std::move(serve);
    h.make_value = std::move(make_value);
    h.pickle_value = std::move(pickle_value);
    h.rpc_error = std::move(rpc_error);
    h.timeout_error = std::move(timeout_error);
    h.rref_class = std::move(rref_class);
    tensor_hooks().to_ferry = std::move(to_ferry);
    tensor_hooks().from_ferry = std::move(from_ferry);
  });
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const RpcError& e) {
      raise_status(e.status());
    }
  });
  m.def("make_local_rref", [](py::object value) {
    OwnedValue v;
    v.object = std::make_shared<PyBox>(std::move(value), false);
    v.type = kPyType;
    v.save = &save_pybox;
    std::shared_ptr<internal::RRefState> state;
    {
      py::gil_scoped_release release;
      state = internal::rref_make_local(std::move(v));
    }
    return make_rref(std::move(state), kPyType, std::nullopt);
  });
  m.def("set_finalizing", [] { set_finalizing(); });

  m.def(
      "init_rpc",
      [](const std::string& name, int rank, std::optional<int> world_size, const std::string& init_method,
         double rpc_timeout_s, int num_worker_threads,
         const std::map<std::string, std::map<std::string, std::string>>& device_maps,
         const std::vector<std::string>& devices, std::optional<std::vector<std::string>> transports,
         std::optional<std::vector<std::string>> channels) {
        TensorPipeRpcBackendOptions options;
        options.init_method = init_method;
        options.rpc_timeout = std::chrono::milliseconds(static_cast<int64_t>(rpc_timeout_s * 1000.0 + 0.5));
        options.num_worker_threads = num_worker_threads;
        options.transports = std::move(transports);
        options.channels = std::move(channels);
        for (const auto& [worker, map] : device_maps) {
          DeviceMapSpec spec;
          for (const auto& [from, to] : map) spec.emplace_back(DeviceSpec(std::string(from)), DeviceSpec(std::string(to)));
          absl::Status s = options.set_device_map(worker, spec);
          if (!s.ok()) raise_status(s);
        }
        if (!devices.empty()) {
          std::vector<DeviceSpec> specs;
          for (const std::string& d : devices) specs.emplace_back(std::string(d));
          absl::Status s = options.set_devices(specs);
          if (!s.ok()) raise_status(s);
        }
        absl::Status s;
        {
          py::gil_scoped_release release;
          s = init_rpc(name, BackendType::TENSORPIPE, rank, world_size, options);
        }
        if (!s.ok()) raise_status(s);
        signatures().clear();
      },
      py::arg("name"), py::arg("rank"), py::arg("world_size"), py::arg("init_method"), py::arg("rpc_timeout"),
      py::arg("num_worker_threads"), py::arg("device_maps"), py::arg("devices"), py::arg("transports"),
      py::arg("channels"));
  m.def(
      "shutdown",
      [](bool graceful, double timeout_s) {
        absl::Status s;
        {
          py::gil_scoped_release release;
          s = shutdown(graceful, std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0)));
        }
        if (!s.ok()) raise_status(s);
      },
      py::arg("graceful"), py::arg("timeout"));
  m.def("is_initialized", [] { return current_agent() != nullptr; });
  m.def("self_info", [] {
    WorkerInfo w = agent_or_raise("get_worker_info")->self();
    return py::make_tuple(w.name, w.id);
  });
  m.def("worker_info", [](const std::string& name) {
    absl::StatusOr<WorkerInfo> w = agent_or_raise("get_worker_info")->worker_info(name);
    if (!w.ok()) raise_status(w.status());
    return py::make_tuple(w->name, w->id);
  });
  m.def("worker_infos", [] {
    py::list out;
    for (const WorkerInfo& w : agent_or_raise("get_worker_infos")->worker_infos()) out.append(py::make_tuple(w.name, w.id));
    return out;
  });
  m.def("call_py", &call_py, py::arg("to"), py::arg("payload"), py::arg("timeout"));
  m.def("call_cpp", &call_cpp, py::arg("to"), py::arg("fn"), py::arg("args"), py::arg("timeout"));
  m.def("remote_py", &remote_py, py::arg("to"), py::arg("payload"));
  m.def("remote_cpp", &remote_cpp, py::arg("to"), py::arg("fn"), py::arg("args"), py::arg("timeout"));
  m.def("register_function", [](const std::string& name, const std::string& signature, py::function fn) {
    absl::StatusOr<Signature> sig = parse_signature(signature);
    if (!sig.ok()) raise_status(sig.status());
    absl::Status s = FunctionRegistry::global().add(name, python_typed_function(std::make_shared<PyRef>(fn), *sig));
    if (!s.ok()) raise_status(s);
  });
  m.def("unregister_function", [](const std::string& name) { return FunctionRegistry::global().remove(name); });
  m.def("debug_info", [] { return agent_or_raise("debug_info")->debug_info(); });
}

}  // namespace ferry::python
