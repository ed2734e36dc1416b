// The raw TensorPipe ping-pong that `ferry bench rpc` compares ferry with (see
// raw_tensorpipe.h). Kept as plain as TensorPipe allows: the server answers from its
// callbacks, buffers are reused, and the only thread hand-off is the one being
// measured (the client thread waiting for its reply).
#include "tools/bench/raw_tensorpipe.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include <tensorpipe/tensorpipe.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"

namespace ferry::tools::bench {
namespace {

namespace tp = ::tensorpipe;

// Sent by the client when it is done; the server acknowledges it and stops.
constexpr char kQuit[] = "ferry-bench-quit";
// The same priorities ferry's agent registers (agents/tensorpipe_agent.cc), so both
// sides negotiate alike.
constexpr int64_t kPriorityShm = 200;
constexpr int64_t kPriorityUv = 0;
constexpr int64_t kPriorityCma = 1200;
constexpr int64_t kPriorityBasic = 0;

absl::Status tp_status(const char* what, const tp::Error& error) {
  return absl::UnavailableError(absl::StrCat("raw TensorPipe: ", what, ": ", error.what()));
}

struct RawContext {
  std::shared_ptr<tp::Context> context;
  std::string listen_url;
};

// A context with exactly the endpoint's transport and channels.
absl::StatusOr<RawContext> make_context(const RawEndpoint& endpoint, const std::string& name) {
  RawContext out;
  out.context = std::make_shared<tp::Context>(tp::ContextOptions().name(name));
  std::shared_ptr<tp::transport::Context> transport;
  int64_t priority = 0;
  if (endpoint.transport == "shm") {
    transport = tp::transport::shm::create();
    priority = kPriorityShm;
    std::random_device rd;
    out.listen_url = absl::StrCat("shm://ferry-bench-", getpid(), "-", rd());
  } else if (endpoint.transport == "uv") {
    transport = tp::transport::uv::create();
    priority = kPriorityUv;
    // The address ferry's agent listens on too (unless FERRY_SOCKET_IFNAME says otherwise).
    auto [error, address] = tp::transport::uv::lookupAddrForHostname();
    out.listen_url = absl::StrCat("uv://", error ? std::string("127.0.0.1") : address);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("raw TensorPipe: unknown transport \"", endpoint.transport, "\" (expected shm or uv)"));
  }
  if (!transport->isViable()) {
    return absl::FailedPreconditionError(
        absl::StrCat("raw TensorPipe: transport \"", endpoint.transport, "\" is not usable on this machine"));
  }
  out.context->registerTransport(priority, endpoint.transport, std::move(transport));
  for (const std::string& name : endpoint.channels) {
    std::shared_ptr<tp::channel::Context> channel;
    if (name == "cma") {
      channel = tp::channel::cma::create();
      priority = kPriorityCma;
    } else if (name == "basic") {
      channel = tp::channel::basic::create();
      priority = kPriorityBasic;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("raw TensorPipe: unknown channel \"", name, "\" (expected cma or basic)"));
    }
    if (!channel->isViable()) {
      return absl::FailedPreconditionError(
          absl::StrCat("raw TensorPipe: channel \"", name, "\" is not usable on this machine"));
    }
    out.context->registerChannel(priority, name, std::move(channel));
  }
  return out;
}

// Receive buffers by size, allocated on first use and reused after: a buffer is
// taken for a read and given back when the echo that sends it out completes.
class BufferPool {
 public:
  uint8_t* take(size_t bytes) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    std::vector<uint8_t*>& free = free_[bytes];
    if (!free.empty()) {
      uint8_t* p = free.back();
      free.pop_back();
      return p;
    }
    owned_.push_back(std::make_unique<uint8_t[]>(bytes));
    return owned_.back().get();
  }
  void give(size_t bytes, uint8_t* p) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    free_[bytes].push_back(p);
  }

 private:
  absl::Mutex mu_;
  std::map<size_t, std::vector<uint8_t*>> free_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<uint8_t[]>> owned_ ABSL_GUARDED_BY(mu_);
};

// The echo server. Callbacks capture `this`: the object outlives the context, which
// is closed and joined (so every callback has run) before the server returns.
class EchoServer {
 public:
  void start(const std::shared_ptr<tp::Listener>& listener) {
    listener->accept([this](const tp::Error& error, std::shared_ptr<tp::Pipe> pipe) {
      if (error) {
        finished_.set(tp_status("accepting the client's pipe", error));
        return;
      }
      pipe_ = std::move(pipe);
      read_next();
    });
  }

  absl::Status wait(std::chrono::milliseconds timeout) { return finished_.wait(timeout, "raw TensorPipe: the client's session"); }

 private:
  using Taken = std::vector<std::pair<size_t, uint8_t*>>;

