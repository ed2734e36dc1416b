#include "store/etcd/internal/etcd_client.h"

#include <poll.h>

#include <thread>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/status.h"

namespace ferry::internal {
namespace {

constexpr size_t kMaxIdlePerMember = 8;

// Whether etcd's answer says the request was not proposed (so any request may go to
// another member): no leader, or a member that is not ready.
bool not_proposed(const absl::Status& status) {
  return absl::StrContains(status.message(), "no leader") || absl::StrContains(status.message(), "not capable") ||
         absl::StrContains(status.message(), "connection refused") ||
         absl::StrContains(status.message(), "cannot resolve");
}

bool retryable(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable || status.code() == absl::StatusCode::kDeadlineExceeded;
}

}  // namespace

std::string EtcdEndpoint::text() const { return absl::StrCat(host, ":", port); }

absl::StatusOr<std::vector<EtcdEndpoint>> parse_etcd_endpoints(std::string_view list) {
  std::vector<EtcdEndpoint> endpoints;
  for (absl::string_view entry : absl::StrSplit(av(list), ',')) {
    absl::string_view e = entry;
    absl::ConsumePrefix(&e, "http://");
    absl::ConsumeSuffix(&e, "/");
    EtcdEndpoint endpoint;
    size_t colon = e.rfind(':');
    if (colon == std::string_view::npos || (e.front() == '[' && e.back() == ']')) {
      endpoint.host = std::string(e);
    } else {
      endpoint.host = std::string(e.substr(0, colon));
      uint32_t port = 0;
      if (!absl::SimpleAtoi(e.substr(colon + 1), &port) || port == 0 || port > 65535) {
        return absl::InvalidArgumentError(absl::StrCat("etcd endpoint '", entry,
                                                       "': bad port (expected host:port, e.g. 127.0.0.1:2379)"));
      }
      endpoint.port = static_cast<uint16_t>(port);
    }
    if (endpoint.host.size() > 1 && endpoint.host.front() == '[' && endpoint.host.back() == ']') {
      endpoint.host = endpoint.host.substr(1, endpoint.host.size() - 2);
    }
    if (endpoint.host.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("etcd endpoint '", entry,
                                                     "': no host (expected host:port, e.g. 127.0.0.1:2379)"));
    }
    endpoints.push_back(std::move(endpoint));
  }
  return endpoints;
}

std::string base64(std::string_view bytes) { return absl::Base64Escape(av(bytes)); }

absl::StatusOr<std::string> unbase64(std::string_view text) {
  std::string out;
  if (!absl::Base64Unescape(av(text), &out)) return absl::InternalError("etcd sent bad base64");
  return out;
}

EtcdClient::EtcdClient(Options options) : options_(std::move(options)) {
  for (size_t i = 0; i < options_.endpoints.size(); ++i) members_.push_back(std::make_unique<Member>());
}

std::string EtcdClient::endpoints_text() const {
  std::vector<std::string> all;
  for (const EtcdEndpoint& e : options_.endpoints) all.push_back(e.text());
  return absl::StrJoin(all, ", ");
}

absl::StatusOr<std::unique_ptr<HttpConnection>> EtcdClient::take_connection(size_t index,
                                                                           EtcdClock::time_point deadline) {
  Member& member = *members_[index];
  for (;;) {
    std::unique_ptr<HttpConnection> idle;
    {
      absl::MutexLock lock(&member.mu);
      if (member.idle.empty()) break;
      idle = std::move(member.idle.back());
      member.idle.pop_back();
    }
    // An idle connection that is readable was closed by its member (or it died): a
    // request sent on it would be lost after leaving, which add cannot retry.
    if (idle->idle_and_open()) return idle;
  }
  const EtcdEndpoint& e = options_.endpoints[index];
  return HttpConnection::connect(e.host, e.port, deadline);
}

void EtcdClient::give_back(size_t index, std::unique_ptr<HttpConnection> connection) {
  Member& member = *members_[index];
  absl::MutexLock lock(&member.mu);
  if (member.idle.size() < kMaxIdlePerMember) member.idle.push_back(std::move(connection));
}

