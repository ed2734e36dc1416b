// File: base/progress.h
//
// Progress that a waiting thread makes itself. A transport whose work any thread may
// do (the ring: read its rings, deliver what arrived) registers a Progress; a ferry
// thread that polls for something (a future's wait, an idle pool thread: drive_until
// in base/future.h) drives every registered Progress while it polls. The reply a
// caller waits for is then taken off the ring by the caller itself, and a request by
// the pool thread that runs it: no hand-off from a transport thread, and one thread
// fewer competing for the cores.
//
//   class RingProgress : public Progress { ... };
//   ProgressRegistration registration(std::make_shared<RingProgress>(endpoint));
//   ...                                   // waits in this process now drive the rings
//
// Internal (ferry::internal). Thread-safe.
#pragma once

#include <memory>
#include <vector>

namespace ferry::internal {

// What a waiting thread can do for a transport. Every member may be called from any
// thread, concurrently; none may block for long.
class Progress {
 public:
  virtual ~Progress() = default;

  // A thread starts polling through this Progress: until the matching leave(), the
  // transport may count on it to call poll() now and then, so its own thread need not.
  virtual void enter() = 0;
  // The thread stops polling (its wait ended, or its poll window did).
  virtual void leave() = 0;
  // Like leave(), by a pool thread that found a task and comes back to poll when it
  // has run it: a transport may then skip arranging for its own thread to be woken by
  // the next message (a system call in the peer per task), provided that what arrives
  // meanwhile is still read within a bound, since the task may block.
  virtual void step_away() { leave(); }
  // Does the work that is ready now; true if there was any. Runs what the transport
  // would run on its own thread (delivering messages, completing futures), under a
  // TransportThreadScope. A call that finds another thread doing the work returns
  // false at once rather than wait for it.
  virtual bool poll() = 0;
};

// Adds `progress` to those every waiting thread drives, until destroyed. Threads
// drive a snapshot of the registered ones, which they may keep a little after the
// registration goes: a Progress must stay safe to call (and do nothing) once its
// transport is gone, so hold the transport weakly.
class ProgressRegistration {
 public:
  explicit ProgressRegistration(std::shared_ptr<Progress> progress);
  ~ProgressRegistration();
  ProgressRegistration(const ProgressRegistration&) = delete;
  ProgressRegistration& operator=(const ProgressRegistration&) = delete;

 private:
  std::shared_ptr<Progress> progress_;
};

// The Progress registered now, as the calling thread last saw them (refreshed when
// one was added or removed since). Empty in a process without such a transport.
const std::vector<std::shared_ptr<Progress>>& registered_progress();

// Marks the calling thread as driving (inside drive_until): a wait nested in what a
// poll delivers does not drive again, since the thread holds the transport already.
bool driving_progress();
void set_driving_progress(bool on);

}  // namespace ferry::internal
