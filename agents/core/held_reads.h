// File: agents/core/held_reads.h
//
// For a transport that keeps reading a paused connection (Connection::pause_reads):
// the messages that arrive while it is paused, held aside in order, and their hand-off
// once it resumes. The transport chooses the thread that drains them (never the one
// calling resume_reads(), which may hold the core's locks).
//
//   void receive(Wire wire) { if (!held_.hold(wire)) deliver(std::move(wire)); }
//   void resume_reads() override { if (held_.resume()) post([self] { self->held_.drain(deliver); }); }
//
// Thread-safe.
#pragma once

#include <deque>
#include <mutex>
#include <utility>

#include "agents/core/transport.h"

namespace ferry::internal {

class HeldReads {
 public:
  void pause() {
    std::lock_guard<std::mutex> lock(mu_);
    paused_ = true;
  }

  // True when the caller must now have drain() run: messages are held and no drain
  // runs or is on its way.
  bool resume() {
    std::lock_guard<std::mutex> lock(mu_);
    paused_ = false;
    if (held_.empty() || draining_) return false;
    draining_ = true;
    return true;
  }

  // Takes `wire` (true) while paused, or while earlier messages are still held or
  // being delivered, so that order holds; false: the caller delivers it now.
  bool hold(Wire& wire) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!paused_ && !draining_ && held_.empty()) return false;
    held_.push_back(std::move(wire));
    return true;
  }

  // Delivers what is held, in order, through `deliver(Wire)` (called with no lock
  // held), until none is left or the connection is paused again.
  template <typename Deliver>
  void drain(Deliver deliver) {
    for (;;) {
      Wire next;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (paused_ || held_.empty()) {
          draining_ = false;
          return;
        }
        next = std::move(held_.front());
        held_.pop_front();
      }
      deliver(std::move(next));
    }
  }

 private:
  std::mutex mu_;
  bool paused_ = false;    // guarded by mu_
  bool draining_ = false;  // guarded by mu_: a drain runs or is on its way
  std::deque<Wire> held_;  // guarded by mu_: read while paused, in order
};

}  // namespace ferry::internal
