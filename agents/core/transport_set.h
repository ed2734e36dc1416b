// File: agents/core/transport_set.h
//
// TransportSet: one Transport made of several, for a worker that reaches some peers one
// way and the rest another (the shared-memory ring on its own host, TCP beyond). It
// listens on every part and publishes their address records joined: a record is lines
// of "<transport> <url>", and each part reads only its own lines. connect() goes
// through the first part, in the order given, whose reaches() accepts the peer's
// record; the last part takes the peers no other reaches, and says why it cannot when
// it cannot either.
//
//   std::vector<std::unique_ptr<Transport>> parts;
//   parts.push_back(make_ring_transport(name));
//   parts.push_back(*std::move(tensorpipe));
//   auto transport = std::make_unique<TransportSet>(std::move(parts));
//
// Threads: each part delivers its own connections' events on its own threads.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "agents/core/transport.h"

namespace ferry {

class TransportSet final : public Transport {
 public:
  // Whether a part may connect the worker whose record is the argument.
  using Judge = std::function<bool(const std::string& record)>;

  // `parts` is not empty; `judges` is empty or has one per part (an empty one
  // leaves the part's reaches() alone to judge).
  explicit TransportSet(std::vector<std::unique_ptr<Transport>> parts, std::vector<Judge> judges = {});
  ~TransportSet() override;

  absl::StatusOr<std::string> listen(std::weak_ptr<TransportEvents> events) override;
  std::shared_ptr<Connection> connect(std::shared_ptr<internal::Session> session, const std::string& peer_name,
                                      const std::string& address) override;
  bool reaches(const std::string& address) const override;
  bool connects_on_demand() const override;
  void close() override;
  // The parts' counters; "transports" lists every part's, in order.
  std::map<std::string, std::string> debug_info() const override;

  const std::vector<std::unique_ptr<Transport>>& parts() const { return parts_; }
  // The name of the part connect() goes through for the worker whose record is
  // `address` (its debug_info()'s "transports", read once when the set is made).
  const std::string& name_for(const std::string& address) const;

 private:
  bool part_reaches(size_t i, const std::string& address) const;
  // The index of the part connect() goes through for `address`.
  size_t part_index(const std::string& address) const;

  std::vector<std::unique_ptr<Transport>> parts_;
  std::vector<Judge> judges_;  // empty, or one per part
  std::vector<std::string> names_;  // one per part
};

// The name of the transport that `transport` reaches the worker whose record is
// `address` by, as connect() chooses it: "ring", "tcp", or a TensorPipe part's names
// ("shm,uv"). For the log, debug_info and the metrics; asks the part's debug_info(), so
// call it once per peer, not per message (a TransportSet answers from its cache).
std::string transport_name_for(const Transport& transport, const std::string& address);

// `transport` itself, or the first part of a TransportSet that is a T; null if none.
template <typename T>
const T* find_transport(const Transport& transport) {
  if (const T* t = dynamic_cast<const T*>(&transport)) return t;
  if (const TransportSet* set = dynamic_cast<const TransportSet*>(&transport)) {
    for (const std::unique_ptr<Transport>& part : set->parts()) {
      if (const T* t = dynamic_cast<const T*>(part.get())) return t;
    }
  }
  return nullptr;
}

}  // namespace ferry
