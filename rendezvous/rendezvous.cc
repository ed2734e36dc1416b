#include "rendezvous/rendezvous.h"


#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/status.h"
#include "rendezvous/builtin.h"

namespace ferry {

using internal::av;

namespace {

class Registry {
 public:
  absl::Status add(std::string scheme, UrlRendezvousHandler handler) {
    absl::MutexLock lock(&mu_);
    if (handlers_.contains(scheme)) {
      return absl::AlreadyExistsError(absl::StrCat("rendezvous handler for ", scheme, ":// already registered"));
    }
    handlers_.emplace(std::move(scheme), std::move(handler));
    return absl::OkStatus();
  }
  std::optional<UrlRendezvousHandler> find(const std::string& scheme) {
    absl::MutexLock lock(&mu_);
    auto it = handlers_.find(scheme);
    if (it == handlers_.end()) return std::nullopt;
    return it->second;
  }

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, UrlRendezvousHandler> handlers_ ABSL_GUARDED_BY(mu_);
};

Registry& registry() {
  // Never destroyed: handlers may run during exit. The built-in handlers go in before
  // anyone can see the registry, so they cannot collide with a user's.
  static Registry* r = [] {
    auto* r = new Registry;
    for (auto& [scheme, handler] : internal::builtin_url_handlers()) (void)r->add(scheme, std::move(handler));
    return r;
  }();
  return *r;
}

// Decodes %XX escapes; a '%' not followed by two hex digits is kept as is.
std::string percent_decode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && hex(s[i + 1]) >= 0 && hex(s[i + 2]) >= 0) {
      out += static_cast<char>(hex(s[i + 1]) * 16 + hex(s[i + 2]));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<RendezvousUrl> parse_rendezvous_url(std::string_view text) {
  RendezvousUrl url;
  url.text = std::string(text);
  size_t sep = text.find("://");
  if (sep == std::string_view::npos || sep == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous url \"", av(text), "\" has no scheme (expected SCHEME://...)"));
  }
  url.scheme = absl::AsciiStrToLower(av(text.substr(0, sep)));
  std::string_view rest = text.substr(sep + 3);
  if (size_t hash = rest.find('#'); hash != std::string_view::npos) rest = rest.substr(0, hash);
  std::string_view query;
  if (size_t q = rest.find('?'); q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  size_t slash = rest.find('/');
  url.authority = std::string(rest.substr(0, slash));
  if (slash != std::string_view::npos) url.path = percent_decode(rest.substr(slash));

  // host[:port] or [v6]:port
  std::string_view authority = url.authority;
  std::string_view port_text;
  bool has_port = false;
  if (authority.starts_with("[")) {
    size_t close = authority.find(']');
    if (close == std::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("rendezvous url \"", av(text), "\": unclosed '[' in host"));
    }
    url.host = std::string(authority.substr(1, close - 1));
    std::string_view after = authority.substr(close + 1);
    if (after.starts_with(":")) {
      has_port = true;
      port_text = after.substr(1);
    }
  } else {
    size_t colon = authority.rfind(':');
    url.host = std::string(authority.substr(0, colon));
    if (colon != std::string_view::npos) {
      has_port = true;
      port_text = authority.substr(colon + 1);
    }
  }
  if (has_port && !port_text.empty()) {
    int port = 0;
    if (!absl::SimpleAtoi(av(port_text), &port) || port < 0 || port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("rendezvous url \"", av(text), "\": port \"", av(port_text),
                                                     "\" is not a number in 0..65535"));
    }
    url.port = static_cast<uint16_t>(port);
  }

  while (!query.empty()) {
    size_t amp = query.find('&');
    std::string_view pair = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (pair.empty()) continue;
    size_t eq = pair.find('=');
    if (eq == std::string_view::npos || eq == 0) {
      return absl::InvalidArgumentError(absl::StrCat("rendezvous url \"", av(text), "\": malformed query parameter \"",
                                                     av(pair), "\" (expected key=value)"));
    }
    url.query.insert_or_assign(percent_decode(pair.substr(0, eq)), percent_decode(pair.substr(eq + 1)));
  }
  return url;
}

void register_builtin_rendezvous_handlers() { (void)registry(); }

absl::Status register_rendezvous_handler(std::string_view scheme, UrlRendezvousHandler handler) {
  register_builtin_rendezvous_handlers();
  if (scheme.empty()) return absl::InvalidArgumentError("register_rendezvous_handler: scheme is empty");
  if (!handler) {
    return absl::InvalidArgumentError(
        absl::StrCat("register_rendezvous_handler: handler for ", av(scheme), ":// is empty"));
  }
  return registry().add(absl::AsciiStrToLower(av(scheme)), std::move(handler));
}

bool rendezvous_handler_registered(std::string_view scheme) {
  register_builtin_rendezvous_handlers();
  return registry().find(absl::AsciiStrToLower(av(scheme))).has_value();
}

absl::StatusOr<RendezvousResult> rendezvous(std::string_view url, std::chrono::milliseconds timeout) {
  register_builtin_rendezvous_handlers();
  FERRY_ASSIGN_OR_RETURN(RendezvousUrl parsed, parse_rendezvous_url(url));
  std::optional<UrlRendezvousHandler> handler = registry().find(parsed.scheme);
  if (!handler) return absl::NotFoundError(absl::StrCat("no rendezvous handler for ", parsed.scheme, "://"));
  return (*handler)(parsed, timeout);
}

}  // namespace ferry
