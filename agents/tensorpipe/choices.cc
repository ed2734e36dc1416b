#include "agents/tensorpipe/choices.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <random>

#include <tensorpipe/tensorpipe.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/auth.h"
#include "base/logging.h"
#include "base/net.h"
#include "base/status.h"

namespace ferry::internal {
namespace {

namespace tp = ::tensorpipe;

// Priorities: higher wins. Documented in agents/tensorpipe/factory.h.
struct Choice {
  const char* name;
  int64_t priority;
  bool by_default;
};
constexpr Choice kTransports[] = {{"shm", 200, true}, {"ibv", 100, true}, {"uv", 0, true}};
constexpr Choice kChannels[] = {{"xth", 1400, true}, {"cma", 1200, true}, {"mpt_uv", 800, false}, {"basic", 0, true}};
constexpr int kMptLanes = 2;
std::string unique_shm_address() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  return absl::StrCat("ferry-", getpid(), "-", counter.fetch_add(1), "-", rd());
}

template <size_t N>
absl::StatusOr<std::vector<const Choice*>> pick(const std::optional<std::vector<std::string>>& list,
                                                 const Choice (&choices)[N], const char* kind,
                                                 const std::vector<std::string>& not_by_default = {}) {
  std::vector<const Choice*> out;
  if (!list.has_value()) {
    for (const Choice& c : choices) {
      if (c.by_default && std::find(not_by_default.begin(), not_by_default.end(), c.name) == not_by_default.end()) {
        out.push_back(&c);
      }
    }
    return out;
  }
  if (list->empty()) return absl::InvalidArgumentError(absl::StrCat("the list of ", kind, "s is empty"));
  for (const std::string& name : *list) {
    const Choice* found = nullptr;
    for (const Choice& c : choices) {
      if (name == c.name) found = &c;
    }
    if (found == nullptr) {
      std::vector<std::string> names;
      for (const Choice& c : choices) names.push_back(c.name);
      return absl::InvalidArgumentError(
          absl::StrCat("unknown ", kind, " \"", name, "\" (expected one of: ", absl::StrJoin(names, ", "), ")"));
    }
    out.push_back(found);
  }
  return out;
}

absl::StatusOr<std::string> listen_host(const std::string& store_host) {
  FERRY_ASSIGN_OR_RETURN(ListenAddress where, resolve_listen_address(std::nullopt, store_host));
  FERRY_LOG(DEBUG) << "TensorPipe listens on " << where.host << " (" << where.source << ")";
  return where.host;
}

}  // namespace

// The address record: one "transport url" line per transport.
std::string encode_address(const std::map<std::string, std::string>& urls) {
  std::string out;
  for (const auto& [transport, url] : urls) absl::StrAppend(&out, transport, " ", url, "\n");
  return out;
}

std::map<std::string, std::string> decode_address(const std::string& record) {
  std::map<std::string, std::string> urls;
  for (absl::string_view line : absl::StrSplit(record, '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(line, absl::MaxSplits(' ', 1));
    urls[kv.first] = kv.second;
  }
  return urls;
}

const std::vector<std::string>& tensorpipe_transport_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const Choice& c : kTransports) out.push_back(c.name);
    return out;
  }();
  return names;
}

const std::vector<std::string>& tensorpipe_channel_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const Choice& c : kChannels) out.push_back(c.name);
    return out;
  }();
  return names;
}

absl::Status check_tensorpipe_options(const TensorPipeTransportOptions& options) {
  FERRY_RETURN_IF_ERROR(pick(options.transports, kTransports, "transport").status());
  FERRY_RETURN_IF_ERROR(pick(options.channels, kChannels, "channel").status());
  return absl::OkStatus();
}


absl::StatusOr<BuiltContext> build_context(const std::string& name, const TensorPipeTransportOptions& options) {
  // A peer that dies mid-write must fail that pipe, not kill this process: ignore
  // SIGPIPE unless the program installed a handler of its own.
  static std::once_flag sigpipe;
  std::call_once(sigpipe, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
  });
  FERRY_ASSIGN_OR_RETURN(std::vector<const Choice*> transports,
                         pick(options.transports, kTransports, "transport", options.not_by_default));
  FERRY_ASSIGN_OR_RETURN(std::vector<const Choice*> channels, pick(options.channels, kChannels, "channel"));
  BuiltContext built;
  BuiltContext* state = &built;
  state->context = std::make_shared<tp::Context>(tp::ContextOptions().name(name));
  std::optional<std::string> host;
  for (const Choice* c : transports) {
    std::shared_ptr<tp::transport::Context> t;
    std::string url;
    std::string kind = c->name;
    if (kind == "uv") {
      if (!host.has_value()) {
        FERRY_ASSIGN_OR_RETURN(host, listen_host(options.store_host));
      }
      t = tp::transport::uv::create();
      url = absl::StrCat("uv://", *host);
    } else if (kind == "shm") {
      t = tp::transport::shm::create();
      url = absl::StrCat("shm://", unique_shm_address());
    } else {
      if (!host.has_value()) {
        FERRY_ASSIGN_OR_RETURN(host, listen_host(options.store_host));
      }
      t = tp::transport::ibv::create();
      url = absl::StrCat("ibv://", *host);
    }
    if (!t->isViable()) {
      if (options.transports.has_value()) {
        return absl::FailedPreconditionError(absl::StrCat("transport \"", kind, "\" is not usable on this machine"));
      }
      continue;
    }
    state->context->registerTransport(c->priority, kind, std::move(t));
    state->transport_names.push_back(kind);
    state->listen_urls.push_back(std::move(url));
  }
  if (state->transport_names.empty()) return absl::FailedPreconditionError("no usable transport on this machine");
  for (const Choice* c : channels) {
    std::shared_ptr<tp::channel::Context> ch;
    std::string kind = c->name;
    if (kind == "basic") {
      ch = tp::channel::basic::create();
    } else if (kind == "cma") {
      ch = tp::channel::cma::create();
    } else if (kind == "xth") {
      ch = tp::channel::xth::create();
    } else {
      if (!host.has_value()) {
        FERRY_ASSIGN_OR_RETURN(host, listen_host(options.store_host));
      }
      std::vector<std::shared_ptr<tp::transport::Context>> lanes;
      std::vector<std::shared_ptr<tp::transport::Listener>> lane_listeners;
      for (int i = 0; i < kMptLanes; ++i) {
        auto lane = tp::transport::uv::create();
        lane_listeners.push_back(lane->listen(*host));
        lanes.push_back(std::move(lane));
      }
      ch = tp::channel::mpt::create(std::move(lanes), std::move(lane_listeners));
    }
    if (!ch->isViable()) {
      if (options.channels.has_value()) {
        return absl::FailedPreconditionError(absl::StrCat("channel \"", kind, "\" is not usable on this machine"));
      }
      continue;
    }
    state->context->registerChannel(c->priority, kind, std::move(ch));
    state->channel_names.push_back(kind);
  }
  if (state->channel_names.empty()) return absl::FailedPreconditionError("no usable channel on this machine");
  if (host.has_value()) auth::warn_if_open(absl::StrCat("TensorPipe agent \"", name, "\""), *host, options.auth_token);
  return built;
}

}  // namespace ferry::internal