  void read_next() {
    pipe_->readDescriptor([this](const tp::Error& error, tp::Descriptor descriptor) {
      if (error) {
        finished_.set(tp_status("reading a request descriptor", error));
        return;
      }
      tp::Allocation allocation;
      Taken taken;
      for (const tp::Descriptor::Tensor& t : descriptor.tensors) {
        uint8_t* p = pool_.take(t.length);
        taken.emplace_back(t.length, p);
        allocation.tensors.push_back(tp::Allocation::Tensor{tp::CpuBuffer{p}});
      }
      pipe_->read(std::move(allocation), [this, metadata = std::move(descriptor.metadata),
                                          taken = std::move(taken)](const tp::Error& error) mutable {
        if (error) {
          finished_.set(tp_status("reading a request", error));
          return;
        }
        bool quit = metadata == kQuit;
        // Re-arm first: a pipelining client has more requests behind this one.
        if (!quit) read_next();
        tp::Message reply;
        reply.metadata = std::move(metadata);
        for (const auto& [bytes, p] : taken) {
          tp::Message::Tensor t;
          t.buffer = tp::CpuBuffer{p};
          t.length = bytes;
          reply.tensors.push_back(std::move(t));
        }
        pipe_->write(std::move(reply), [this, quit, taken = std::move(taken)](const tp::Error& error) {
          for (const auto& [bytes, p] : taken) pool_.give(bytes, p);
          if (error) {
            finished_.set(tp_status("writing a reply", error));
          } else if (quit) {
            finished_.set(absl::OkStatus());
          }
        });
      });
    });
  }

  std::shared_ptr<tp::Pipe> pipe_;  // set once, by the accept callback
  BufferPool pool_;
  Waiter finished_;
};

// The measuring client. Callbacks capture `this`; run_raw_client closes and joins the
// context before the client goes away.
class RawClient {
 public:
  RawClient(std::shared_ptr<tp::Context> context, std::shared_ptr<tp::Pipe> pipe, size_t max_bytes,
            std::chrono::milliseconds timeout)
      : context_(std::move(context)),
        pipe_(std::move(pipe)),
        send_buffer_(std::make_unique<uint8_t[]>(std::max<size_t>(max_bytes, 1))),
        receive_buffer_(std::make_unique<uint8_t[]>(std::max<size_t>(max_bytes, 1))),
        timeout_(timeout) {
    for (size_t i = 0; i < std::max<size_t>(max_bytes, 1); ++i) send_buffer_[i] = static_cast<uint8_t>(i * 7);
  }

  // One round trip (a message with one tensor of `bytes`, or none when 0), waited for
  // by this thread.
  absl::Status round_trip(size_t bytes) {
    done_.reset();
    expect_reply(bytes, [this](absl::Status s) { done_.set(std::move(s)); });
    send(bytes);
    return done_.wait(timeout_, "raw TensorPipe: a round trip");
  }

  // `count` tensor-less round trips, each issued from the previous one's completion
  // callback; the last `keep` of them are timed into `samples`.
  absl::Status chained(int count, int keep, std::vector<double>& samples) {
    chain_left_ = count;
    chain_keep_ = keep;
    chain_samples_ = &samples;
    done_.reset();
    chain_step();
    return done_.wait(timeout_ * 4, "raw TensorPipe: the chained round trips");
  }

