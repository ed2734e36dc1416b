#include "rendezvous/rendezvous.h"

#include <cstdlib>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/status.h"
#include "store/file_store.h"
#include "store/tcp_store.h"

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
  static Registry* r = new Registry;  // never destroyed: handlers may run during exit
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

// A handler's errors: "<scheme>:// rendezvous: <what> (url "<url>")".
class UrlError {
 public:
  UrlError(std::string_view scheme, std::string_view url) : scheme_(scheme), url_(url) {}
  absl::Status operator()(std::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(av(scheme_), ":// rendezvous: ", av(what), " (url \"", av(url_), "\")"));
  }

 private:
  std::string_view scheme_;
  std::string_view url_;
};

// Parses a rank or world size given as `source` (e.g. "rank parameter").
absl::StatusOr<int> parse_int(const UrlError& error, std::string_view source, const std::string& text) {
  int value = 0;
  if (!absl::SimpleAtoi(text, &value)) {
    return error(absl::StrCat(av(source), " \"", text, "\" is not an integer"));
  }
  return value;
}

absl::Status check_rank(const UrlError& error, int rank, int world_size) {
  if (world_size < 1) return error(absl::StrCat("world size must be at least 1, got ", world_size));
  if (rank < 0 || rank >= world_size) {
    return error(absl::StrCat("rank ", rank, " is out of range for world size ", world_size, " (expected 0 <= rank < ",
                              world_size, ")"));
  }
  return absl::OkStatus();
}

// rank and world_size from the query, both required (file://, tcp://).
// "world_size=dynamic" (a group that workers join and leave) gives 0.
absl::Status rank_and_world_size(const UrlError& error, const RendezvousUrl& url, int* rank, int* world_size) {
  auto r = url.query.find("rank");
  if (r == url.query.end()) return error("rank parameter missing");
  auto w = url.query.find("world_size");
  if (w == url.query.end()) return error("world size parameter missing");
  FERRY_ASSIGN_OR_RETURN(*rank, parse_int(error, "rank parameter", r->second));
  if (w->second == kDynamicWorldSize) {
    *world_size = 0;
    if (*rank < 0) return error(absl::StrCat("rank ", *rank, " must not be negative"));
    return absl::OkStatus();
  }
  FERRY_ASSIGN_OR_RETURN(*world_size, parse_int(error, "world size parameter", w->second));
  return check_rank(error, *rank, *world_size);
}

absl::StatusOr<RendezvousResult> file_handler(const RendezvousUrl& url, std::chrono::milliseconds timeout) {
  UrlError error("file", url.text);
  // Everything after "file://" is the path: file:///tmp/x is /tmp/x, file://x/y is x/y.
  std::string path = url.authority + url.path;
  if (path.empty()) return error("path missing");
  int rank = 0, world_size = 0;
  FERRY_RETURN_IF_ERROR(rank_and_world_size(error, url, &rank, &world_size));
  FileStoreOptions options;
  options.timeout = timeout;
  if (world_size > 0) options.world_size = world_size;
  // A relaunch names its run, so it never joins (or reads the keys of) an earlier
  // run's file; without it, a file every rank of the last run joined is replaced anyway.
  if (auto run = url.query.find("run_id"); run != url.query.end()) {
    if (run->second.empty() || run->second.size() > 255) return error("run_id must be 1 to 255 characters");
    options.run_id = run->second;
  }
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<FileStore> store, FileStore::create(path, options));
  return RendezvousResult{std::move(store), rank, world_size};
}

absl::StatusOr<RendezvousResult> tcp_store_result(const UrlError& error, std::string host, int port, int rank,
                                                  int world_size, std::chrono::milliseconds timeout) {
  if (port == 0) return error("port 0 is not allowed: the other ranks could not find the port the server picks");
  if (port < 0 || port > 65535) return error(absl::StrCat("port ", port, " is out of range (expected 1..65535)"));
  TCPStoreOptions options;
  options.host = std::move(host);
  options.port = static_cast<uint16_t>(port);
  options.is_server = rank == 0;
  // Rank 0 listens on the URL's address when it is one of its own, else on the
  // interface that reaches it (NAT, a service name); never on every interface unless
  // the URL says 0.0.0.0 (TCPStoreOptions::listen_host, docs/networking.md).
  if (world_size > 0) options.world_size = world_size;
  options.timeout = timeout;
  // Rank 0 waits in create() until every rank has connected.
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<TCPStore> store, TCPStore::create(options));
  return RendezvousResult{std::move(store), rank, world_size};
}

absl::StatusOr<RendezvousResult> tcp_handler(const RendezvousUrl& url, std::chrono::milliseconds timeout) {
  UrlError error("tcp", url.text);
  if (!url.port) return error("port number missing");
  if (url.host.empty()) return error("host missing");
  int rank = 0, world_size = 0;
  FERRY_RETURN_IF_ERROR(rank_and_world_size(error, url, &rank, &world_size));
  return tcp_store_result(error, url.host, *url.port, rank, world_size, timeout);
}

absl::StatusOr<RendezvousResult> env_handler(const RendezvousUrl& url, std::chrono::milliseconds timeout) {
  UrlError error("env", url.text);
  if (!url.text.starts_with("env://")) return error("url must be equal to `env://`");
  auto env_error = [&](std::string_view var) {
    return error(absl::StrCat("environment variable ", av(var), " expected, but not set"));
  };
  // A query parameter wins over its environment variable.
  auto lookup = [&](const char* param, const char* var, std::string* source) -> std::optional<std::string> {
    auto it = url.query.find(param);
    if (it != url.query.end()) {
      *source = absl::StrCat(param == std::string("rank") ? "rank" : "world size", " parameter");
      return it->second;
    }
    const char* value = std::getenv(var);
    if (value == nullptr) return std::nullopt;
    *source = absl::StrCat("environment variable ", var);
    return std::string(value);
  };
  std::string rank_source, world_source;
  std::optional<std::string> rank_text = lookup("rank", "RANK", &rank_source);
  if (!rank_text) return env_error("RANK");
  std::optional<std::string> world_text = lookup("world_size", "WORLD_SIZE", &world_source);
  if (!world_text) return env_error("WORLD_SIZE");
  const char* master_addr = std::getenv("MASTER_ADDR");
  if (master_addr == nullptr) return env_error("MASTER_ADDR");
  const char* master_port = std::getenv("MASTER_PORT");
  if (master_port == nullptr) return env_error("MASTER_PORT");

  FERRY_ASSIGN_OR_RETURN(int rank, parse_int(error, rank_source, *rank_text));
  int world_size = 0;
  if (*world_text == kDynamicWorldSize) {
    if (rank < 0) return error(absl::StrCat("rank ", rank, " must not be negative"));
  } else {
    FERRY_ASSIGN_OR_RETURN(world_size, parse_int(error, world_source, *world_text));
    FERRY_RETURN_IF_ERROR(check_rank(error, rank, world_size));
  }
  if (*master_addr == '\0') return error("environment variable MASTER_ADDR is empty");
  FERRY_ASSIGN_OR_RETURN(int port, parse_int(error, "environment variable MASTER_PORT", master_port));
  return tcp_store_result(error, master_addr, port, rank, world_size, timeout);
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

void register_builtin_rendezvous_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Cannot collide: the once flag runs these before any user registration can.
    (void)registry().add("file", file_handler);
    (void)registry().add("tcp", tcp_handler);
    (void)registry().add("env", env_handler);
  });
}

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
