// File: tests/testing/etcd_cluster.h
//
// A real etcd cluster for tests: N `etcd` processes on free loopback ports, their data
// and logs in a fresh temporary directory. start() waits, at most its timeout, until
// every member answers /health; the destructor SIGKILLs every member still running,
// reaps it and removes the directory. Members die with the test process too (their
// parent-death signal is SIGKILL), so a crashed test leaves no etcd behind.
//
//   auto cluster = ferry::testing::EtcdCluster::start({});
//   ASSERT_TRUE(cluster.ok()) << cluster.status();
//   std::string endpoints = (*cluster)->endpoints();   // "127.0.0.1:p0,127.0.0.1:p1,..."
//   (*cluster)->kill(*(*cluster)->leader());           // SIGKILL the leader
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ferry::testing {

struct EtcdClusterOptions {
  int members = 3;
  // The etcd binary; the build passes FERRY_ETCD_BINARY where it found one.
  std::string binary =
#ifdef FERRY_ETCD_BINARY
      FERRY_ETCD_BINARY;
#else
      "/usr/bin/etcd";
#endif
  // How long start() waits for every member to report healthy.
  std::chrono::milliseconds start_timeout = std::chrono::seconds(20);
  // Raft timing: short, so that a killed leader is replaced within about a second.
  std::chrono::milliseconds heartbeat = std::chrono::milliseconds(50);
  std::chrono::milliseconds election = std::chrono::milliseconds(500);
};

// Not thread-safe: one test thread drives it. Owns the member processes and the directory.
class EtcdCluster {
 public:
  static absl::StatusOr<std::unique_ptr<EtcdCluster>> start(const EtcdClusterOptions& options);
  ~EtcdCluster();
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  int size() const { return static_cast<int>(members_.size()); }
  // "127.0.0.1:port" of member i's client URL.
  std::string endpoint(int i) const;
  // Every member's client endpoint, comma-separated (the form etcd:// URLs take).
  std::string endpoints() const;
  // The index of the member that leads now (asks the live members), or an error.
  absl::StatusOr<int> leader() const;
  // SIGKILLs member i and reaps it.
  void kill(int i);
  // SIGSTOPs / SIGCONTs member i: it keeps its connections but answers nothing.
  void pause(int i);
  void resume(int i);
  bool alive(int i) const { return members_[static_cast<size_t>(i)].pid > 0; }
  const std::string& dir() const { return dir_; }
  // The member's log (etcd writes its own log to stderr; it goes to dir/member-i.log).
  std::string log(int i) const;
  // Its last 4000 characters, for error messages.
  std::string log_text(int i) const;

 private:
  struct Member {
    std::string name;
    uint16_t client_port = 0;
    uint16_t peer_port = 0;
    pid_t pid = -1;
    uint64_t id = 0;  // etcd's member id, known once healthy
  };
  EtcdCluster() = default;

  std::string dir_;
  std::vector<Member> members_;
};

// One 3-member cluster shared by all the tests of a binary: started before the first
// test and removed after the last (a gtest environment, registered on the first call,
// which a namespace-scope reference makes before main runs); null outside that span.
//   EtcdCluster*& cluster = shared_etcd_cluster();
EtcdCluster*& shared_etcd_cluster();

// A one-shot HTTP/1.1 POST (or GET when body is empty) on 127.0.0.1:port; returns the
// response body, or an error on a non-200 status, a refused connection or the timeout.
absl::StatusOr<std::string> http_call(uint16_t port, const std::string& path, const std::string& body,
                                      std::chrono::milliseconds timeout);

}  // namespace ferry::testing
