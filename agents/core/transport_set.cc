#include "agents/core/transport_set.h"

#include "absl/strings/str_cat.h"
#include "base/logging.h"

namespace ferry {

TransportSet::TransportSet(std::vector<std::unique_ptr<Transport>> parts, std::vector<Judge> judges)
    : parts_(std::move(parts)), judges_(std::move(judges)) {
  FERRY_CHECK(!parts_.empty()) << "a TransportSet needs at least one part";
  FERRY_CHECK(judges_.empty() || judges_.size() == parts_.size()) << "a TransportSet needs one judge per part";
  for (const std::unique_ptr<Transport>& part : parts_) names_.push_back(transport_name_for(*part, ""));
}

bool TransportSet::part_reaches(size_t i, const std::string& address) const {
  if (!judges_.empty() && judges_[i] && !judges_[i](address)) return false;
  return parts_[i]->reaches(address);
}

TransportSet::~TransportSet() { close(); }

absl::StatusOr<std::string> TransportSet::listen(std::weak_ptr<TransportEvents> events) {
  std::string record;
  for (const std::unique_ptr<Transport>& part : parts_) {
    absl::StatusOr<std::string> mine = part->listen(events);
    if (!mine.ok()) {
      close();
      return mine.status();
    }
    absl::StrAppend(&record, *mine);
    if (!record.empty() && record.back() != '\n') record.push_back('\n');
  }
  return record;
}

size_t TransportSet::part_index(const std::string& address) const {
  for (size_t i = 0; i + 1 < parts_.size(); ++i) {
    if (part_reaches(i, address)) return i;
  }
  return parts_.size() - 1;
}

const std::string& TransportSet::name_for(const std::string& address) const { return names_[part_index(address)]; }

std::shared_ptr<Connection> TransportSet::connect(std::shared_ptr<internal::Session> session,
                                                  const std::string& peer_name, const std::string& address) {
  return parts_[part_index(address)]->connect(std::move(session), peer_name, address);
}

bool TransportSet::reaches(const std::string& address) const {
  for (size_t i = 0; i < parts_.size(); ++i) {
    if (part_reaches(i, address)) return true;
  }
  return false;
}

bool TransportSet::connects_on_demand() const {
  for (const std::unique_ptr<Transport>& part : parts_) {
    if (!part->connects_on_demand()) return false;
  }
  return true;
}

void TransportSet::close() {
  for (const std::unique_ptr<Transport>& part : parts_) part->close();
}

std::map<std::string, std::string> TransportSet::debug_info() const {
  std::map<std::string, std::string> out;
  std::string transports;
  for (const std::unique_ptr<Transport>& part : parts_) {
    for (auto& [key, value] : part->debug_info()) {
      if (key == "transports") {
        absl::StrAppend(&transports, transports.empty() ? "" : ",", value);
      } else {
        out.emplace(key, value);
      }
    }
  }
  out["transports"] = transports;
  return out;
}

std::string transport_name_for(const Transport& transport, const std::string& address) {
  if (const auto* set = dynamic_cast<const TransportSet*>(&transport)) return set->name_for(address);
  std::map<std::string, std::string> info = transport.debug_info();
  auto it = info.find("transports");
  return it == info.end() || it->second.empty() ? std::string("unnamed") : it->second;
}

}  // namespace ferry
