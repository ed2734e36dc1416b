#include "trace/trace.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/env.h"
#include "base/logging.h"
#include "base/thread_name.h"
#include "nlohmann/json.hpp"

namespace ferry {

namespace {

// SIGUSR2: the handler only writes a byte to a pipe (all it may do); a thread of the
// registry's own reads it and flushes every live recorder.
class Registry {
 public:
  static Registry& get() {
    static Registry registry;
    return registry;
  }

  void add(TraceRecorder* r) {
    std::lock_guard<std::mutex> lock(mu_);
    recorders_.push_back(r);
    if (!thread_.joinable() && pipe2(pipe_, O_CLOEXEC | O_NONBLOCK) == 0) {
      write_fd_ = pipe_[1];
      struct sigaction old {};
      sigaction(SIGUSR2, nullptr, &old);
      if (old.sa_handler == SIG_DFL || old.sa_handler == SIG_IGN) {
        struct sigaction sa {};
        sa.sa_handler = [](int) {
          char c = 's';
          (void)!write(write_fd_, &c, 1);
        };
        sigemptyset(&sa.sa_mask);
        sa.sa_flags = SA_RESTART;
        sigaction(SIGUSR2, &sa, nullptr);
      } else {
        FERRY_LOG(WARNING) << "FERRY_TRACE: SIGUSR2 already has a handler; traces are written at shutdown only";
      }
      owner_ = getpid();
      thread_ = std::thread([this] {
        internal::name_this_thread("ferry-trace");
        run();
      });
    }
  }
  void remove(TraceRecorder* r) {
    std::lock_guard<std::mutex> lock(mu_);
    recorders_.erase(std::remove(recorders_.begin(), recorders_.end(), r), recorders_.end());
  }

  ~Registry() {
    if (!thread_.joinable()) return;
    if (getpid() != owner_) {
      // A child forked after the thread started: the thread runs in the parent only
      // (this handle names nothing here: detaching or joining it would act on a thread
      // the child does not have, which ThreadSanitizer stops on), and the pipe is the
      // parent's too. The handle is moved into storage never destroyed, so the child
      // neither signals, joins nor detaches it.
      alignas(std::thread) static unsigned char forgotten[sizeof(std::thread)];
      new (forgotten) std::thread(std::move(thread_));
      return;
    }
    char c = 'q';
    (void)!write(pipe_[1], &c, 1);
    thread_.join();
  }

 private:
  void run() {
    for (;;) {
      pollfd p{pipe_[0], POLLIN, 0};
      if (poll(&p, 1, -1) <= 0) continue;
      char buf[64];
      ssize_t n = read(pipe_[0], buf, sizeof(buf));
      if (n <= 0) continue;
      if (std::find(buf, buf + n, 'q') != buf + n) return;
      std::lock_guard<std::mutex> lock(mu_);
      for (TraceRecorder* r : recorders_) {
        absl::Status s = r->flush();
        if (s.ok()) {
          FERRY_LOG(INFO) << "SIGUSR2: trace written to " << r->path();
        } else {
          FERRY_LOG(WARNING) << "SIGUSR2: " << s;
        }
      }
    }
  }