  // Tensor-less calls with `outstanding` in flight, at least `min_calls` of them and
  // for at least `min_seconds`.
  absl::StatusOr<ThroughputResult> pipelined(int outstanding, int min_calls, double min_seconds) {
    done_.reset();
    int first = std::max(1, std::min(outstanding, min_calls));
    issued_ = first;
    completed_ = 0;
    min_calls_ = min_calls;
    // Call k was issued at issued_at_[k % first]: replies come back in order, and at
    // most `first` calls are in flight.
    issued_at_.assign(static_cast<size_t>(first), Clock::time_point());
    call_us_.clear();
    Clock::time_point t0 = Clock::now();
    until_ = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(min_seconds));
    read_pipelined();
    last_ = t0;
    for (int i = 0; i < first; ++i) {
      if (timed_call(i)) issued_at_[static_cast<size_t>(i)] = Clock::now();
      send(0);
    }
    absl::Status s = done_.wait(timeout_ * 4, "raw TensorPipe: the pipelined calls");
    Clock::time_point t1 = Clock::now();
    if (!s.ok()) return s;
    double seconds = std::chrono::duration<double>(t1 - t0).count();
    ThroughputResult r{outstanding, completed_, seconds, completed_ / seconds};
    set_call_latency(r, call_us_);
    return r;
  }

  // Tells the server to stop and waits for its acknowledgement.
  absl::Status quit() {
    done_.reset();
    expect_reply(0, [this](absl::Status s) { done_.set(std::move(s)); });
    tp::Message m;
    m.metadata = kQuit;
    pipe_->write(std::move(m), [this](const tp::Error& error) {
      if (error) done_.set(tp_status("sending quit", error));
    });
    return done_.wait(timeout_, "raw TensorPipe: the server's acknowledgement of quit");
  }

 private:
  void send(size_t bytes) {
    tp::Message m;
    uint64_t seq = next_seq_++;
    m.metadata.assign(reinterpret_cast<const char*>(&seq), sizeof(seq));
    if (bytes > 0) {
      tp::Message::Tensor t;
      t.buffer = tp::CpuBuffer{send_buffer_.get()};
      t.length = bytes;
      m.tensors.push_back(std::move(t));
    }
    // A failed write fails the read that waits for its reply too; that one reports it.
    pipe_->write(std::move(m), [](const tp::Error&) {});
  }

  // Reads one reply of the expected shape into the reused receive buffer, then calls
  // done(status).
  template <typename Done>
  void expect_reply(size_t bytes, Done done) {
    pipe_->readDescriptor([this, bytes, done](const tp::Error& error, tp::Descriptor descriptor) mutable {
      if (error) {
        done(tp_status("reading a reply descriptor", error));
        return;
      }
      size_t want = bytes > 0 ? 1 : 0;
      if (descriptor.tensors.size() != want || (want == 1 && descriptor.tensors[0].length != bytes)) {
        done(absl::InternalError(absl::StrCat("raw TensorPipe: reply has ", descriptor.tensors.size(),
                                              " tensor(s), expected ", want, " of ", bytes, " bytes")));
        return;
      }
      tp::Allocation allocation;
      if (want == 1) allocation.tensors.push_back(tp::Allocation::Tensor{tp::CpuBuffer{receive_buffer_.get()}});
      pipe_->read(std::move(allocation), [done](const tp::Error& error) mutable {
        done(error ? tp_status("reading a reply", error) : absl::OkStatus());
      });
    });
  }

  void chain_step() {
    chain_t0_ = Clock::now();
    expect_reply(0, [this](absl::Status s) {
      Clock::time_point t1 = Clock::now();
      if (!s.ok()) {
        done_.set(std::move(s));
        return;
      }
      if (chain_left_ <= chain_keep_) chain_samples_->push_back(micros_between(chain_t0_, t1));
      if (--chain_left_ > 0) {
        chain_step();
      } else {
        done_.set(absl::OkStatus());
      }
    });
    send(0);
  }

  // The read side of pipelined(): every reply issues one more call while the run is
  // short of its calls or its time, and re-arms the read while calls are in flight.
  // Runs on TensorPipe's loop only (after the caller set the counters).
  void read_pipelined() {
    expect_reply(0, [this](absl::Status s) {
      if (!s.ok()) {
        done_.set(std::move(s));
        return;
      }
      const size_t window = issued_at_.size();
      if (timed_call(completed_)) {
        last_ = Clock::now();
        call_us_.push_back(micros_between(issued_at_[static_cast<size_t>(completed_) % window], last_));
      }
      ++completed_;
      if (issued_ < min_calls_ || last_ < until_) {
        if (timed_call(issued_)) issued_at_[static_cast<size_t>(issued_) % window] = Clock::now();
        ++issued_;
        read_pipelined();
        send(0);
        return;
      }
      if (completed_ == issued_) {
        done_.set(absl::OkStatus());
        return;
      }
      read_pipelined();
    });
  }

  std::shared_ptr<tp::Context> context_;
  std::shared_ptr<tp::Pipe> pipe_;
  std::unique_ptr<uint8_t[]> send_buffer_;
  std::unique_ptr<uint8_t[]> receive_buffer_;
  std::chrono::milliseconds timeout_;
  Waiter done_;
  std::atomic<uint64_t> next_seq_{0};
  // chained(): touched by the starting thread, then only by the callback chain.
  int chain_left_ = 0;
  int chain_keep_ = 0;
  std::vector<double>* chain_samples_ = nullptr;
  Clock::time_point chain_t0_;
  // pipelined(): likewise.
  int issued_ = 0;
  int completed_ = 0;
  int min_calls_ = 0;
  Clock::time_point until_;
  Clock::time_point last_;  // the clock as last read by pipelined()
  std::vector<Clock::time_point> issued_at_;
  std::vector<double> call_us_;
};

absl::Status write_address_file(const std::string& path, const std::string& url) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << url;
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path, ": ", ec.message()));
  return absl::OkStatus();
}

