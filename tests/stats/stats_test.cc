// AgentStats and its Prometheus form, in one process: counts, histogram buckets,
// percentiles of known inputs, threads recording at once, the round trip through text.
#include "stats/stats.h"

#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "stats/prometheus.h"

namespace ferry {
namespace {

HistogramSnapshot histogram_of(const std::vector<double>& seconds) {
  HistogramSnapshot h;
  for (double s : seconds) {
    ++h.buckets[HistogramSnapshot::bucket_of(s)];
    ++h.count;
    h.sum += s;
    h.max = std::max(h.max, s);
  }
  return h;
}

TEST(Histogram, BucketsAreInclusiveLogScaleBounds) {
  EXPECT_EQ(HistogramSnapshot::bucket_of(0), 0);
  EXPECT_EQ(HistogramSnapshot::bucket_of(1e-6), 0);
  EXPECT_EQ(HistogramSnapshot::bucket_of(1.5e-6), 1);
  EXPECT_EQ(HistogramSnapshot::bucket_of(1e-3), 9);
  EXPECT_EQ(HistogramSnapshot::bucket_of(100), HistogramSnapshot::kBounds - 1);
  EXPECT_EQ(HistogramSnapshot::bucket_of(1000), HistogramSnapshot::kBuckets - 1);
  for (int i = 1; i < HistogramSnapshot::kBounds; ++i) {
    EXPECT_LT(HistogramSnapshot::upper_bound(i - 1), HistogramSnapshot::upper_bound(i));
  }
  EXPECT_TRUE(std::isinf(HistogramSnapshot::upper_bound(HistogramSnapshot::kBuckets - 1)));
}

TEST(Histogram, PercentilesOfKnownInputs) {
  // 90 values of 1 ms and 10 of 1 s: p50 and p90 lie in the 1 ms bucket, p99 in the 1 s one.
  std::vector<double> values(90, 1e-3);
  values.insert(values.end(), 10, 1.0);
  HistogramSnapshot h = histogram_of(values);
  EXPECT_GT(h.percentile(0.5), 5e-4);
  EXPECT_LE(h.percentile(0.5), 1e-3);
  EXPECT_LE(h.percentile(0.9), 1e-3);
  EXPECT_GT(h.percentile(0.99), 0.5);
  EXPECT_LE(h.percentile(0.99), 1.0);
  EXPECT_DOUBLE_EQ(h.percentile(1.0), 1.0);
  EXPECT_EQ(HistogramSnapshot{}.percentile(0.5), 0);
  // A single value: every percentile is within its bucket and never above the max.
  HistogramSnapshot one = histogram_of({3e-3});
  EXPECT_GT(one.percentile(0.5), 2e-3);
  EXPECT_LE(one.percentile(0.5), 3e-3);
}

TEST(AgentStats, CountsCallsErrorsBytesAndInFlight) {
  AgentStats stats("w0", /*time_one_in=*/1);
  AgentStats::Call a = stats.call_started("w1", "add", 100);
  AgentStats::Call b = stats.call_started("w1", "mul", 50);
  AgentStats::Call c = stats.call_started("w2", "add", 10);
  StatsSnapshot mid = stats.snapshot();
  EXPECT_EQ(mid.totals.made, 3u);
  EXPECT_EQ(mid.made_in_flight, 3);
  AgentStats::call_finished(a, absl::StatusCode::kOk, 7);
  AgentStats::call_finished(b, absl::StatusCode::kDeadlineExceeded, 0);
  AgentStats::Request r = stats.request_received("w2", "echo", 30, AgentStats::Clock::now());
  AgentStats::request_started(r);
  StatsSnapshot s = stats.snapshot();
  EXPECT_EQ(s.worker, "w0");
  EXPECT_EQ(s.made_in_flight, 1);
  EXPECT_EQ(s.served_in_flight, 1);
  AgentStats::request_finished(r, absl::StatusCode::kUnknown, 40);
  AgentStats::call_finished(c, absl::StatusCode::kOk, 1);
  s = stats.snapshot();
  EXPECT_EQ(s.made_in_flight, 0);
  EXPECT_EQ(s.served_in_flight, 0);
  EXPECT_EQ(s.totals.made, 3u);
  EXPECT_EQ(s.totals.made_errors, 1u);
  EXPECT_EQ(s.totals.served, 1u);
  EXPECT_EQ(s.totals.served_errors, 1u);
  EXPECT_EQ(s.totals.bytes_out, 100u + 50 + 10 + 40);
  EXPECT_EQ(s.totals.bytes_in, 7u + 1 + 30);
  EXPECT_EQ(s.by_peer["w1"].made, 2u);
  EXPECT_EQ(s.by_peer["w2"].served, 1u);
  EXPECT_EQ(s.by_function["add"].made, 2u);
  EXPECT_EQ((s.by_peer_function[{"w1", "mul"}].made_errors), 1u);
  EXPECT_EQ(s.made_errors_by_code["DEADLINE_EXCEEDED"], 1u);
  EXPECT_EQ(s.served_errors_by_code["UNKNOWN"], 1u);
  EXPECT_EQ(s.made_latency.count, 3u);
  EXPECT_EQ(s.served_latency.count, 1u);
  EXPECT_EQ(s.queue_latency.count, 1u);
}

TEST(AgentStats, ThreadsRecordingAtOnceLoseNothing) {
  AgentStats stats("w0", /*time_one_in=*/1);
  constexpr int kThreads = 8;
  constexpr int kCalls = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) {
        AgentStats::Call call = stats.call_started(t % 2 ? "w1" : "w2", i % 3 ? "f" : "g", 1);
        AgentStats::call_finished(call, i % 10 ? absl::StatusCode::kOk : absl::StatusCode::kUnavailable, 2);
      }
    });
  }
  // Snapshots taken meanwhile never see more done than made.
  for (int i = 0; i < 20; ++i) EXPECT_GE(stats.snapshot().made_in_flight, 0);
  for (std::thread& t : threads) t.join();
  StatsSnapshot s = stats.snapshot();
  EXPECT_EQ(s.totals.made, uint64_t{kThreads} * kCalls);
  EXPECT_EQ(s.totals.made_errors, uint64_t{kThreads} * kCalls / 10);
  EXPECT_EQ(s.totals.bytes_in, uint64_t{kThreads} * kCalls * 2);
  EXPECT_EQ(s.made_latency.count, uint64_t{kThreads} * kCalls);
  uint64_t in_buckets = 0;
  for (uint64_t n : s.made_latency.buckets) in_buckets += n;
  EXPECT_EQ(in_buckets, s.made_latency.count);
  EXPECT_EQ(s.made_in_flight, 0);
}

