// File: base/thread_role.h
//
// Thread-role markers: per-thread flags saying what the calling thread is, read where
// the answer changes what may run there. A transport thread must never block or run
// user code (futures post their callbacks elsewhere); an agent's own thread cannot
// tear the agent down (it would join itself); a thread serving an inline function
// must not make calls. The scopes set a mark for their lifetime and restore the
// previous one:
//
//   void on_read(...) {
//     internal::TransportThreadScope transport;  // callbacks completed here are posted
//     promise.set_value(std::move(reply));
//   }
//
// base/future.h includes this header: its futures consult on_transport_thread().
// Internal (ferry::internal); every mark is thread_local, so none needs a lock.
#pragma once

#include <functional>

namespace ferry::internal {

// Marks the calling thread as one an agent owns (a pool thread, a transport callback),
// where tearing the agent down would join the thread from itself.
void set_on_agent_thread(bool on);
bool on_agent_thread();

// Marks the calling thread as one that must never block or run user code (a transport
// loop, a timer): futures with an executor post their callbacks there instead.
void set_on_transport_thread(bool on);
bool on_transport_thread();

// Marks the calling thread as running a function served inline (on a transport thread,
// registered as never blocking): agents refuse calls made from it at once.
void set_serving_inline(bool on);
bool serving_inline();

// Marks the calling thread as a user's thread (not one an agent owns) that delivers a
// transport's messages while it waits for a result (base/progress.h). It may hold the
// user's locks, so agents run no inline function there: such requests go to the pool.
void set_driving_for_user(bool on);
bool driving_for_user();

// Runs `work` on a thread of its own that is joined when the process exits: for
// teardown that the calling thread cannot do itself (it would join itself). Defined
// in threads.cc.
void run_on_reaper(std::function<void()> work);

// Marks the calling thread as serving an inline function for the scope's duration.
class InlineServingScope {
 public:
  InlineServingScope() : previous_(serving_inline()) { set_serving_inline(true); }
  ~InlineServingScope() { set_serving_inline(previous_); }
  InlineServingScope(const InlineServingScope&) = delete;
  InlineServingScope& operator=(const InlineServingScope&) = delete;

 private:
  bool previous_;
};

// Marks the calling thread as a transport thread for the scope's duration.
class TransportThreadScope {
 public:
  TransportThreadScope() : previous_(on_transport_thread()) { set_on_transport_thread(true); }
  ~TransportThreadScope() { set_on_transport_thread(previous_); }
  TransportThreadScope(const TransportThreadScope&) = delete;
  TransportThreadScope& operator=(const TransportThreadScope&) = delete;

 private:
  bool previous_;
};

// Marks the calling thread as a user's thread driving a transport, for the scope's
// duration, when it is not an agent's thread already.
class UserDrivingScope {
 public:
  UserDrivingScope() : previous_(driving_for_user()) { set_driving_for_user(!on_agent_thread()); }
  ~UserDrivingScope() { set_driving_for_user(previous_); }
  UserDrivingScope(const UserDrivingScope&) = delete;
  UserDrivingScope& operator=(const UserDrivingScope&) = delete;

 private:
  bool previous_;
};

// Marks the calling thread as an agent's for the scope's duration (TensorPipe may run
// a callback inline on the thread that armed it, so the mark must not outlive it).
class AgentThreadScope {
 public:
  AgentThreadScope() : previous_(on_agent_thread()) { set_on_agent_thread(true); }
  ~AgentThreadScope() { set_on_agent_thread(previous_); }
  AgentThreadScope(const AgentThreadScope&) = delete;
  AgentThreadScope& operator=(const AgentThreadScope&) = delete;

 private:
  bool previous_;
};

}  // namespace ferry::internal