absl::StatusOr<std::string> EtcdClient::token(size_t index, EtcdClock::time_point deadline) {
  if (options_.user.empty()) return std::string();
  Member& member = *members_[index];
  {
    absl::MutexLock lock(&member.mu);
    if (!member.token.empty()) return member.token;
  }
  nlohmann::json body = {{"name", options_.user}, {"password", options_.password}};
  auto connection = take_connection(index, deadline);
  if (!connection.ok()) return connection.status();
  absl::Status sent = (*connection)->send_post("/v3/auth/authenticate", body.dump(), "", deadline);
  if (!sent.ok()) return sent;
  auto response = (*connection)->read_response(deadline);
  if (!response.ok()) return response.status();
  nlohmann::json answer = nlohmann::json::parse(response->body, nullptr, false);
  if (response->status != 200 || !answer.is_object() || !answer.contains("token")) {
    std::string message = answer.is_object() && answer.contains("message") && answer["message"].is_string()
                              ? answer["message"].get<std::string>()
                              : absl::StrCat("HTTP ", response->status);
    // The user name may appear in the message; the password never does.
    return absl::UnauthenticatedError(absl::StrCat("authenticating as etcd user '", options_.user, "': ", message));
  }
  if (response->keep_alive) give_back(index, *std::move(connection));
  absl::MutexLock lock(&member.mu);
  member.token = answer["token"].get<std::string>();
  return member.token;
}

void EtcdClient::forget_token(size_t index) {
  Member& member = *members_[index];
  absl::MutexLock lock(&member.mu);
  member.token.clear();
}

absl::StatusOr<nlohmann::json> EtcdClient::attempt(size_t index, const std::string& path, const std::string& body,
                                                   EtcdClock::time_point deadline, bool* sent) {
  *sent = false;
  auto auth = token(index, deadline);
  if (!auth.ok()) return auth.status();
  auto connection = take_connection(index, deadline);
  if (!connection.ok()) return connection.status();
  absl::Status status = (*connection)->send_post(path, body, *auth, deadline);
  *sent = (*connection)->sent();
  if (!status.ok()) return status;
  auto response = (*connection)->read_response(deadline);
  if (!response.ok()) return response.status();
  if (response->keep_alive) give_back(index, *std::move(connection));
  nlohmann::json answer = nlohmann::json::parse(response->body, nullptr, false);
  if (response->status == 200 && answer.is_object()) return answer;
  int code = static_cast<int>(absl::StatusCode::kUnknown);
  std::string message = absl::StrCat("HTTP ", response->status);
  if (answer.is_object()) {
    if (answer.contains("code") && answer["code"].is_number_integer()) code = answer["code"].get<int>();
    if (answer.contains("message") && answer["message"].is_string()) message = answer["message"].get<std::string>();
  }
  if (code < 1 || code > 16) code = static_cast<int>(absl::StatusCode::kUnknown);
  if (code == static_cast<int>(absl::StatusCode::kUnauthenticated) || absl::StrContains(message, "invalid auth token")) {
    forget_token(index);
  }
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

absl::StatusOr<nlohmann::json> EtcdClient::call(std::string_view what, const std::string& path,
                                                const nlohmann::json& body, EtcdClock::time_point deadline,
                                                EtcdRetry retry) {
  const std::string text = body.dump();
  const size_t n = members_.size();
  std::vector<std::string> tried;
  bool reauthenticated = false;
  for (int round = 0;; ++round) {
    size_t first = preferred_.load(std::memory_order_relaxed);
    for (size_t k = 0; k < n; ++k) {
      size_t index = (first + k) % n;
      auto attempt_deadline = std::min(deadline, EtcdClock::now() + options_.attempt_timeout);
      bool sent = false;
      absl::StatusOr<nlohmann::json> answer = attempt(index, path, text, attempt_deadline, &sent);
      if (answer.ok()) {
        preferred_.store(index, std::memory_order_relaxed);
        return answer;
      }
      const absl::Status& s = answer.status();
      std::string note = absl::StrCat(options_.endpoints[index].text(), " (", s.message(), ")");
      if (tried.size() < 2 * n) tried.push_back(note);
      if (s.code() == absl::StatusCode::kUnauthenticated && !reauthenticated &&
          absl::StrContains(s.message(), "invalid auth token")) {
        reauthenticated = true;  // an expired token: once more with a fresh one
        --k;
        continue;
      }
      if (!retryable(s)) {
        return absl::Status(s.code(), absl::StrCat("etcd ", av(what), ": ", s.message(), " (at ",
                                                   options_.endpoints[index].text(), ")"));
      }
      if (retry == EtcdRetry::kUnlessSent && sent && !not_proposed(s)) {
        return absl::UnavailableError(absl::StrCat("etcd ", av(what), ": the request reached ",
                                                   options_.endpoints[index].text(),
                                                   " but no answer came back (", s.message(),
                                                   "); it may or may not have been applied"));
      }
      if (EtcdClock::now() >= deadline) break;
    }
    if (EtcdClock::now() >= deadline) break;
    // Every member failed: maybe an election is under way. Back off briefly.
    std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(
        std::chrono::milliseconds(50 * (round + 1)), std::chrono::milliseconds(500)));
    if (EtcdClock::now() >= deadline) break;
  }
  return absl::UnavailableError(absl::StrCat("etcd ", av(what), ": no member of the cluster could serve it; tried ",
                                             absl::StrJoin(tried, ", ")));
}

