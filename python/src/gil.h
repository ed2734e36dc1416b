// File: python/src/gil.h (not installed)
//
// The GIL as ferry's own threads take it, and Python objects that C++ keeps alive on
// any thread. After the interpreter began to shut down (set_finalizing(), called by
// the package at exit), nothing here touches Python any more.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>

namespace ferry::python {

namespace py = pybind11;

inline std::atomic<bool> g_finalizing{false};
inline bool finalizing() { return g_finalizing.load(std::memory_order_acquire) || !Py_IsInitialized(); }
inline void set_finalizing() { g_finalizing.store(true, std::memory_order_release); }

// The GIL, taken on one of ferry's threads. The thread's Python thread state is made
// once and kept (pybind11 would make and free one on every acquire, which costs more
// than a small call's Python code).
class ThreadGil {
 public:
  ThreadGil() {
    thread_local bool kept = false;
    if (!kept) {
      gil_.inc_ref();
      kept = true;
    }
  }

 private:
  py::gil_scoped_acquire gil_;
};

// A Python object kept alive from C++ on any thread: dropping it takes the GIL (or
// leaks it when the interpreter is gone).
struct PyRef {
  PyObject* object = nullptr;
  explicit PyRef(py::object o) : object(o.release().ptr()) {}
  ~PyRef() {
    if (object == nullptr || finalizing()) return;
    ThreadGil gil;
    Py_DECREF(object);
  }
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  py::object get() const { return py::reinterpret_borrow<py::object>(object); }
};

// Runs `fn` with the GIL released if this thread holds it (and Python still runs).
template <typename Fn>
void without_gil(Fn&& fn) {
  if (!finalizing() && PyGILState_Check()) {
    py::gil_scoped_release release;
    fn();
  } else {
    fn();
  }
}

}  // namespace ferry::python
