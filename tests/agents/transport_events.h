// File: tests/agents/transport_events.h
//
// Test helpers for driving a Transport directly: a TransportEvents that records every
// event with waits that end at a deadline (so a missing event fails the test), and a
// listening transport with its recorder.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "agents/core/transport.h"

namespace ferry::testing {

using std::chrono::milliseconds;

// Records every event; the waits end at a deadline so a missing event fails the test.
class Recorder final : public TransportEvents {
 public:
  struct Received {
    std::shared_ptr<Connection> connection;
    Wire wire;
    std::thread::id thread;  // the one that delivered it
  };

  void on_accepted(const std::shared_ptr<Connection>& connection) override {
    if (authenticate_) connection->authenticated();
    std::lock_guard<std::mutex> lock(mu_);
    accepted_.push_back(connection);
    cv_.notify_all();
  }
  absl::Status on_header(Connection&, uint64_t metadata_bytes, std::span<const uint64_t> tensor_bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++headers_;
    if (admit_) return admit_(metadata_bytes, tensor_bytes);
    return absl::OkStatus();
  }
  void on_message(const std::shared_ptr<Connection>& connection, Wire wire) override {
    if (authenticate_) connection->authenticated();  // the connector's side: once it hears back
    std::lock_guard<std::mutex> lock(mu_);
    received_.push_back({connection, std::move(wire), std::this_thread::get_id()});
    // As the core does from on_message (Connection::pause_reads).
    if (after_message_) after_message_(*connection, received_.back().wire);
    cv_.notify_all();
  }
  void on_closed(const std::shared_ptr<Connection>& connection, absl::Status why) override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_.emplace_back(connection, std::move(why));
    cv_.notify_all();
  }

  void set_admit(std::function<absl::Status(uint64_t, std::span<const uint64_t>)> admit) {
    std::lock_guard<std::mutex> lock(mu_);
    admit_ = std::move(admit);
  }
  // Runs on the delivering thread after each message is recorded (under the lock).
  void set_after_message(std::function<void(Connection&, const Wire&)> after) {
    std::lock_guard<std::mutex> lock(mu_);
    after_message_ = std::move(after);
  }
  bool wait_for(const std::function<bool()>& done, milliseconds timeout = milliseconds(20000)) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, done);
  }
  size_t messages() {
    std::lock_guard<std::mutex> lock(mu_);
    return received_.size();
  }

  // Stands in for the core's handshake (Connection::authenticated): a peer counts as
  // authenticated once its connection is accepted, or once it delivers a message.
  std::atomic<bool> authenticate_{true};
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Connection>> accepted_;
  std::vector<Received> received_;
  std::vector<std::pair<std::shared_ptr<Connection>, absl::Status>> closed_;
  int headers_ = 0;
  std::function<absl::Status(uint64_t, std::span<const uint64_t>)> admit_;
  std::function<void(Connection&, const Wire&)> after_message_;
};

// A listening transport and its recorder.
struct Side {
  std::shared_ptr<Recorder> events = std::make_shared<Recorder>();
  std::unique_ptr<Transport> transport;
  std::string address;

  explicit Side(std::unique_ptr<Transport> made) : transport(std::move(made)) {
    absl::StatusOr<std::string> listening = transport->listen(events);
    if (!listening.ok()) throw std::runtime_error(std::string(listening.status().message()));
    address = *listening;
  }
  ~Side() { transport->close(); }
};

Wire text(const std::string& s) { return Wire{s, {}, {}}; }

}  // namespace ferry::testing
