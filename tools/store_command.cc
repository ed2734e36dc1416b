// `ferry store`: run a standalone TCPStore server, or poke at one.
//
//   ferry store serve --port 29500                # the resolver's interface: "listening on 10.0.0.5:29500"
//   ferry store serve --host 0.0.0.0 --port 29500 # every interface, as asked
//   ferry store set  --addr 10.0.0.1:29500 KEY VALUE
//   ferry store get  --addr 10.0.0.1:29500 KEY [--timeout-ms 5000]
//   ferry store add  --addr 10.0.0.1:29500 KEY DELTA
//   ferry store wait --addr 10.0.0.1:29500 KEY... [--timeout-ms 5000]
//   ferry store keys --addr 10.0.0.1:29500
//   ferry store list --addr etcd://10.0.0.1:2379,10.0.0.2:2379/job7 [KEY_PREFIX]
//
// --addr etcd://ENDPOINTS/PREFIX reads and writes the keys of an EtcdStore (the job
// prefix an etcd:// init method names) instead; `list` prints its keys and values.
//
// Exit codes as every subcommand: 0 done, 1 the operation failed (timeout, unreachable
// server), 2 bad usage.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/net.h"
#include "store/tcp_store.h"
#include "tools/commands.h"
#ifdef FERRY_HAVE_ETCD
#include "store/etcd/etcd_store.h"
#endif