TEST(AgentStats, MadeUpFunctionNamesCannotExhaustMemory) {
  AgentStats stats("w0");
  for (size_t i = 0; i < AgentStats::kMaxCells + 100; ++i) {
    AgentStats::request_finished(stats.request_received("w1", "f" + std::to_string(i), 1, AgentStats::Clock::now()),
                                 absl::StatusCode::kOk, 1);
  }
  StatsSnapshot s = stats.snapshot();
  EXPECT_EQ(s.totals.served, AgentStats::kMaxCells + 100);
  EXPECT_EQ(s.by_function["(other)"].served, 100u);
  EXPECT_EQ(s.by_function.size(), AgentStats::kMaxCells + 1);  // the names kept, and "(other)"
  // The "(other)" cell is the one every thread shares: its counts stay exact too.
  constexpr int kThreads = 4;
  constexpr int kCalls = 5000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) {
        AgentStats::call_finished(stats.call_started("w9", absl::StrCat("g", t, "-", i % 7), 1),
                                  absl::StatusCode::kOk, 1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  s = stats.snapshot();
  EXPECT_EQ(s.by_function["(other)"].made, uint64_t{kThreads} * kCalls);
  EXPECT_EQ(s.by_function["(other)"].bytes_in, 100u + uint64_t{kThreads} * kCalls);
  EXPECT_EQ(s.made_in_flight, 0);
}

TEST(AgentStats, TimesOneCallInNAndCountsEveryOne) {
  AgentStats stats("w0", /*time_one_in=*/4);
  // On a fresh thread: which calls are timed depends on the thread's earlier ones.
  std::thread([&] {
    for (int i = 0; i < 40; ++i) {
      AgentStats::call_finished(stats.call_started("w1", "f", 1), absl::StatusCode::kOk, 1);
      AgentStats::Request r = stats.request_received("w1", "g", 1, AgentStats::Clock::now());
      AgentStats::request_started(r);
      AgentStats::request_finished(r, absl::StatusCode::kOk, 1);
    }
  }).join();
  StatsSnapshot s = stats.snapshot();
  EXPECT_EQ(s.totals.made, 40u);
  EXPECT_EQ(s.totals.served, 40u);
  EXPECT_EQ(s.totals.bytes_out, 80u);
  EXPECT_EQ(s.made_in_flight, 0);
  EXPECT_EQ(s.served_in_flight, 0);
  // One in four of each, made and served apart.
  EXPECT_EQ(s.made_latency.count, 10u);
  EXPECT_EQ(s.served_latency.count, 10u);
  EXPECT_EQ(s.queue_latency.count, 10u);
  EXPECT_EQ(AgentStats(" ", 0).snapshot().made_latency.count, 0u) << "0 is taken as 1";
}

TEST(AgentStats, ACallFinishedOnAnotherThreadCountsThere) {
  // Replies are read on transport threads: the end of a call made on one thread is
  // recorded on another, whose cells it must not share with the caller's.
  AgentStats stats("w0", /*time_one_in=*/1);
  constexpr int kCalls = 20000;
  std::vector<AgentStats::Call> calls(kCalls);
  std::vector<AgentStats::Request> requests(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    calls[i] = stats.call_started("w1", "f", 3);
    requests[i] = stats.request_received("w1", "g", 5, AgentStats::Clock::now());
  }
  std::thread finisher([&] {
    for (int i = 0; i < kCalls; ++i) {
      AgentStats::call_finished(calls[i], i % 2 ? absl::StatusCode::kOk : absl::StatusCode::kUnavailable, 7);
      AgentStats::request_started(requests[i]);
      AgentStats::request_finished(requests[i], absl::StatusCode::kOk, 11);
    }
  });
  // Meanwhile: more calls on this thread to the same cells, and snapshots that never see
  // more done than made.
  for (int i = 0; i < kCalls; ++i) {
    AgentStats::call_finished(stats.call_started("w1", "f", 3), absl::StatusCode::kOk, 7);
    if (i % 1000 == 0) {
      StatsSnapshot s = stats.snapshot();
      EXPECT_GE(s.made_in_flight, 0);
      EXPECT_GE(s.served_in_flight, 0);
    }
  }
  finisher.join();
  StatsSnapshot s = stats.snapshot();
  EXPECT_EQ(s.totals.made, 2u * kCalls);
  EXPECT_EQ(s.totals.made_errors, uint64_t{kCalls} / 2);
  EXPECT_EQ(s.totals.served, uint64_t{kCalls});
  EXPECT_EQ(s.totals.bytes_out, 2u * kCalls * 3 + uint64_t{kCalls} * 11);
  EXPECT_EQ(s.totals.bytes_in, 2u * kCalls * 7 + uint64_t{kCalls} * 5);
  EXPECT_EQ(s.made_in_flight, 0);
  EXPECT_EQ(s.served_in_flight, 0);
  EXPECT_EQ(s.made_latency.count, 2u * kCalls);
  EXPECT_EQ(s.served_latency.count, uint64_t{kCalls});
  EXPECT_EQ((s.by_peer_function[{"w1", "f"}].made), 2u * kCalls);
  EXPECT_EQ(s.made_errors_by_code["UNAVAILABLE"], uint64_t{kCalls} / 2);
}

TEST(Prometheus, RoundTripsASnapshotAndEscapesLabels) {
  AgentStats stats("w\"0", /*time_one_in=*/1);
  AgentStats::call_finished(stats.call_started("w1", "a\\b\"c\nd", 10), absl::StatusCode::kOk, 5);
  AgentStats::call_finished(stats.call_started("w1", "add", 10), absl::StatusCode::kInternal, 0);
  AgentStats::Request r = stats.request_received("w2", "add", 3, AgentStats::Clock::now());
  AgentStats::request_started(r);
  AgentStats::request_finished(r, absl::StatusCode::kOk, 4);
  StatsSnapshot s = stats.snapshot();
  std::string text = to_prometheus(s);
  EXPECT_NE(text.find("# TYPE ferry_made_call_seconds histogram"), std::string::npos);
  EXPECT_NE(text.find("ferry_made_call_seconds_bucket{le=\"+Inf\"} 2"), std::string::npos) << text;
  absl::StatusOr<StatsSnapshot> back = from_prometheus(text);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->worker, "w\"0");
  EXPECT_EQ(back->totals.made, 2u);
  EXPECT_EQ(back->totals.made_errors, 1u);
  EXPECT_EQ(back->totals.served, 1u);
  EXPECT_EQ(back->totals.bytes_out, 24u);
  EXPECT_EQ(back->by_function["a\\b\"c\nd"].made, 1u);
  EXPECT_EQ(back->made_errors_by_code["INTERNAL"], 1u);
  EXPECT_EQ(back->made_latency.count, 2u);
  EXPECT_EQ(back->made_latency.buckets, s.made_latency.buckets);
  EXPECT_EQ(back->queue_latency.count, 1u);
  EXPECT_DOUBLE_EQ(back->made_latency.max, s.made_latency.max);
}

TEST(Prometheus, BadTextIsAnErrorNamingTheLine) {
  absl::StatusOr<std::vector<PrometheusSample>> bad = parse_prometheus("# ok\nfoo 1\nbar{x=\"1\" 2\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("line 3"), std::string::npos) << bad.status();
  EXPECT_FALSE(parse_prometheus("foo notanumber\n").ok());
  absl::StatusOr<std::vector<PrometheusSample>> good = parse_prometheus("a{b=\"c\",d=\"e\"} 1.5 12345\nz +Inf\n");
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_EQ(good->size(), 2u);
  EXPECT_EQ((*good)[0].labels.at("d"), "e");
  EXPECT_DOUBLE_EQ((*good)[0].value, 1.5);
}

}  // namespace
}  // namespace ferry