absl::StatusOr<std::string> wait_for_address_file(const std::string& path, std::chrono::milliseconds timeout) {
  Clock::time_point deadline = Clock::now() + timeout;
  while (true) {
    std::ifstream in(path);
    if (in) {
      std::ostringstream s;
      s << in.rdbuf();
      return s.str();
    }
    if (Clock::now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("raw TensorPipe: the server did not publish its address in ", path, " within ",
                       timeout.count(), " ms"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void close_context(const std::shared_ptr<tp::Context>& context) {
  context->close();
  context->join();
}

absl::Status measure(RawClient& client, const MeasurePlan& plan, SideResult& out) {
  std::vector<double> samples;
  samples.reserve(static_cast<size_t>(plan.iterations));

  // Small call, waited for by this thread.
  for (int i = 0; i < plan.warmup; ++i) {
    if (absl::Status s = client.round_trip(0); !s.ok()) return s;
  }
  for (int i = 0; i < plan.iterations; ++i) {
    Clock::time_point t0 = Clock::now();
    if (absl::Status s = client.round_trip(0); !s.ok()) return s;
    samples.push_back(micros_between(t0, Clock::now()));
  }
  out.small_call = latency_stats(samples);

  // Small call, callback-chained.
  samples.clear();
  if (absl::Status s = client.chained(plan.warmup + plan.iterations, plan.iterations, samples); !s.ok()) return s;
  out.small_call_chained = latency_stats(samples);

  // Tiny tensor.
  samples.clear();
  for (int i = 0; i < plan.warmup; ++i) {
    if (absl::Status s = client.round_trip(kTinyTensorBytes); !s.ok()) return s;
  }
  for (int i = 0; i < plan.iterations; ++i) {
    Clock::time_point t0 = Clock::now();
    if (absl::Status s = client.round_trip(kTinyTensorBytes); !s.ok()) return s;
    samples.push_back(micros_between(t0, Clock::now()));
  }
  out.tiny_tensor = latency_stats(samples);

  // Throughput with N outstanding.
  for (size_t k = 0; k < plan.outstanding.size(); ++k) {
    int n = plan.outstanding[k];
    int total = plan.throughput_calls[k];
    absl::StatusOr<ThroughputResult> warm = client.pipelined(n, std::max(plan.warmup, n), 0);
    if (!warm.ok()) return warm.status();
    absl::StatusOr<ThroughputResult> r = client.pipelined(n, total, plan.throughput_min_seconds);
    if (!r.ok()) return r.status();
    out.throughput.push_back(*r);
  }

  // Tensor echo.
  for (size_t k = 0; k < plan.echo_sizes.size(); ++k) {
    size_t bytes = plan.echo_sizes[k];
    for (int i = 0; i < plan.echo_warmup; ++i) {
      if (absl::Status s = client.round_trip(bytes); !s.ok()) return s;
    }
    samples.clear();
    for (int i = 0; i < plan.echo_iterations[k]; ++i) {
      Clock::time_point t0 = Clock::now();
      if (absl::Status s = client.round_trip(bytes); !s.ok()) return s;
      samples.push_back(micros_between(t0, Clock::now()));
    }
    EchoResult echo;
    echo.bytes = bytes;
    echo.round_trip = latency_stats(samples);
    echo.gb_per_s = 2.0 * static_cast<double>(bytes) / (echo.round_trip.median_us * 1e3);
    out.echo.push_back(echo);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status run_raw_server(const RawEndpoint& endpoint, const std::string& address_file,
                            std::chrono::milliseconds timeout) {
  absl::StatusOr<RawContext> raw = make_context(endpoint, "raw-server");
  if (!raw.ok()) return raw.status();
  std::shared_ptr<tp::Listener> listener = raw->context->listen({raw->listen_url});
  absl::Status status;
  {
    EchoServer server;
    server.start(listener);
    status = write_address_file(address_file, listener->url(endpoint.transport));
    if (status.ok()) status = server.wait(timeout);
    close_context(raw->context);
  }
  return status;
}

absl::StatusOr<SideResult> run_raw_client(const RawEndpoint& endpoint, const std::string& address_file,
                                          const MeasurePlan& plan, std::chrono::milliseconds timeout) {
  absl::StatusOr<std::string> url = wait_for_address_file(address_file, timeout);
  if (!url.ok()) return url.status();
  absl::StatusOr<RawContext> raw = make_context(endpoint, "raw-client");
  if (!raw.ok()) return raw.status();
  size_t max_bytes = kTinyTensorBytes;
  for (size_t b : plan.echo_sizes) max_bytes = std::max(max_bytes, b);

  SideResult out;
  out.side = "raw";
  out.client_cores = allowed_cores();
  out.transport = endpoint.transport;
  out.channels = endpoint.channels;
  absl::Status status;
  {
    RawClient client(raw->context, raw->context->connect(*url, tp::PipeOptions().remoteName("raw-server")),
                     max_bytes, timeout);
    status = measure(client, plan, out);
    absl::Status quit = client.quit();
    if (status.ok()) status = quit;
    close_context(raw->context);
  }
  if (!status.ok()) return status;
  return out;
}

}  // namespace ferry::tools::bench