namespace ferry::tools {
namespace {

// Options shared by the client subcommands.
struct ClientOptions {
  std::string addr;
  int64_t timeout_ms = 10000;
};

// Splits "HOST:PORT" or "[V6]:PORT"; false when it is neither.
bool split_addr(const std::string& addr, std::string* host, uint16_t* port) {
  size_t colon = addr.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  std::string h = addr.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  int p = 0;
  if (h.empty() || !absl::SimpleAtoi(addr.substr(colon + 1), &p) || p < 1 || p > 65535) return false;
  *host = h;
  *port = static_cast<uint16_t>(p);
  return true;
}

void fail(const char* op, const absl::Status& status) {
  std::fprintf(stderr, "ferry store %s: %s\n", op, status.ToString().c_str());
}

// Connects per the options, or reports why not and sets the exit code.
std::unique_ptr<Store> connect(const char* op, const ClientOptions& options, ExitCode& exit_code) {
  if (options.addr.starts_with("etcd://")) {
    auto store = connect_etcd_store(options.addr, std::chrono::milliseconds(std::max<int64_t>(options.timeout_ms, 0)));
    if (!store.ok()) {
      fail(op, store.status());
      exit_code.set(store.status().code() == absl::StatusCode::kInvalidArgument ? kExitUsage : kExitFailed);
      return nullptr;
    }
    return *std::move(store);
  }
  std::string host;
  uint16_t port = 0;
  if (!split_addr(options.addr, &host, &port)) {
    std::fprintf(stderr, "ferry store %s: --addr must be HOST:PORT with a port in 1..65535, got '%s'\n", op,
                 options.addr.c_str());
    exit_code.set(kExitUsage);
    return nullptr;
  }
  if (options.timeout_ms < 0) {
    std::fprintf(stderr, "ferry store %s: --timeout-ms must not be negative, got %lld\n", op,
                 static_cast<long long>(options.timeout_ms));
    exit_code.set(kExitUsage);
    return nullptr;
  }
  auto store = TCPStore::create(host, port, false, std::nullopt, std::chrono::milliseconds(options.timeout_ms));
  if (!store.ok()) {
    fail(op, store.status());
    exit_code.set(kExitFailed);
    return nullptr;
  }
  return *std::move(store);
}

constexpr const char* kTokenHelp =
    "Environment: FERRY_AUTH_TOKEN, the job token. A store served with it refuses clients that do not prove it; "
    "a client proves it (the job's workers and ferry top do the same).";

CLI::App* add_client_command(CLI::App* parent, const char* name, const char* help, ClientOptions& options) {
  CLI::App* cmd = parent->add_subcommand(name, help);
  cmd->footer(kTokenHelp);
  cmd->add_option("--addr", options.addr, "The store server, HOST:PORT, or etcd://HOST:PORT,.../PREFIX")->required();
  cmd->add_option("--timeout-ms", options.timeout_ms, "How long to wait, connecting included (ms)")
      ->capture_default_str();
  return cmd;
}

int serve(const std::string& host, int port) {
  if (port < 0 || port > 65535) {
    std::fprintf(stderr, "ferry store serve: --port must be in 0..65535, got %d\n", port);
    return kExitUsage;
  }
  // Block the stop signals before the server's thread exists, so it inherits the mask
  // and this thread alone takes them, in sigwait below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  TCPStoreServerOptions options;
  options.host = host;
  options.port = static_cast<uint16_t>(port);
  auto server = TCPStoreServer::create(options);
  if (!server.ok()) {
    fail("serve", server.status());
    return kExitFailed;
  }
  const std::string& bound = (*server)->host();
  bool v6 = bound.find(':') != std::string::npos;
  std::printf("listening on %s%s%s:%u\n", v6 ? "[" : "", bound.c_str(), v6 ? "]" : "", (*server)->port());
  if (internal::is_wildcard_address(bound)) {
    std::fprintf(stderr, "ferry store serve: listening on every interface, as --host %s asks\n", bound.c_str());
  }
  std::fflush(stdout);
  int sig = 0;
  sigwait(&stop_signals, &sig);
  (*server)->shutdown();
  std::fprintf(stderr, "ferry store serve: stopped by %s\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
  return kExitOk;
}

void add_store_command(CLI::App& app, ExitCode& exit_code) {
  CLI::App* store = app.add_subcommand("store", "Run a TCPStore server or use one");
  store->footer(kTokenHelp);
  store->require_subcommand(1);

  // serve
  {
    struct ServeOptions {
      std::string host;  // empty: the interface base/net.h's resolver picks
      int port = 0;
    };
    auto options = std::make_shared<ServeOptions>();
    CLI::App* cmd = store->add_subcommand("serve", "Run a store server until SIGINT or SIGTERM");
    cmd->footer(kTokenHelp);
    cmd->add_option("--host,--bind", options->host,
                    "Address to listen on (default: the interface FERRY_SOCKET_IFNAME names, else the host "
                    "name's address; 0.0.0.0 or :: for every interface)");
    cmd->add_option("--port", options->port, "Port to listen on (0 picks a free one)")->capture_default_str();
    cmd->callback([options, &exit_code] { exit_code.set(serve(options->host, options->port)); });
  }

  // set KEY VALUE
  {
    auto options = std::make_shared<ClientOptions>();
    auto args = std::make_shared<std::vector<std::string>>();
    CLI::App* cmd = add_client_command(store, "set", "Set KEY to VALUE", *options);
    cmd->add_option("key_value", *args, "KEY VALUE")->required()->expected(2);
    cmd->callback([options, args, &exit_code] {
      auto s = connect("set", *options, exit_code);
      if (!s) return;
      absl::Status status = s->set((*args)[0], to_bytes((*args)[1]));
      if (!status.ok()) {
        fail("set", status);
        exit_code.set(kExitFailed);
      }
    });
  }

  // get KEY
  {
    auto options = std::make_shared<ClientOptions>();
    auto key = std::make_shared<std::string>();
    CLI::App* cmd = add_client_command(store, "get", "Print KEY's value, waiting for it up to the timeout", *options);
    cmd->add_option("key", *key, "KEY")->required();
    cmd->callback([options, key, &exit_code] {
      auto s = connect("get", *options, exit_code);
      if (!s) return;
      auto value = s->get(*key, std::chrono::milliseconds(options->timeout_ms));
      if (!value.ok()) {
        fail("get", value.status());
        exit_code.set(kExitFailed);
        return;
      }
      std::fwrite(value->data(), 1, value->size(), stdout);
      std::fputc('\n', stdout);
    });
  }

  // add KEY DELTA
  {
    auto options = std::make_shared<ClientOptions>();
    auto key = std::make_shared<std::string>();
    auto delta = std::make_shared<int64_t>(0);
    CLI::App* cmd = add_client_command(store, "add", "Add DELTA to the counter KEY and print the result", *options);
    cmd->add_option("key", *key, "KEY")->required();
    cmd->add_option("delta", *delta, "DELTA (an integer; put -- before a negative one)")->required();
    cmd->callback([options, key, delta, &exit_code] {
      auto s = connect("add", *options, exit_code);
      if (!s) return;
      auto value = s->add(*key, *delta);
      if (!value.ok()) {
        fail("add", value.status());
        exit_code.set(kExitFailed);
        return;
      }
      std::printf("%lld\n", static_cast<long long>(*value));
    });
  }

  // wait KEY...
  {
    auto options = std::make_shared<ClientOptions>();
    auto keys = std::make_shared<std::vector<std::string>>();
    CLI::App* cmd = add_client_command(store, "wait", "Wait until every KEY is set", *options);
    cmd->add_option("keys", *keys, "KEY...")->required();
    cmd->callback([options, keys, &exit_code] {
      auto s = connect("wait", *options, exit_code);
      if (!s) return;
      absl::Status status = s->wait(*keys, std::chrono::milliseconds(options->timeout_ms));
      if (!status.ok()) {
        fail("wait", status);
        exit_code.set(kExitFailed);
      }
    });
  }

  // keys
  {
    auto options = std::make_shared<ClientOptions>();
    CLI::App* cmd = add_client_command(store, "keys", "Print how many keys the store holds", *options);
    cmd->callback([options, &exit_code] {
      auto s = connect("keys", *options, exit_code);
      if (!s) return;
      auto n = s->num_keys();
      if (!n.ok()) {
        fail("keys", n.status());
        exit_code.set(kExitFailed);
        return;
      }
      std::printf("%lld\n", static_cast<long long>(*n));
    });
  }

  // list [KEY_PREFIX]: etcd only (a TCPStore cannot enumerate its keys)
  {
    auto options = std::make_shared<ClientOptions>();
    auto key_prefix = std::make_shared<std::string>();
    CLI::App* cmd = add_client_command(store, "list", "Print every key (under KEY_PREFIX) and its value, etcd:// only",
                                       *options);
    cmd->add_option("key_prefix", *key_prefix, "KEY_PREFIX");
    cmd->callback([options, key_prefix, &exit_code] {
      if (!options->addr.starts_with("etcd://")) {
        std::fprintf(stderr, "ferry store list: a TCPStore cannot list its keys; --addr must be etcd://HOSTS/PREFIX\n");
        exit_code.set(kExitUsage);
        return;
      }
      auto s = connect("list", *options, exit_code);
      if (!s) return;
#ifdef FERRY_HAVE_ETCD
      auto listed = static_cast<EtcdStore&>(*s).list(*key_prefix);
      if (!listed.ok()) {
        fail("list", listed.status());
        exit_code.set(kExitFailed);
        return;
      }
      for (const auto& [key, value] : *listed) {
        std::printf("%s = %s\n", key.c_str(), to_string(value).c_str());
      }
#endif
    });
  }
}

}  // namespace

FERRY_REGISTER_COMMAND(add_store_command);

absl::StatusOr<std::unique_ptr<Store>> connect_etcd_store(const std::string& addr, std::chrono::milliseconds timeout) {
#ifndef FERRY_HAVE_ETCD
  (void)timeout;
  return absl::FailedPreconditionError(absl::StrCat("--addr ", addr,
                                                    ": this build of ferry has no EtcdStore (configured with "
                                                    "FERRY_WITH_ETCD=OFF); configure it with -DFERRY_WITH_ETCD=ON"));
#else
  std::string rest = addr.substr(7);
  size_t slash = rest.find('/');
  if (slash == std::string::npos || slash + 1 >= rest.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--addr ", addr, ": expected etcd://host1:2379,host2:2379/jobprefix (the prefix is missing)"));
  }
  EtcdStoreOptions options;
  options.endpoints = rest.substr(0, slash);
  options.prefix = rest.substr(slash + 1);
  options.timeout = timeout;
  options.request_timeout = std::max(timeout, std::chrono::milliseconds(1000));
  auto store = EtcdStore::create(options);
  if (!store.ok()) return store.status();
  return std::unique_ptr<Store>(*std::move(store));
#endif
}

}  // namespace ferry::tools
