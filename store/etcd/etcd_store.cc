#include "store/etcd/etcd_store.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "base/env.h"
#include "base/logging.h"
#include "base/status.h"
#include "base/thread_name.h"
#include "store/etcd/internal/etcd_client.h"
#include "store/internal/store_util.h"

namespace ferry {
namespace {

using internal::base64;
using internal::EtcdClock;
using internal::EtcdRetry;
using json = nlohmann::json;

// etcd's JSON carries 64-bit numbers as strings and omits fields that are zero.
int64_t number(const json& object, const char* field) {
  if (!object.is_object() || !object.contains(field)) return 0;
  const json& v = object[field];
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_string()) return std::strtoll(v.get<std::string>().c_str(), nullptr, 10);
  return 0;
}

int64_t revision_of(const json& answer) { return answer.contains("header") ? number(answer["header"], "revision") : 0; }

// The end of the range of every key that starts with `prefix`.
std::string range_end(std::string prefix) {
  while (!prefix.empty()) {
    unsigned char last = static_cast<unsigned char>(prefix.back());
    if (last < 0xff) {
      prefix.back() = static_cast<char>(last + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

// One key's state as a range answer gives it.
struct KeyValue {
  bool exists = false;
  Bytes value;
  int64_t mod_revision = 0;
};

absl::StatusOr<KeyValue> first_kv(const json& range_answer) {
  KeyValue kv;
  if (!range_answer.contains("kvs") || !range_answer["kvs"].is_array() || range_answer["kvs"].empty()) return kv;
  const json& item = range_answer["kvs"][0];
  kv.exists = true;
  kv.mod_revision = number(item, "mod_revision");
  auto value = internal::unbase64(item.value("value", ""));
  if (!value.ok()) return value.status();
  kv.value = to_bytes(*value);
  return kv;
}

json put_op(const std::string& key, const Bytes& value, int64_t lease) {
  json put = {{"key", base64(key)}, {"value", base64(to_string(value))}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  return {{"request_put", put}};
}

// Keys a transaction may touch at once (etcd's --max-txn-ops defaults to 128).
constexpr size_t kTxnOps = 100;

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdStore>> EtcdStore::create(const EtcdStoreOptions& options) {
  if (options.endpoints.empty()) {
    return absl::InvalidArgumentError("EtcdStore: no endpoints (expected host1:2379,host2:2379)");
  }
  auto endpoints = internal::parse_etcd_endpoints(options.endpoints);
  if (!endpoints.ok()) return endpoints.status();
  if (options.prefix.empty()) return absl::InvalidArgumentError("EtcdStore: the key prefix must not be empty");
  if (options.lease_ttl.count() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("EtcdStore: lease_ttl of ", options.lease_ttl.count(), " s is too short (at least 2 s)"));
  }
  internal::EtcdClient::Options client;
  client.endpoints = *std::move(endpoints);
  client.user = options.user.has_value() ? *options.user : internal::env_string("FERRY_ETCD_USER").value_or("");
  client.password =
      options.password.has_value() ? *options.password : internal::env_string("FERRY_ETCD_PASSWORD").value_or("");
  client.attempt_timeout = options.attempt_timeout;
  std::unique_ptr<EtcdStore> store(
      new EtcdStore(std::make_unique<internal::EtcdClient>(std::move(client)), options));
  // Fail now, with the endpoints named, rather than at the first operation.
  auto reachable = store->client_->call("connect", "/v3/kv/range", {{"key", base64(store->full(""))}, {"count_only", true}},
                                        store->request_deadline(), EtcdRetry::kAlways);
  if (!reachable.ok()) return reachable.status();
  return store;
}

EtcdStore::EtcdStore(std::unique_ptr<internal::EtcdClient> client, const EtcdStoreOptions& options)
    : Store(options.timeout),
      client_(std::move(client)),
      prefix_(options.prefix),
      request_timeout_(options.request_timeout),
      lease_ttl_(options.lease_ttl) {}

EtcdStore::~EtcdStore() {
  int64_t lease = 0;
  {
    absl::MutexLock lock(&lease_mu_);
    stopping_ = true;
    lease = lease_;
  }
  if (renewer_.joinable()) renewer_.join();
  if (lease != 0) {
    // Owned keys of a process that ends normally go at once, not after the TTL.
    auto revoked = client_->call("revoke lease", "/v3/lease/revoke", {{"ID", std::to_string(lease)}},
                                 EtcdClock::now() + std::chrono::seconds(2), EtcdRetry::kAlways);
    if (!revoked.ok()) FERRY_LOG(WARNING) << "EtcdStore: " << revoked.status().message();
  }
}

std::string EtcdStore::full(std::string_view key) const { return absl::StrCat(prefix_, "/", internal::av(key)); }

std::string EtcdStore::endpoints_text() const { return client_->endpoints_text(); }

EtcdClock::time_point EtcdStore::request_deadline() const { return EtcdClock::now() + request_timeout_; }

absl::Status EtcdStore::set(std::string_view key, const Bytes& value) {
  return client_
      ->call(absl::StrCat("set ", internal::quote_key(key)), "/v3/kv/put", put_op(full(key), value, 0)["request_put"],
             request_deadline(), EtcdRetry::kAlways)
      .status();
}

absl::StatusOr<Bytes> EtcdStore::get(std::string_view key, std::optional<std::chrono::milliseconds> timeout) {
  auto values = multi_get({std::string(key)}, timeout);
  if (!values.ok()) return values.status();
  return std::move((*values)[0]);
}

absl::StatusOr<int64_t> EtcdStore::add(std::string_view key, int64_t delta) {
  const std::string what = absl::StrCat("add to ", internal::quote_key(key));
  const std::string k = full(key);
  auto deadline = request_deadline();
  auto read = client_->call(what, "/v3/kv/range", {{"key", base64(k)}}, deadline, EtcdRetry::kAlways);
  if (!read.ok()) return read.status();
  auto kv = first_kv(*read);
  if (delta == 0) {
    // A read (linearizable, as every range here is): no write, so no race with other adds.
    if (!kv.ok()) return kv.status();
    return kv->exists ? internal::parse_counter(key, kv->value) : absl::StatusOr<int64_t>(0);
  }
  // Optimistic: write value + delta if nobody changed the key since we read it; the
  // failure branch reads it again, so a lost race costs one round trip.
  for (;;) {
    if (!kv.ok()) return kv.status();
    auto current = kv->exists ? internal::parse_counter(key, kv->value) : absl::StatusOr<int64_t>(0);
    if (!current.ok()) return current.status();
    auto next = internal::add_counter(key, *current, delta);
    if (!next.ok()) return next.status();
    json txn = {{"compare", json::array({{{"key", base64(k)},
                                          {"target", "MOD"},
                                          {"result", "EQUAL"},
                                          {"mod_revision", std::to_string(kv->mod_revision)}}})},
                {"success", json::array({put_op(k, internal::format_counter(*next), 0)})},
                {"failure", json::array({{{"request_range", {{"key", base64(k)}}}}})}};
    auto answer = client_->call(what, "/v3/kv/txn", txn, deadline, EtcdRetry::kUnlessSent);
    if (!answer.ok()) return answer.status();
    if (answer->value("succeeded", false)) return *next;
    kv = first_kv((*answer)["responses"][0]["response_range"]);
  }
}

absl::StatusOr<Bytes> EtcdStore::compare_set(std::string_view key, const Bytes& expected, const Bytes& desired) {
  return compare_set_with(key, expected, desired, 0);
}

absl::StatusOr<Bytes> EtcdStore::compare_set_owned(std::string_view key, const Bytes& expected, const Bytes& desired) {
  auto id = lease();
  if (!id.ok()) return id.status();
  return compare_set_with(key, expected, desired, *id);
}

absl::StatusOr<Bytes> EtcdStore::compare_set_with(std::string_view key, const Bytes& expected, const Bytes& desired,
                                                  int64_t lease) {
  const std::string what = absl::StrCat("compare_set ", internal::quote_key(key));
  const std::string k = full(key);
  auto deadline = request_deadline();
  auto read = client_->call(what, "/v3/kv/range", {{"key", base64(k)}}, deadline, EtcdRetry::kAlways);
  if (!read.ok()) return read.status();
  auto kv = first_kv(*read);
  for (;;) {
    if (!kv.ok()) return kv.status();
    bool matches = kv->exists ? kv->value == expected : expected.empty();
    if (!matches) return kv->exists ? kv->value : Bytes();
    json txn = {{"compare", json::array({{{"key", base64(k)},
                                          {"target", "MOD"},
                                          {"result", "EQUAL"},
                                          {"mod_revision", std::to_string(kv->mod_revision)}}})},
                {"success", json::array({put_op(k, desired, lease)})},
                {"failure", json::array({{{"request_range", {{"key", base64(k)}}}}})}};
    // A retried swap that had been applied finds the key changed and reads desired back.
    auto answer = client_->call(what, "/v3/kv/txn", txn, deadline, EtcdRetry::kAlways);
    if (!answer.ok()) return answer.status();
    if (answer->value("succeeded", false)) return desired;
    kv = first_kv((*answer)["responses"][0]["response_range"]);
  }
}

absl::StatusOr<std::vector<std::string>> EtcdStore::missing(const std::vector<std::string>& keys, int64_t* revision,
                                                            EtcdClock::time_point deadline) {
  std::vector<std::string> absent;
  *revision = 0;
  for (size_t begin = 0; begin < keys.size(); begin += kTxnOps) {
    size_t end = std::min(keys.size(), begin + kTxnOps);
    json ops = json::array();
    for (size_t i = begin; i < end; ++i) {
      ops.push_back({{"request_range", {{"key", base64(full(keys[i]))}, {"count_only", true}}}});
    }
    // Later chunks read at the first chunk's revision, so that a watch from there on
    // sees every key set since.
    if (*revision != 0) {
      for (auto& op : ops) op["request_range"]["revision"] = std::to_string(*revision);
    }
    auto answer = client_->call(absl::StrCat("check ", internal::describe_keys(keys)), "/v3/kv/txn",
                                {{"success", ops}}, deadline, EtcdRetry::kAlways);
    if (!answer.ok()) return answer.status();
    if (*revision == 0) *revision = revision_of(*answer);
    const json& responses = (*answer)["responses"];
    for (size_t i = begin; i < end; ++i) {
      if (number(responses[i - begin]["response_range"], "count") == 0) absent.push_back(keys[i]);
    }
  }
  return absent;
}

absl::StatusOr<bool> EtcdStore::check(const std::vector<std::string>& keys) {
  int64_t revision = 0;
  auto absent = missing(keys, &revision, request_deadline());
  if (!absent.ok()) return absent.status();
  return absent->empty();
}

absl::Status EtcdStore::wait(const std::vector<std::string>& keys, std::optional<std::chrono::milliseconds> timeout) {
  return wait_for("wait", keys, effective(timeout));
}

absl::Status EtcdStore::wait_for(const char* op, const std::vector<std::string>& keys,
                                 std::chrono::milliseconds timeout) {
  const auto start = EtcdClock::now();
  const auto deadline = start + timeout;
  std::vector<std::string> last_missing = keys;
  for (;;) {
    int64_t revision = 0;
    // The check may outlast a short wait by a little (a slow member), never a long one
    // by more than request_timeout: then the cluster is out of reach, and that is the error.
    auto now = EtcdClock::now();
    auto check_deadline = std::max(std::min(deadline, now + request_timeout_), now + std::chrono::milliseconds(500));
    auto absent = missing(keys, &revision, check_deadline);
    if (!absent.ok()) {
      if (EtcdClock::now() >= deadline) {
        return internal::wait_timeout_error(op, last_missing, internal::elapsed_since(start));
      }
      return absent.status();
    }
    if (absent->empty()) return absl::OkStatus();
    last_missing = *absent;
    if (EtcdClock::now() >= deadline) {
      return internal::wait_timeout_error(op, *absent, internal::elapsed_since(start));
    }
    // Watch the range that spans the missing keys from just after the revision they were
    // missing at, so that no set in between is lost, and strike each key off as its put
    // arrives: one check and one watch for the whole wait, whatever the number of keys
    // (a watch per key, checking them all again at each, cost a round trip per key per
    // arrival at a 64-worker init).
    std::vector<std::string> waiting;
    for (const std::string& k : *absent) waiting.push_back(full(k));
    std::sort(waiting.begin(), waiting.end());
    json request = {{"key", base64(waiting.front())},
                    {"range_end", base64(waiting.back() + std::string(1, '\0'))},
                    {"start_revision", std::to_string(revision + 1)},
                    {"filters", json::array({"NODELETE"})}};
    auto watch = client_->open_watch(absl::StrCat("wait for ", internal::describe_keys(*absent)), request, deadline);
    if (!watch.ok()) {
      if (EtcdClock::now() >= deadline) {
        return internal::wait_timeout_error(op, *absent, internal::elapsed_since(start));
      }
      return watch.status();
    }
    for (;;) {
      auto message = (*watch)->next(deadline);
      if (!message.ok()) break;  // the deadline, or a broken stream: check again
      if (message->value("canceled", false)) break;
      if (!message->contains("events")) continue;
      for (const json& event : (*message)["events"]) {
        if (!event.contains("kv")) continue;
        auto key = internal::unbase64(event["kv"].value("key", ""));
        if (!key.ok()) continue;
        auto it = std::lower_bound(waiting.begin(), waiting.end(), *key);
        if (it != waiting.end() && *it == *key) waiting.erase(it);
      }
      // All came: the check that follows confirms it (a key may have been deleted since).
      if (waiting.empty()) break;
    }
  }
}

absl::StatusOr<std::vector<std::string>> EtcdStore::wait_gone(const std::vector<std::string>& keys,
                                                              std::chrono::milliseconds timeout,
                                                              const std::function<bool()>& stop) {
  const auto deadline = EtcdClock::now() + timeout;
  constexpr auto kSlice = std::chrono::milliseconds(100);
  if (keys.empty()) {
    while (EtcdClock::now() < deadline && !stop()) std::this_thread::sleep_for(kSlice);
    return std::vector<std::string>();
  }
  const auto [lo, hi] = std::minmax_element(keys.begin(), keys.end());
  for (;;) {
    int64_t revision = 0;
    auto absent = missing(keys, &revision, request_deadline());
    if (!absent.ok() || !absent->empty()) return absent;
    if (EtcdClock::now() >= deadline || stop()) return std::vector<std::string>();
    // Deletions (expiries included) in the range that spans the keys, from just after
    // the revision they were all present at, so that none is missed in between.
    json request = {{"key", base64(full(*lo))},
                    {"range_end", base64(full(*hi) + std::string(1, '\0'))},
                    {"start_revision", std::to_string(revision + 1)},
                    {"filters", json::array({"NOPUT"})}};
    auto watch = client_->open_watch(absl::StrCat("watch ", internal::describe_keys(keys)), request,
                                     std::min(deadline, request_deadline()));
    if (!watch.ok()) {
      if (EtcdClock::now() >= deadline) return std::vector<std::string>();
      return watch.status();
    }
    for (;;) {
      if (stop()) return std::vector<std::string>();
      const auto now = EtcdClock::now();
      if (now >= deadline) return std::vector<std::string>();
      auto message = (*watch)->next(std::min(deadline, now + kSlice));
      if (!message.ok()) {
        if (message.status().code() == absl::StatusCode::kDeadlineExceeded) continue;
        break;  // the stream broke (its member died): check again and watch elsewhere
      }
      if (message->value("canceled", false)) break;
      if (message->contains("events") && !(*message)["events"].empty()) break;
    }
  }
}

absl::StatusOr<bool> EtcdStore::delete_key(std::string_view key) {
  auto answer = client_->call(absl::StrCat("delete ", internal::quote_key(key)), "/v3/kv/deleterange",
                              {{"key", base64(full(key))}}, request_deadline(), EtcdRetry::kAlways);
  if (!answer.ok()) return answer.status();
  return number(*answer, "deleted") > 0;
}

absl::StatusOr<int64_t> EtcdStore::num_keys() {
  std::string start = full("");
  auto answer = client_->call("num_keys", "/v3/kv/range",
                              {{"key", base64(start)}, {"range_end", base64(range_end(start))}, {"count_only", true}},
                              request_deadline(), EtcdRetry::kAlways);
  if (!answer.ok()) return answer.status();
  return number(*answer, "count");
}

absl::StatusOr<std::vector<Bytes>> EtcdStore::multi_get(const std::vector<std::string>& keys,
                                                        std::optional<std::chrono::milliseconds> timeout) {
  const auto start = EtcdClock::now();
  const auto limit = effective(timeout);
  for (;;) {
    auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(EtcdClock::now() - start);
    // Its timeout error names the keys still missing and the time this wait took; the
    // whole get's time is what the caller asked about.
    absl::Status ready = wait_for(keys.size() == 1 ? "get" : "multi_get", keys,
                                  std::max(limit - waited, std::chrono::milliseconds(0)));
    if (!ready.ok()) return ready;
    std::vector<Bytes> values;
    bool all = true;
    for (size_t begin = 0; begin < keys.size() && all; begin += kTxnOps) {
      size_t end = std::min(keys.size(), begin + kTxnOps);
      json ops = json::array();
      for (size_t i = begin; i < end; ++i) ops.push_back({{"request_range", {{"key", base64(full(keys[i]))}}}});
      auto answer = client_->call(absl::StrCat("get ", internal::describe_keys(keys)), "/v3/kv/txn",
                                  {{"success", ops}}, request_deadline(), EtcdRetry::kAlways);
      if (!answer.ok()) return answer.status();
      for (size_t i = begin; i < end; ++i) {
        auto kv = first_kv((*answer)["responses"][i - begin]["response_range"]);
        if (!kv.ok()) return kv.status();
        if (!kv->exists) all = false;  // deleted since the wait: wait again
        values.push_back(std::move(kv->value));
      }
    }
    if (all) return values;
  }
}

absl::Status EtcdStore::multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  if (keys.size() != values.size()) return internal::multi_set_size_error(keys.size(), values.size());
  for (size_t begin = 0; begin < keys.size(); begin += kTxnOps) {
    size_t end = std::min(keys.size(), begin + kTxnOps);
    json ops = json::array();
    for (size_t i = begin; i < end; ++i) ops.push_back(put_op(full(keys[i]), values[i], 0));
    auto answer = client_->call(absl::StrCat("multi_set ", internal::describe_keys(keys)), "/v3/kv/txn",
                                {{"success", ops}}, request_deadline(), EtcdRetry::kAlways);
    if (!answer.ok()) return answer.status();
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::pair<std::string, Bytes>>> EtcdStore::list(std::string_view key_prefix) {
  std::string start = full(key_prefix);
  auto answer = client_->call(absl::StrCat("list ", internal::quote_key(key_prefix)), "/v3/kv/range",
                              {{"key", base64(start)}, {"range_end", base64(range_end(start))}}, request_deadline(),
                              EtcdRetry::kAlways);
  if (!answer.ok()) return answer.status();
  std::vector<std::pair<std::string, Bytes>> out;
  if (!answer->contains("kvs")) return out;
  const size_t strip = full("").size();
  for (const json& item : (*answer)["kvs"]) {
    auto key = internal::unbase64(item.value("key", ""));
    auto value = internal::unbase64(item.value("value", ""));
    if (!key.ok()) return key.status();
    if (!value.ok()) return value.status();
    out.emplace_back(key->substr(std::min(strip, key->size())), to_bytes(*value));
  }
  return out;
}

absl::StatusOr<int64_t> EtcdStore::lease() {
  absl::MutexLock lock(&lease_mu_);
  if (lease_ != 0) return lease_;
  auto answer = client_->call("grant lease", "/v3/lease/grant", {{"TTL", std::to_string(lease_ttl_.count())}},
                              request_deadline(), EtcdRetry::kAlways);
  if (!answer.ok()) return answer.status();
  lease_ = number(*answer, "ID");
  if (lease_ == 0) return absl::InternalError("etcd granted a lease without an id");
  if (!renewer_.joinable()) renewer_ = std::thread([this] { renew_loop(); });
  return lease_;
}

absl::Status EtcdStore::set_owned(std::string_view key, const Bytes& value) {
  auto id = lease();
  if (!id.ok()) return id.status();
  return client_
      ->call(absl::StrCat("set ", internal::quote_key(key)), "/v3/kv/put", put_op(full(key), value, *id)["request_put"],
             request_deadline(), EtcdRetry::kAlways)
      .status();
}

void EtcdStore::renew_loop() {
  internal::name_this_thread("ferry-etcd-lease");
  const auto period = std::chrono::duration_cast<std::chrono::milliseconds>(lease_ttl_) / 3;
  for (;;) {
    int64_t id = 0;
    {
      absl::MutexLock lock(&lease_mu_);
      auto stop = [this]() ABSL_SHARED_LOCKS_REQUIRED(lease_mu_) { return stopping_; };
      lease_mu_.AwaitWithTimeout(absl::Condition(&stop), absl::FromChrono(period));
      if (stopping_) return;
      id = lease_;
    }
    // Renewal keeps trying other members for most of a period, so that one dead member
    // does not cost the lease.
    auto answer = client_->call("renew lease", "/v3/lease/keepalive", {{"ID", std::to_string(id)}},
                                EtcdClock::now() + period, EtcdRetry::kAlways);
    if (!answer.ok()) {
      FERRY_LOG(WARNING) << "EtcdStore: " << answer.status().message();
      continue;
    }
    if (number((*answer)["result"], "TTL") <= 0) {
      // It expired (this process stalled, or the cluster lost quorum for longer than the
      // TTL): what it held is gone, and a later set_owned takes a new lease.
      FERRY_LOG(WARNING) << "EtcdStore: lease " << id << " expired; its keys are gone";
      absl::MutexLock lock(&lease_mu_);
      if (lease_ == id) lease_ = 0;
    }
  }
}

}  // namespace ferry