  std::mutex mu_;
  std::vector<TraceRecorder*> recorders_;
  int pipe_[2] = {-1, -1};
  static inline int write_fd_ = -1;
  pid_t owner_ = -1;  // the process the thread runs in
  std::thread thread_;
};

int64_t realtime_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

std::unique_ptr<TraceRecorder> TraceRecorder::from_env(std::string worker, int id) {
  std::optional<std::string> dir = internal::env_string("FERRY_TRACE");
  if (!dir.has_value()) return nullptr;
  const int64_t capacity = internal::env_int("FERRY_TRACE_EVENTS", kDefaultCapacity, 16, 100000000);
  return std::make_unique<TraceRecorder>(*dir, std::move(worker), id, static_cast<size_t>(capacity));
}

TraceRecorder::TraceRecorder(std::string directory, std::string worker, int id, size_t capacity)
    : path_(absl::StrCat(directory, "/", worker, ".trace.json")),
      worker_(std::move(worker)),
      id_(id),
      capacity_(capacity),
      steady0_(Clock::now()),
      realtime0_us_(realtime_us() + internal::env_int("FERRY_TRACE_SKEW_US", 0, -3600000000LL, 3600000000LL)) {
  Registry::get().add(this);
}

TraceRecorder::~TraceRecorder() {
  Registry::get().remove(this);
  absl::Status s = flush();
  if (!s.ok()) FERRY_LOG(WARNING) << s;
}

int64_t TraceRecorder::micros(Clock::time_point t) const {
  return realtime0_us_ + std::chrono::duration_cast<std::chrono::microseconds>(t - steady0_).count();
}

void TraceRecorder::push(Event e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ring_.size() < capacity_) {
    ring_.push_back(std::move(e));
    return;
  }
  ring_[next_] = std::move(e);
  next_ = (next_ + 1) % capacity_;
  ++dropped_;
}

void TraceRecorder::call(int peer_id, std::string_view peer, std::string_view function, uint64_t call_id,
                         Clock::time_point sent, Clock::time_point done, TraceDevice device) {
  push(Event{true, peer_id, std::string(peer), std::string(function), call_id, micros(sent), micros(done), 0,
             std::move(device)});
}

void TraceRecorder::served(int caller_id, std::string_view caller, std::string_view function, uint64_t call_id,
                           Clock::time_point received, Clock::time_point started, Clock::time_point replied,
                           TraceDevice device) {
  push(Event{false, caller_id, std::string(caller), std::string(function), call_id, micros(received), micros(started),
             micros(replied), std::move(device)});
}

absl::Status TraceRecorder::flush() {
  std::vector<Event> events;
  uint64_t dropped = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Oldest first.
    events.reserve(ring_.size());
    for (size_t i = 0; i < ring_.size(); ++i) events.push_back(ring_[(next_ + i) % ring_.size()]);
    dropped = dropped_;
  }
  nlohmann::json list = nlohmann::json::array();
  list.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", id_}, {"tid", 0}, {"args", {{"name", worker_}}}});
  list.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", id_}, {"tid", 1}, {"args", {{"name", "calls made"}}}});
  list.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", id_}, {"tid", 2}, {"args", {{"name", "queued"}}}});
  list.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", id_}, {"tid", 3}, {"args", {{"name", "served"}}}});
  for (const Event& e : events) {
    // One flow per call, named by the caller's id and the call id: unique in a job.
    const std::string flow = absl::StrCat(e.made ? id_ : e.peer_id, ".", e.call_id);
    if (e.made) {
      nlohmann::json args = {{"peer", e.peer},     {"peer_id", e.peer_id}, {"call_id", e.call_id},
                             {"flow", flow},       {"t_send", e.t0},       {"t_reply", e.t1}};
      if (!e.device.channel.empty()) {
        args["channel"] = e.device.channel;
        args["device_bytes"] = e.device.bytes;
      }
      list.push_back({{"ph", "X"},
                      {"cat", "call"},
                      {"name", e.function},
                      {"pid", id_},
                      {"tid", 1},
                      {"ts", e.t0},
                      {"dur", std::max<int64_t>(0, e.t1 - e.t0)},
                      {"args", std::move(args)}});
      list.push_back({{"ph", "s"}, {"cat", "flow"}, {"name", "rpc"}, {"id", flow}, {"pid", id_}, {"tid", 1},
                      {"ts", e.t0}});
    } else {
      nlohmann::json args = {{"caller", e.peer},  {"caller_id", e.peer_id}, {"call_id", e.call_id},
                             {"flow", flow},      {"t_recv", e.t0},         {"t_start", e.t1},
                             {"t_reply", e.t2}};
      if (!e.device.channel.empty()) {
        args["reply_channel"] = e.device.channel;
        args["reply_device_bytes"] = e.device.bytes;
      }
      list.push_back({{"ph", "X"}, {"cat", "queue"}, {"name", e.function}, {"pid", id_}, {"tid", 2}, {"ts", e.t0},
                      {"dur", std::max<int64_t>(0, e.t1 - e.t0)}, {"args", args}});
      list.push_back({{"ph", "X"}, {"cat", "serve"}, {"name", e.function}, {"pid", id_}, {"tid", 3}, {"ts", e.t1},
                      {"dur", std::max<int64_t>(0, e.t2 - e.t1)}, {"args", args}});
      list.push_back({{"ph", "f"}, {"bp", "e"}, {"cat", "flow"}, {"name", "rpc"}, {"id", flow}, {"pid", id_},
                      {"tid", 2}, {"ts", e.t0}});
    }
  }
  nlohmann::json file = {{"traceEvents", list},
                         {"displayTimeUnit", "ms"},
                         {"otherData", {{"worker", worker_}, {"id", id_}, {"dropped_events", dropped}}}};
  const std::string tmp = path_ + ".tmp";
  // The directory may be shared (FERRY_TRACE=/tmp/...): a name another user made first,
  // a link to elsewhere above all, is never written through. The file is made anew,
  // and refused if it shows up again between the unlink and the open.
  ::unlink(tmp.c_str());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("cannot create the trace file ", tmp, ": ", std::strerror(errno)));
  }
  const std::string text = file.dump();
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = ::write(fd, text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
  const int err = written == text.size() ? 0 : errno;
  ::close(fd);
  if (written != text.size()) {
    return absl::UnavailableError(absl::StrCat("cannot write the trace file ", tmp, ": ", std::strerror(err)));
  }
  if (std::rename(tmp.c_str(), path_.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot write the trace file ", path_));
  }
  return absl::OkStatus();
}

}  // namespace ferry
