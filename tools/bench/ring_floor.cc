#include "tools/bench/ring_floor.h"

#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "agents/ring/factory.h"
#include "base/status.h"

namespace ferry::tools::bench {
namespace {

// One side of the ping-pong. The server echoes; the client times each round trip and
// sends the next from its data thread.
class Bouncer final : public TransportEvents {
 public:
  Bouncer(bool client, int total) : client_(client), total_(total) {}

  // No core here: each side counts its peer as authenticated at once, as the core does
  // after its handshake, so that the peers ring each other's bells rather than waking
  // each other through the socket (Connection::authenticated).
  void start(std::shared_ptr<Connection> out) {
    out_ = std::move(out);
    out_->authenticated();
    sent_ = Clock::now();
    out_->write(ping());
  }

  void on_accepted(const std::shared_ptr<Connection>& connection) override { connection->authenticated(); }
  absl::Status on_header(Connection&, uint64_t, std::span<const uint64_t>) override { return absl::OkStatus(); }
  void on_message(const std::shared_ptr<Connection>& connection, Wire wire) override {
    if (!client_) {
      connection->write(std::move(wire));
      return;
    }
    Clock::time_point now = Clock::now();
    samples_.push_back(micros_between(sent_, now));
    if (static_cast<int>(samples_.size()) == total_) {
      done.set(absl::OkStatus());
      return;
    }
    sent_ = Clock::now();
    out_->write(ping());
  }
  void on_closed(const std::shared_ptr<Connection>&, absl::Status why) override {
    if (client_) done.set(why.ok() ? absl::UnavailableError("the ring connection closed") : why);
  }

  std::vector<double> take_samples() { return std::move(samples_); }
  Waiter done;

 private:
  static Wire ping() { return Wire{std::string(8, 'p'), {}, {}}; }

  const bool client_;
  const int total_;
  std::shared_ptr<Connection> out_;
  Clock::time_point sent_;
  std::vector<double> samples_;  // the client's data thread only, until done
};

}  // namespace

absl::StatusOr<LatencyStats> ring_floor(int warmup, int iterations, std::chrono::milliseconds timeout) {
  auto server_events = std::make_shared<Bouncer>(false, 0);
  auto client_events = std::make_shared<Bouncer>(true, warmup + iterations);
  std::unique_ptr<Transport> server = make_ring_transport("floor-server");
  std::unique_ptr<Transport> client = make_ring_transport("floor-client");
  FERRY_ASSIGN_OR_RETURN(std::string address, server->listen(server_events));
  FERRY_RETURN_IF_ERROR(client->listen(client_events).status());
  client_events->start(client->connect(nullptr, "floor-server", address));
  absl::Status finished = client_events->done.wait(timeout, "ring ping-pong");
  client->close();
  server->close();
  FERRY_RETURN_IF_ERROR(finished);
  std::vector<double> samples = client_events->take_samples();
  samples.erase(samples.begin(), samples.begin() + warmup);
  return latency_stats(samples);
}

}  // namespace ferry::tools::bench