absl::StatusOr<std::unique_ptr<EtcdClient::Watch>> EtcdClient::open_watch(std::string_view what,
                                                                          const nlohmann::json& create_request,
                                                                          EtcdClock::time_point deadline) {
  const std::string text = nlohmann::json{{"create_request", create_request}}.dump();
  const size_t n = members_.size();
  std::vector<std::string> tried;
  for (int round = 0; EtcdClock::now() < deadline; ++round) {
    size_t first = preferred_.load(std::memory_order_relaxed);
    for (size_t k = 0; k < n && EtcdClock::now() < deadline; ++k) {
      size_t index = (first + k) % n;
      auto attempt_deadline = std::min(deadline, EtcdClock::now() + options_.attempt_timeout);
      absl::Status failed;
      auto auth = token(index, attempt_deadline);
      if (!auth.ok()) {
        failed = auth.status();
      } else {
        const EtcdEndpoint& e = options_.endpoints[index];
        auto connection = HttpConnection::connect(e.host, e.port, attempt_deadline);
        if (!connection.ok()) {
          failed = connection.status();
        } else if (failed = (*connection)->send_post("/v3/watch", text, *auth, attempt_deadline); failed.ok()) {
          auto status = (*connection)->read_head(attempt_deadline);
          if (!status.ok()) {
            failed = status.status();
          } else if (*status != 200) {
            failed = absl::UnavailableError(absl::StrCat("HTTP ", *status));
          } else {
            auto watch = std::unique_ptr<Watch>(new Watch());
            watch->connection_ = *std::move(connection);
            auto created = watch->next(attempt_deadline);
            if (created.ok() && created->value("created", false)) return watch;
            failed = created.ok() ? absl::UnavailableError(absl::StrCat("watch not created: ", created->dump()))
                                  : created.status();
          }
        }
      }
      if (failed.code() == absl::StatusCode::kUnauthenticated) forget_token(index);
      if (tried.size() < 2 * n) tried.push_back(absl::StrCat(options_.endpoints[index].text(), " (", failed.message(), ")"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(50 * (round + 1), 500)));
  }
  return absl::UnavailableError(absl::StrCat("etcd ", av(what), ": could not open a watch; tried ",
                                             absl::StrJoin(tried, ", ")));
}

absl::StatusOr<nlohmann::json> EtcdClient::Watch::next(EtcdClock::time_point deadline) {
  for (;;) {
    auto line = connection_->read_line(deadline);
    if (!line.ok()) return line.status();
    if (line->empty()) continue;
    nlohmann::json message = nlohmann::json::parse(*line, nullptr, false);
    if (!message.is_object()) return absl::UnavailableError("etcd sent a watch message that is not JSON");
    if (message.contains("error")) {
      return absl::UnavailableError(absl::StrCat("watch failed: ", message["error"].value("message", message.dump())));
    }
    if (!message.contains("result")) continue;
    return message["result"];
  }
}

}  // namespace ferry::internal
