// File: rendezvous/rendezvous.h
//
// Rendezvous by URL: the processes of a job find each other and come out with a shared
// Store, their rank and the world size. The URL's scheme picks a handler:
//
//   file://PATH?rank=R&world_size=N        a FileStore at PATH (one host, shared fs);
//                                          &run_id=ID names the run (see FileStoreOptions)
//   tcp://HOST:PORT?rank=R&world_size=N    a TCPStore; rank 0 hosts the server
//   env://[?rank=R&world_size=N]           a TCPStore at MASTER_ADDR:MASTER_PORT; rank and
//                                          world size from RANK and WORLD_SIZE unless the
//                                          query gives them
//   etcd://HOST:PORT,HOST:PORT/JOBPREFIX?rank=R&world_size=N
//                                          an EtcdStore (store/etcd/etcd_store.h) over
//                                          those etcd members, keys under JOBPREFIX
//                                          (&run_id=ID adds /ID); no rank hosts the store.
//                                          Refused, saying how to build it, in a build
//                                          without EtcdStore (FERRY_WITH_ETCD=OFF)
//
//   FERRY_ASSIGN_OR_RETURN(ferry::RendezvousResult r,
//                          ferry::rendezvous("tcp://10.0.0.1:29500?rank=1&world_size=4"));
//   FERRY_RETURN_IF_ERROR(r.store->set("addr/" + std::to_string(r.rank), my_address));
//
// Other schemes are added with register_rendezvous_handler().
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "store/store.h"

namespace ferry {

// What a rendezvous yields.
// The world_size a dynamic group passes ("?world_size=dynamic", WORLD_SIZE=dynamic):
// rendezvous then gives world_size 0, and rank 0 (tcp://, env://) hosts the store
// without waiting for anyone.
inline constexpr char kDynamicWorldSize[] = "dynamic";

struct RendezvousResult {
  std::shared_ptr<Store> store;
  int rank = 0;
  int world_size = 0;  // 0: a dynamic group
};

// A rendezvous URL taken apart: SCHEME://AUTHORITY/PATH?QUERY. `host` and `port` come
// from the authority ("h:1", "[::1]:1"); path and query values are percent-decoded.
struct RendezvousUrl {
  std::string text;       // the URL as given
  std::string scheme;     // lower case, without "://"
  std::string authority;  // between "://" and the next '/' or '?'
  std::string host;
  std::optional<uint16_t> port;
  std::string path;       // from the '/' after the authority, '/' included
  std::map<std::string, std::string> query;  // a repeated parameter keeps its last value
};

// Parses `url`; kInvalidArgument when it has no scheme, a bad port or a malformed query.
absl::StatusOr<RendezvousUrl> parse_rendezvous_url(std::string_view url);

// Makes the store and learns rank and world size. `timeout` bounds the whole
// rendezvous (connecting, waiting for peers) and becomes the store's default timeout.
// Called on the caller's thread; may block up to `timeout`.
using UrlRendezvousHandler =
    std::function<absl::StatusOr<RendezvousResult>(const RendezvousUrl& url, std::chrono::milliseconds timeout)>;

// Registers `handler` for URLs of `scheme` (without "://", case-insensitive).
// kAlreadyExists when the scheme has a handler already (the built-in file, tcp and env
// included); kInvalidArgument for an empty scheme or handler. Thread-safe.
absl::Status register_rendezvous_handler(std::string_view scheme, UrlRendezvousHandler handler);

// Whether `scheme` has a handler. Thread-safe.
bool rendezvous_handler_registered(std::string_view scheme);

// Registers the file, tcp, env and etcd handlers. Idempotent and thread-safe; rendezvous()
// and register_rendezvous_handler() call it first, so callers rarely need to. (Explicit
// rather than static initializers, which the linker drops from a static library.)
void register_builtin_rendezvous_handlers();

// Runs the handler of `url`'s scheme. kNotFound when no handler is registered for it;
// kInvalidArgument for a URL its handler rejects (missing path, port, rank or world
// size, values out of range, unset environment variables); store errors otherwise.
absl::StatusOr<RendezvousResult> rendezvous(std::string_view url,
                                            std::chrono::milliseconds timeout = Store::kDefaultTimeout);

}  // namespace ferry
