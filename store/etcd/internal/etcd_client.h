// A client of etcd's v3 JSON gateway over several endpoints: each request goes to the
// member that answered last, and moves on to the next member when that one refuses,
// drops the connection, times out or has no leader. Internal to store/etcd/.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "nlohmann/json.hpp"
#include "store/etcd/internal/http.h"

namespace ferry::internal {

struct EtcdEndpoint {
  std::string host;
  uint16_t port = 2379;
  std::string text() const;  // "host:port"
};

// "host1:2379,host2:2379" (an "http://" in front of each is accepted; a missing port is
// 2379). kInvalidArgument naming the bad entry and the expected form.
absl::StatusOr<std::vector<EtcdEndpoint>> parse_etcd_endpoints(std::string_view list);

std::string base64(std::string_view bytes);
absl::StatusOr<std::string> unbase64(std::string_view text);

// Whether a failed request may go to another member.
enum class EtcdRetry {
  kAlways,      // idempotent: reads, puts, deletes, compare-and-set
  kUnlessSent,  // not idempotent (add): only when the request never reached a member, or
                // the member said it has no leader (nothing was proposed)
};

// Thread-safe. Credentials are kept only to authenticate and are never logged or put in
// an error message.
class EtcdClient {
 public:
  struct Options {
    std::vector<EtcdEndpoint> endpoints;
    std::string user;
    std::string password;
    // How long one member gets to answer before the request moves to the next.
    std::chrono::milliseconds attempt_timeout = std::chrono::seconds(3);
  };
  explicit EtcdClient(Options options);

  // POSTs `body` to `path`, trying members until one answers or the deadline passes.
  // The error names `what`, every member tried and what each said: kUnavailable when no
  // member could serve it, kDeadlineExceeded when members were still being tried at the
  // deadline, or the code etcd answered (kInvalidArgument, kPermissionDenied, ...).
  absl::StatusOr<nlohmann::json> call(std::string_view what, const std::string& path, const nlohmann::json& body,
                                      EtcdClock::time_point deadline, EtcdRetry retry);

  // A watch stream on one member (see open_watch). Not thread-safe; one owner.
  class Watch {
   public:
    // The next message of the stream (its "result" object), waiting until the deadline:
    // kDeadlineExceeded when none came, kUnavailable when the stream broke.
    absl::StatusOr<nlohmann::json> next(EtcdClock::time_point deadline);

   private:
    friend class EtcdClient;
    std::unique_ptr<HttpConnection> connection_;
  };
  // Opens a watch with `create_request` on the first member that accepts it, returning
  // once etcd confirmed it was created.
  absl::StatusOr<std::unique_ptr<Watch>> open_watch(std::string_view what, const nlohmann::json& create_request,
                                                    EtcdClock::time_point deadline);

  // "127.0.0.1:2379, 127.0.0.1:2380" for messages.
  std::string endpoints_text() const;
  const std::vector<EtcdEndpoint>& endpoints() const { return options_.endpoints; }

 private:
  struct Member {
    absl::Mutex mu;
    std::vector<std::unique_ptr<HttpConnection>> idle ABSL_GUARDED_BY(mu);
    std::string token ABSL_GUARDED_BY(mu);
  };
  // One attempt on member `index`.
  absl::StatusOr<nlohmann::json> attempt(size_t index, const std::string& path, const std::string& body,
                                         EtcdClock::time_point deadline, bool* sent);
  absl::StatusOr<std::unique_ptr<HttpConnection>> take_connection(size_t index, EtcdClock::time_point deadline);
  void give_back(size_t index, std::unique_ptr<HttpConnection> connection);
  // The member's auth token ("" without a user), authenticating when it has none.
  absl::StatusOr<std::string> token(size_t index, EtcdClock::time_point deadline);
  void forget_token(size_t index);

  const Options options_;
  std::vector<std::unique_ptr<Member>> members_;
  std::atomic<size_t> preferred_{0};
};

}  // namespace ferry::internal
