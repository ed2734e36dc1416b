// Multi-process tests of ProcessGroup: every collective, reduce op and dtype on 2, 3
// and 4 real processes over loopback, point-to-point messages, sub-groups, gathered
// objects, CUDA staging (through HostBackedCudaRuntime), argument errors, and a rank
// that dies. Many checks share one multi-process body, since each fork and rendezvous
// costs more than the checks themselves.
#include "process_group/process_group.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cereal/types/map.hpp"
#include "cereal/types/string.hpp"
#include "cereal/types/vector.hpp"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "store/file_store.h"
#include "store/hash_store.h"
#include "tensor/host_backed_cuda.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::AnyOf;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Values;
using std::chrono::milliseconds;

constexpr milliseconds kTimeout{std::chrono::seconds(30)};
constexpr milliseconds kTestDeadline{std::chrono::seconds(100)};

constexpr DType kAllDTypes[] = {DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64, DType::kInt8,
                                DType::kInt16,   DType::kInt32,    DType::kInt64,   DType::kUInt8,   DType::kBool};
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax};

// Connects rank `rank` of `n` through a FileStore in `dir`, on loopback.
std::unique_ptr<ProcessGroup> connect(const std::string& dir, int rank, int n, milliseconds timeout = kTimeout) {
  setenv("FERRY_SOCKET_IFNAME", "lo", 1);
  FileStoreOptions options;
  options.timeout = timeout;
  absl::StatusOr<std::unique_ptr<FileStore>> store = FileStore::create(dir + "/store", options);
  EXPECT_OK(store.status());
  if (!store.ok()) return nullptr;
  absl::StatusOr<std::unique_ptr<ProcessGroup>> group =
      ProcessGroup::create(std::shared_ptr<Store>(*std::move(store)), rank, n, timeout);
  EXPECT_OK(group.status());
  if (!group.ok()) return nullptr;
  return *std::move(group);
}

// A 1-D tensor of `dtype` holding `values` (converted), on `device`.
Tensor make(DType dtype, const std::vector<double>& values, Device device = Device::cpu()) {
  Tensor t = *Tensor::empty({static_cast<int64_t>(values.size())}, dtype);
  visit_dtype(dtype, [&]<typename T>() {
    T* p = t.data_ptr<T>();
    for (size_t i = 0; i < values.size(); ++i) {
      if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
        p[i] = T(static_cast<float>(values[i]));
      } else if constexpr (std::is_same_v<T, bool>) {
        p[i] = values[i] != 0;
      } else {
        p[i] = static_cast<T>(values[i]);
      }
    }
  });
  if (device.is_cpu()) return t;
  return *t.to(device);
}

Tensor zeros_like(const Tensor& like, Device device = Device::cpu()) {
  return *Tensor::zeros(like.shape(), like.dtype(), device);
}

// The elements of any tensor as doubles.
std::vector<double> values(const Tensor& tensor) {
  Tensor t = *tensor.to(Device::cpu());
  std::vector<double> out(static_cast<size_t>(t.numel()));
  visit_dtype(t.dtype(), [&]<typename T>() {
    const T* p = t.data_ptr<T>();
    for (size_t i = 0; i < out.size(); ++i) {
      if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
        out[i] = static_cast<float>(p[i]);
      } else {
        out[i] = static_cast<double>(p[i]);
      }
    }
  });
  return out;
}

double apply(ReduceOp op, double a, double b) {
  switch (op) {
    case ReduceOp::kSum: return a + b;
    case ReduceOp::kProduct: return a * b;
    case ReduceOp::kMin: return std::min(a, b);
    case ReduceOp::kMax: return std::max(a, b);
  }
  return 0;
}

// ---- every collective, reduce op and dtype -------------------------------------------

void collectives_body(const std::string& dir, int rank, int n) {
  std::unique_ptr<ProcessGroup> group = connect(dir, rank, n);
  ASSERT_NE(group, nullptr);
  EXPECT_EQ(group->rank(), rank);
  EXPECT_EQ(group->world_size(), n);
  EXPECT_TRUE(group->is_member());
  constexpr int64_t kLen = 5;

  for (DType dtype : kAllDTypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const bool is_bool = dtype == DType::kBool;
    // Small values, exact in every dtype; products stay within int8.
    auto value = [&](int r, int64_t i) -> double { return is_bool ? (r + i) % 2 : (r + i) % 5 + 1; };
    auto row = [&](int r, int shift = 0) {
      std::vector<double> v(kLen);
      for (int64_t i = 0; i < kLen; ++i) v[i] = value(r + shift, i);
      return v;
    };

    {  // broadcast from the last rank
      Tensor t = make(dtype, row(rank));
      EXPECT_OK(group->broadcast(t, n - 1));
      EXPECT_EQ(values(t), row(n - 1));
    }

    for (ReduceOp op : kAllOps) {
      SCOPED_TRACE(reduce_op_name(op));
      if (is_bool && (op == ReduceOp::kSum || op == ReduceOp::kProduct)) {
        EXPECT_THAT(group->all_reduce(make(dtype, row(rank)), op),
                    StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not supported for dtype bool")));
        EXPECT_THAT(group->reduce(make(dtype, row(rank)), 0, op),
                    StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not supported for dtype bool")));
        continue;
      }
      auto contribution = [&](int r) {
        std::vector<double> v = row(r);
        if (op == ReduceOp::kProduct) {
          for (int64_t i = 0; i < kLen; ++i) v[i] = (r + i) % 2 + 1;
        }
        return v;
      };
      std::vector<double> expected = contribution(0);
      for (int r = 1; r < n; ++r) {
        std::vector<double> c = contribution(r);
        for (int64_t i = 0; i < kLen; ++i) expected[i] = apply(op, expected[i], c[i]);
      }
      Tensor t = make(dtype, contribution(rank));
      EXPECT_OK(group->all_reduce(t, op));
      EXPECT_EQ(values(t), expected);

      const int dst = 1 % n;
      Tensor u = make(dtype, contribution(rank));
      EXPECT_OK(group->reduce(u, dst, op));
      EXPECT_EQ(values(u), rank == dst ? expected : contribution(rank)) << "reduce to " << dst;
    }

    {  // all_gather into a list and into one tensor
      Tensor input = make(dtype, row(rank));
      std::vector<Tensor> outputs;
      for (int r = 0; r < n; ++r) outputs.push_back(zeros_like(input));
      EXPECT_OK(group->all_gather(outputs, input));
      std::vector<double> flat_expected;
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(values(outputs[r]), row(r)) << "all_gather output " << r;
        for (double v : row(r)) flat_expected.push_back(v);
      }
      Tensor flat = *Tensor::zeros({n, kLen}, dtype);
      EXPECT_OK(group->all_gather_into_tensor(flat, input));
      EXPECT_EQ(values(flat), flat_expected);
    }

    {  // gather to rank 0
      Tensor input = make(dtype, row(rank));
      std::vector<Tensor> list;
      if (rank == 0) {
        for (int r = 0; r < n; ++r) list.push_back(zeros_like(input));
      }
      EXPECT_OK(group->gather(input, list, 0));
      for (size_t r = 0; r < list.size(); ++r) EXPECT_EQ(values(list[r]), row(static_cast<int>(r)));
    }

    {  // scatter from the last rank
      Tensor output = make(dtype, std::vector<double>(kLen, 0));
      std::vector<Tensor> list;
      if (rank == n - 1) {
        for (int r = 0; r < n; ++r) list.push_back(make(dtype, row(r, 1)));
      }
      EXPECT_OK(group->scatter(output, list, n - 1));
      EXPECT_EQ(values(output), row(rank, 1));
    }
  }

  // Scalars and empty tensors go through every collective too.
  {
    Tensor scalar = *Tensor::from_values<int64_t>({rank + 1}, {});
    EXPECT_OK(group->all_reduce(scalar));
    EXPECT_EQ(*scalar.at<int64_t>({}), n * (n + 1) / 2);
    Tensor empty = *Tensor::empty({0, 3}, DType::kFloat32);
    EXPECT_OK(group->all_reduce(empty));
    EXPECT_OK(group->broadcast(empty, 0));
    std::vector<Tensor> outs(n, *Tensor::empty({0, 3}, DType::kFloat32));
    EXPECT_OK(group->all_gather(outs, empty));
  }

  // Asynchronous collectives queue in call order and complete in it.
  {
    std::vector<Tensor> tensors;
    std::vector<Work> works;
    for (int k = 0; k < 8; ++k) {
      tensors.push_back(make(DType::kInt32, {static_cast<double>(rank * k), 1}));
      works.push_back(group->all_reduce_async(tensors.back()));
    }
    works.push_back(group->barrier_async());
    for (Work& w : works) EXPECT_OK(w.wait());
    for (int k = 0; k < 8; ++k) {
      EXPECT_EQ(values(tensors[k]), (std::vector<double>{static_cast<double>(k * n * (n - 1) / 2), double(n)}));
    }
    EXPECT_TRUE(works.back().is_completed());
    EXPECT_EQ(works.back().name(), "barrier");
  }

  // A large tensor crosses Gloo's segment size (1 MiB) in several pieces.
  {
    std::vector<float> big(600 * 1024, 1.0f + rank);
    Tensor t = Tensor::from_vector(big);
    EXPECT_OK(group->all_reduce(t));
    EXPECT_EQ(*t.at<float>({12345}), n * (n + 1) / 2.0f);
  }
  EXPECT_OK(group->barrier());
}

class CollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesTest, EveryCollectiveReduceOpAndDtype) {
  ferry::testing::TempDir dir;
  const int n = GetParam();
  ferry::testing::expect_all_succeed(
      ferry::testing::run_processes(n, [&](int rank) { collectives_body(dir.path(), rank, n); }, kTestDeadline));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CollectivesTest, Values(2, 3, 4));

// ---- point-to-point ----------------------------------------------------------------

void p2p_body(const std::string& dir, int rank, int n) {
  std::unique_ptr<ProcessGroup> group = connect(dir, rank, n);
  ASSERT_NE(group, nullptr);

  // Blocking send/recv between ranks 0 and 1, in order for one tag.
  if (rank == 0) {
    EXPECT_OK(group->send(make(DType::kFloat32, {1, 2, 3}), 1));
    for (int k = 0; k < 3; ++k) EXPECT_OK(group->send(make(DType::kInt64, {10.0 + k}), 1, /*tag=*/5));
  } else if (rank == 1) {
    Tensor t = *Tensor::zeros({3}, DType::kFloat32);
    absl::StatusOr<int> from = group->recv(t, 0);
    ASSERT_OK(from.status());
    EXPECT_EQ(*from, 0);
    EXPECT_EQ(values(t), (std::vector<double>{1, 2, 3}));
    for (int k = 0; k < 3; ++k) {
      Tensor u = *Tensor::zeros({1}, DType::kInt64);
      EXPECT_OK(group->recv(u, 0, 5).status());
      EXPECT_EQ(values(u), std::vector<double>{10.0 + k}) << "messages of one tag arrive in order";
    }
  }

  // Receives from any rank report the sender.
  if (rank == 0) {
    std::set<int> senders;
    for (int k = 1; k < n; ++k) {
      Tensor t = *Tensor::zeros({2}, DType::kInt32);
      absl::StatusOr<int> from = group->recv(t, std::nullopt, 7);
      ASSERT_OK(from.status());
      EXPECT_EQ(values(t), (std::vector<double>{double(*from), double(*from) * 2}));
      senders.insert(*from);
    }
    EXPECT_EQ(senders.size(), static_cast<size_t>(n - 1));
    // And through irecv's Work.
    Tensor t = *Tensor::zeros({1}, DType::kInt32);
    Work w = group->irecv(t, std::nullopt, 8);
    EXPECT_OK(w.wait());
    EXPECT_EQ(w.source_rank(), std::optional<int>(n - 1));
    EXPECT_EQ(values(t), std::vector<double>{99});
  } else {
    EXPECT_OK(group->send(make(DType::kInt32, {double(rank), double(rank) * 2}), 0, 7));
    if (rank == n - 1) { EXPECT_OK(group->send(make(DType::kInt32, {99}), 0, 8)); }
  }

  // isend/irecv in both directions at once, every dtype around a ring: would deadlock
  // if point-to-point waits were serialized.
  for (DType dtype : kAllDTypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const int next = (rank + 1) % n;
    const int prev = (rank + n - 1) % n;
    Tensor in = make(dtype, {0, 0, 0, 0});
    Work r = group->irecv(in, prev, 11);
    Work s = group->isend(make(dtype, {1, double(rank % 2), 1, 0}), next, 11);
    EXPECT_OK(s.wait());
    EXPECT_OK(r.wait());
    EXPECT_EQ(r.source_rank(), std::optional<int>(prev));
    EXPECT_EQ(values(in), (std::vector<double>{1, double(prev % 2), 1, 0}));
  }

  // A receive whose tensor does not match fails, naming both, and consumes the message.
  if (rank == 0) {
    EXPECT_OK(group->send(make(DType::kFloat32, {1, 2, 3, 4}), 1, 3));
    EXPECT_OK(group->send(make(DType::kInt32, {5, 6, 7}), 1, 3));
    EXPECT_OK(group->send(make(DType::kFloat32, {8, 9, 10}), 1, 3));
    EXPECT_OK(group->send(*Tensor::empty({0}, DType::kUInt8), 1, 3));
  } else if (rank == 1) {
    Tensor t = *Tensor::zeros({3}, DType::kFloat32);
    EXPECT_THAT(group->recv(t, 0, 3),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         "recv: the tensor from rank 0 is float32 [4] but the receiving tensor is float32 [3]"));
    EXPECT_THAT(group->recv(t, 0, 3),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("the tensor from rank 0 is int32 [3] but the receiving tensor is float32 [3]")));
    EXPECT_OK(group->recv(t, 0, 3).status());
    EXPECT_EQ(values(t), (std::vector<double>{8, 9, 10}));
    EXPECT_OK(group->recv(*Tensor::empty({0}, DType::kUInt8), 0, 3).status());
  }

  // A pending receive is not complete until its message comes.
  if (rank == 1) {
    Tensor t = *Tensor::zeros({1}, DType::kInt32);
    Work w = group->irecv(t, 0, 9);
    EXPECT_FALSE(w.is_completed());
    EXPECT_THAT(w.wait(milliseconds(20)), StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("irecv")));
    EXPECT_OK(group->barrier());
    EXPECT_OK(w.wait());
    EXPECT_TRUE(w.is_completed());
    EXPECT_EQ(values(t), std::vector<double>{42});
  } else {
    EXPECT_OK(group->barrier());
    if (rank == 0) { EXPECT_OK(group->send(make(DType::kInt32, {42}), 1, 9)); }
  }

  // Argument errors.
  Tensor t = *Tensor::zeros({1}, DType::kInt32);
  EXPECT_THAT(group->send(t, rank), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("own rank")));
  EXPECT_THAT(group->send(t, n), StatusIs(absl::StatusCode::kInvalidArgument,
                                          absl::StrCat("send: dst ", n, " is out of range for a group of ", n,
                                                       " ranks")));
  EXPECT_THAT(group->recv(t, -1), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("src -1 is out of range")));
  EXPECT_THAT(group->isend(Tensor(), (rank + 1) % n).wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("undefined")));
  EXPECT_OK(group->barrier());
}

class PointToPointTest : public ::testing::TestWithParam<int> {};

TEST_P(PointToPointTest, SendRecvAnySourceOrderingAndMismatches) {
  ferry::testing::TempDir dir;
  const int n = GetParam();
  ferry::testing::expect_all_succeed(
      ferry::testing::run_processes(n, [&](int rank) { p2p_body(dir.path(), rank, n); }, kTestDeadline));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, PointToPointTest, Values(2, 3));

// ---- errors --------------------------------------------------------------------------

void errors_body(const std::string& dir, int rank, int n) {
  std::unique_ptr<ProcessGroup> group = connect(dir, rank, n);
  ASSERT_NE(group, nullptr);
  const auto kInvalid = absl::StatusCode::kInvalidArgument;

  // Mismatches across ranks: every rank fails with the same message.
  EXPECT_THAT(group->all_reduce(*Tensor::zeros({rank == 1 ? 4 : 3}, DType::kFloat32)),
              StatusIs(kInvalid, "all_reduce: tensor shape [4] on rank 1 differs from [3] on rank 0"));
  EXPECT_THAT(group->all_reduce(*Tensor::zeros({2, rank == 2 ? 5 : 3}, DType::kFloat32)),
              StatusIs(kInvalid, "all_reduce: tensor shape [2, 5] on rank 2 differs from [2, 3] on rank 0"));
  EXPECT_THAT(group->all_reduce(*Tensor::zeros({3}, rank == 2 ? DType::kInt32 : DType::kFloat32)),
              StatusIs(kInvalid, "all_reduce: tensor dtype int32 on rank 2 differs from float32 on rank 0"));
  EXPECT_THAT(group->broadcast(*Tensor::zeros({3}, DType::kFloat32), rank == 1 ? 1 : 0),
              StatusIs(kInvalid, "broadcast: src 1 on rank 1 differs from 0 on rank 0"));
  EXPECT_THAT(group->all_reduce(*Tensor::zeros({3}, DType::kFloat32), rank == 0 ? ReduceOp::kSum : ReduceOp::kMax),
              StatusIs(kInvalid, "all_reduce: reduce op max on rank 1 differs from sum on rank 0"));
  if (rank == 0) {
    EXPECT_THAT(group->barrier(), StatusIs(kInvalid, HasSubstr("collective mismatch: rank 1 called all_reduce while "
                                                               "rank 0 called barrier")));
  } else {
    EXPECT_THAT(group->all_reduce(*Tensor::zeros({3}, DType::kFloat32)),
                StatusIs(kInvalid, HasSubstr("collective mismatch: rank 1 called all_reduce while rank 0 called "
                                             "barrier")));
  }

  // Arguments one rank rejects: that rank gets its own message, the others one that
  // names it; nobody waits for a rank that never joined.
  Tensor x = *Tensor::zeros({2}, DType::kFloat32);
  {
    std::vector<Tensor> list;
    if (rank == 1) list = {x, x, x};
    absl::Status s = group->gather(x, list, 0);
    if (rank == 0) {
      EXPECT_THAT(s, StatusIs(kInvalid, "gather: gather_list is a required argument in gather destination"));
    } else if (rank == 1) {
      EXPECT_THAT(s, StatusIs(kInvalid, HasSubstr("gather: non-empty gather_list can be given only to gather "
                                                  "destination")));
    } else {
      EXPECT_THAT(s, StatusIs(kInvalid, HasSubstr("gather failed on rank 0: gather: gather_list is a required")));
    }
  }
  {
    absl::Status s = group->scatter(x, {}, 2);
    if (rank == 2) {
      EXPECT_THAT(s, StatusIs(kInvalid, "scatter: scatter_list is a required argument in scatter source"));
    } else {
      EXPECT_THAT(s, StatusIs(kInvalid, HasSubstr("scatter failed on rank 2: scatter: scatter_list is a required")));
    }
    std::vector<Tensor> list;
    if (rank == 0) list = {x, x};
    EXPECT_THAT(group->scatter(x, list, 0),
                StatusIs(kInvalid, HasSubstr("scatter_list has 2 tensors; expected one per rank (3)")));
  }
  EXPECT_THAT(group->broadcast(x, 7), StatusIs(kInvalid, "broadcast: src 7 is out of range for a group of 3 ranks"));
  EXPECT_THAT(group->reduce(x, -1), StatusIs(kInvalid, "reduce: dst -1 is out of range for a group of 3 ranks"));
  EXPECT_THAT(group->all_gather({x, x}, x),
              StatusIs(kInvalid, HasSubstr("outputs has 2 tensors; expected one per rank (3)")));
  EXPECT_THAT(group->all_gather({x, x, *Tensor::zeros({3}, DType::kFloat32)}, x),
              StatusIs(kInvalid, HasSubstr("outputs[2] is float32 [3]; expected float32 [2]")));
  EXPECT_THAT(group->all_gather_into_tensor(*Tensor::zeros({5}, DType::kFloat32), x),
              StatusIs(kInvalid, HasSubstr("expected float32 with 6")));
  EXPECT_THAT(group->all_reduce(rank == 2 ? Tensor() : x),
              StatusIs(kInvalid, HasSubstr(rank == 2 ? "all_reduce: the tensor is undefined"
                                                     : "all_reduce failed on rank 2: all_reduce: the tensor is "
                                                       "undefined")));

  // None of that broke the group.
  Tensor ones = make(DType::kInt32, {1, 1});
  EXPECT_OK(group->all_reduce(ones));
  EXPECT_EQ(values(ones), (std::vector<double>{3, 3}));

  // Waiting with a timeout leaves the operation running. The others join only when
  // rank 0 tells them to (a message, which does not wait behind the collective).
  if (rank == 0) {
    Tensor t = make(DType::kInt32, {1});
    Work w = group->all_reduce_async(t);
    EXPECT_THAT(w.wait(milliseconds(10)), StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("all_reduce")));
    EXPECT_FALSE(w.is_completed());
    for (int r = 1; r < n; ++r) EXPECT_OK(group->send(make(DType::kInt32, {0}), r, 77));
    EXPECT_OK(w.wait());
    EXPECT_EQ(values(t), std::vector<double>{3});
  } else {
    EXPECT_OK(group->recv(make(DType::kInt32, {0}), 0, 77).status());
    EXPECT_OK(group->all_reduce(make(DType::kInt32, {1})));
  }

  // A group of one rank (each process its own, over an in-memory store).
  {
    absl::StatusOr<std::unique_ptr<ProcessGroup>> solo =
        ProcessGroup::create(std::make_shared<HashStore>(), 0, 1, kTimeout);
    ASSERT_OK(solo.status());
    Tensor t = make(DType::kFloat32, {1, 2});
    EXPECT_OK((*solo)->all_reduce(t, ReduceOp::kProduct));
    EXPECT_OK((*solo)->broadcast(t, 0));
    EXPECT_OK((*solo)->reduce(t, 0));
    EXPECT_EQ(values(t), (std::vector<double>{1, 2}));
    std::vector<Tensor> outs = {zeros_like(t)};
    EXPECT_OK((*solo)->all_gather(outs, t));
    EXPECT_EQ(values(outs[0]), (std::vector<double>{1, 2}));
    EXPECT_OK((*solo)->gather(t, outs, 0));
    EXPECT_OK((*solo)->scatter(outs[0], {t}, 0));
    EXPECT_OK((*solo)->barrier());
    absl::StatusOr<std::vector<std::string>> names = (*solo)->all_gather_object(std::string("solo"));
    ASSERT_OK(names.status());
    EXPECT_EQ(*names, std::vector<std::string>{"solo"});
    EXPECT_THAT((*solo)->recv(t), StatusIs(kInvalid, HasSubstr("no other rank")));
  }

  // After shutdown, every operation says so.
  EXPECT_OK(group->barrier());
  group->shutdown();
  group->shutdown();
  const auto kShutDown = StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("was shut down"));
  EXPECT_THAT(group->all_reduce(x), kShutDown);
  EXPECT_THAT(group->barrier_async().wait(), kShutDown);
  EXPECT_THAT(group->isend(x, (rank + 1) % n).wait(), kShutDown);
  EXPECT_THAT(group->recv(x, (rank + 1) % n), kShutDown);
  EXPECT_THAT(group->all_gather_bytes(Bytes{1}), kShutDown);
  EXPECT_THAT(group->new_group({0}), kShutDown);
}

// Ranks whose collectives differ run their data on different Gloo tags; each rank
// then also stands in for every other signature (run_stand_in), so all of them finish
// and report the mismatch at once, for every kind of collective, and the group works on.
void mixed_mismatch_body(const std::string& dir, int rank, int n) {
  std::unique_ptr<ProcessGroup> group = connect(dir, rank, n);
  ASSERT_NE(group, nullptr);
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  // Four sizes at once: rank r reduces r + 1 elements.
  EXPECT_THAT(group->all_reduce(*Tensor::zeros({rank + 1}, DType::kFloat32)),
              StatusIs(kInvalid, "all_reduce: tensor shape [2] on rank 1 differs from [1] on rank 0"));
  // Four kinds at once, each moving data.
  Tensor x = *Tensor::zeros({3}, DType::kInt64);
  absl::Status s;
  switch (rank) {
    case 0: s = group->broadcast(x, 1); break;
    case 1: s = group->reduce(x, 2, ReduceOp::kMax); break;
    case 2: s = group->all_gather({x, x, x, x}, x); break;
    default: {
      std::vector<Tensor> parts = {x, x, x, x};
      s = group->scatter(x, parts, 3);
      break;
    }
  }
  EXPECT_THAT(s, StatusIs(kInvalid, "collective mismatch: rank 1 called reduce while rank 0 called broadcast "
                                    "(every rank must call the same collectives in the same order)"));
  // Gather on rank 3 and a barrier elsewhere: only one signature moves data.
  if (rank == 3) {
    s = group->gather(x, {}, 0);
  } else {
    s = group->barrier();
  }
  EXPECT_THAT(s, StatusIs(kInvalid, HasSubstr("collective mismatch: rank 3 called gather while rank 0 called "
                                              "barrier")));
  // None of that broke the group, nor left anything behind on its tags.
  for (int i = 0; i < 3; ++i) {
    Tensor ones = make(DType::kInt32, {1, 2});
    EXPECT_OK(group->all_reduce(ones));
    EXPECT_EQ(values(ones), (std::vector<double>{4, 8}));
  }
  EXPECT_OK(group->barrier());
}

// Once every rank agreed on a collective's arguments, a repeat of them runs its data
// at once, before the headers are checked (Impl::run). A rank whose arguments then
// change must still fail every rank at once, with the message of a first-call mismatch;
// it takes part in the others' operation so that none of them is left waiting, and the
// group works on. Sync and async calls, on 3 ranks.
void cached_check_body(const std::string& dir, int rank, int n) {
  std::unique_ptr<ProcessGroup> group = connect(dir, rank, n);
  ASSERT_NE(group, nullptr);
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  // Sums of [1, 2] over the ranks; twice, so the second call goes ahead.
  auto agree = [&] {
    for (int i = 0; i < 2; ++i) {
      Tensor t = make(DType::kFloat32, {1, 2});
      ASSERT_OK(group->all_reduce(t));
      EXPECT_EQ(values(t), (std::vector<double>{1.0 * n, 2.0 * n}));
    }
  };
  // One rank changes its shape; the others repeat theirs.
  agree();
  Tensor x = *Tensor::zeros({rank == 1 ? 3 : 2}, DType::kFloat32);
  EXPECT_THAT(group->all_reduce(x),
              StatusIs(kInvalid, "all_reduce: tensor shape [3] on rank 1 differs from [2] on rank 0"));
  // One rank repeats; two change, each to a shape of its own.
  agree();
  x = *Tensor::zeros({rank + 2}, DType::kFloat32);
  EXPECT_THAT(group->all_reduce(x),
              StatusIs(kInvalid, "all_reduce: tensor shape [3] on rank 1 differs from [2] on rank 0"));
  // Another collective on one rank.
  agree();
  x = make(DType::kFloat32, {1, 2});
  absl::Status s = rank == 2 ? group->broadcast(x, 0) : group->all_reduce(x);
  EXPECT_THAT(s, StatusIs(kInvalid, "collective mismatch: rank 2 called broadcast while rank 0 called all_reduce "
                                    "(every rank must call the same collectives in the same order)"));
  // Another reduce op on one rank.
  agree();
  x = make(DType::kFloat32, {1, 2});
  EXPECT_THAT(group->all_reduce(x, rank == 0 ? ReduceOp::kMax : ReduceOp::kSum),
              StatusIs(kInvalid, HasSubstr("reduce op sum on rank 1 differs from max on rank 0")));
  // A rank whose own arguments are rejected, while the others repeat theirs.
  agree();
  x = make(DType::kFloat32, {1, 2});
  EXPECT_THAT(group->all_reduce(rank == 0 ? Tensor() : x),
              StatusIs(kInvalid, rank == 0 ? HasSubstr("the tensor is undefined") : HasSubstr("failed on rank 0")));
  // Queued (async) calls: two repeats, then a change on one rank.
  agree();
  std::vector<Tensor> ts = {make(DType::kFloat32, {1, 2}), make(DType::kFloat32, {1, 2}),
                            *Tensor::zeros({rank == 2 ? 5 : 2}, DType::kFloat32)};
  std::vector<Work> works;
  for (const Tensor& t : ts) works.push_back(group->all_reduce_async(t));
  EXPECT_OK(works[0].wait());
  EXPECT_OK(works[1].wait());
  EXPECT_THAT(works[2].wait(), StatusIs(kInvalid, "all_reduce: tensor shape [5] on rank 2 differs from [2] on rank 0"));
  EXPECT_EQ(values(ts[1]), (std::vector<double>{1.0 * n, 2.0 * n}));
  // All ranks change together: no mismatch, right values; the group works on.
  for (int64_t size : {2, 4, 4, 1}) {
    Tensor t = *Tensor::zeros({size}, DType::kInt64);
    for (int64_t i = 0; i < size; ++i) t.data_ptr<int64_t>()[i] = i + rank;
    ASSERT_OK(group->all_reduce(t));
    for (int64_t i = 0; i < size; ++i) EXPECT_EQ(t.data_ptr<int64_t>()[i], n * i + n * (n - 1) / 2);
  }
  EXPECT_OK(group->barrier());
}

TEST(ProcessGroupErrorsTest, ACachedCheckStillCatchesArgumentsThatChangeOnSomeRanks) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(
      ferry::testing::run_processes(3, [&](int rank) { cached_check_body(dir.path(), rank, 3); }, kTestDeadline));
}

TEST(ProcessGroupErrorsTest, MismatchesOfEveryKindFailEveryRankAtOnce) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(
      ferry::testing::run_processes(4, [&](int rank) { mixed_mismatch_body(dir.path(), rank, 4); }, kTestDeadline));
}

// A rank that never enters a collective: the others fail after the group's timeout,
// saying what they waited for, and the group is broken from then on.
TEST(ProcessGroupErrorsTest, ACollectiveSomeRankNeverCallsTimesOut) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    std::unique_ptr<ProcessGroup> group = connect(dir.path(), rank, 2, milliseconds(1500));
    ASSERT_NE(group, nullptr);
    std::shared_ptr<Store> store = *FileStore::create(dir.path() + "/flags");
    if (rank == 1) {
      ASSERT_OK(store->wait({"done"}, std::chrono::seconds(60)));
      return;
    }
    EXPECT_THAT(group->barrier(),
                StatusIs(absl::StatusCode::kDeadlineExceeded,
                         HasSubstr("barrier (rank 0 of 2): timed out after 1500 ms waiting for every rank's arguments "
                                   "(has every rank called it?)")));
    EXPECT_THAT(group->all_reduce(make(DType::kFloat32, {1})),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is broken by an earlier error")));
    ASSERT_OK(store->set("done", Bytes{1}));
  }, kTestDeadline));
}

TEST(ProcessGroupErrorsTest, MismatchesArgumentsAndShutdown) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(
      ferry::testing::run_processes(3, [&](int rank) { errors_body(dir.path(), rank, 3); }, kTestDeadline));
}

// Errors found before any connection: no process, thread or store traffic needed.
TEST(ProcessGroupCreateTest, RejectsBadArgumentsAndInterfaces) {
  auto store = std::make_shared<HashStore>();
  EXPECT_THAT(ProcessGroup::create(nullptr, 0, 1), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
  EXPECT_THAT(ProcessGroup::create(store, 2, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, "process group: rank 2 is out of range for world size 2"));
  EXPECT_THAT(ProcessGroup::create(store, -1, 2), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank -1")));
  EXPECT_THAT(ProcessGroup::create(store, 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("world size 0 must be at least 1")));
  EXPECT_THAT(ProcessGroup::create(store, 0, 1, milliseconds(0)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be positive")));
  ProcessGroupOptions options;
  options.interface = "ferry-nosuch0";
  EXPECT_THAT(ProcessGroup::create(store, 0, 1, kTimeout, options),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("network interface \"ferry-nosuch0\" "
                                                              "(ProcessGroupOptions::interface) does not exist")));
  setenv("FERRY_SOCKET_IFNAME", "ferry-nosuch1", 1);
  EXPECT_THAT(ProcessGroup::create(store, 0, 1),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"ferry-nosuch1\" (FERRY_SOCKET_IFNAME) does not exist; "
                                                              "interfaces on this host: ")));
  unsetenv("FERRY_SOCKET_IFNAME");
}

// A rank given another world size fails at once with a clear message; the rank left
// waiting fails at the timeout, as do two processes given the same rank.
TEST(ProcessGroupCreateTest, WorldSizeMismatchAndDuplicateRank) {
  for (bool duplicate : {false, true}) {
    SCOPED_TRACE(duplicate ? "duplicate rank" : "world size mismatch");
    ferry::testing::TempDir dir;
    ferry::testing::expect_all_succeed(ferry::testing::run_processes(
        2,
        [&](int rank) {
          setenv("FERRY_SOCKET_IFNAME", "lo", 1);
          std::shared_ptr<Store> store = *FileStore::create(dir.path() + "/store");
          // Usually rank 1 arrives second and fails at once while rank 0 waits; under
          // load the order may flip, and then the roles do.
          if (rank == 1) std::this_thread::sleep_for(milliseconds(300));
          absl::StatusOr<std::unique_ptr<ProcessGroup>> group =
              duplicate ? ProcessGroup::create(store, 0, 2, milliseconds(1500))
                        : ProcessGroup::create(store, rank, rank == 1 ? 3 : 2, milliseconds(1500));
          const auto timed_out = StatusIs(absl::StatusCode::kDeadlineExceeded,
                                          HasSubstr("(is every rank of 0..1 running, each with its own rank, the "
                                                    "same world size and the same store?)"));
          if (duplicate) {
            EXPECT_THAT(group, timed_out);
          } else {
            EXPECT_THAT(group, AnyOf(timed_out, StatusIs(absl::StatusCode::kInvalidArgument,
                                                         ::testing::ContainsRegex(
                                                             "^process group: world size [23] on rank [01] differs "
                                                             "from [23] given by the first rank to arrive$"))));
          }
        },
        kTestDeadline));
  }
}

// ---- sub-groups ----------------------------------------------------------------------

void subgroups_body(const std::string& dir, int rank, int n) {
  std::unique_ptr<ProcessGroup> group = connect(dir, rank, n);
  ASSERT_NE(group, nullptr);
  const auto kInvalid = absl::StatusCode::kInvalidArgument;

  absl::StatusOr<std::unique_ptr<ProcessGroup>> even = group->new_group({0, 2});
  ASSERT_OK(even.status());
  absl::StatusOr<std::unique_ptr<ProcessGroup>> backwards = group->new_group({3, 1, 0});
  ASSERT_OK(backwards.status());

  if (rank == 0 || rank == 2) {
    ProcessGroup& g = **even;
    EXPECT_TRUE(g.is_member());
    EXPECT_EQ(g.rank(), rank / 2);
    EXPECT_EQ(g.world_size(), 2);
    EXPECT_EQ(g.ranks(), (std::vector<int>{0, 2}));
    Tensor t = make(DType::kInt32, {double(rank), 1});
    EXPECT_OK(g.all_reduce(t));
    EXPECT_EQ(values(t), (std::vector<double>{2, 2}));
    // A sub-group of a sub-group: only global rank 2 (group rank 1) is in it.
    absl::StatusOr<std::unique_ptr<ProcessGroup>> inner = g.new_group({1});
    ASSERT_OK(inner.status());
    EXPECT_EQ((*inner)->is_member(), rank == 2);
    EXPECT_EQ((*inner)->ranks(), std::vector<int>{2});
    if (rank == 2) {
      EXPECT_OK((*inner)->all_reduce(t));
    } else {
      EXPECT_THAT((*inner)->all_reduce(t), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a member")));
    }
  } else {
    ProcessGroup& g = **even;
    EXPECT_FALSE(g.is_member());
    EXPECT_EQ(g.rank(), -1);
    const auto kNotMember = StatusIs(absl::StatusCode::kFailedPrecondition,
                                     HasSubstr("this process is not a member of the group [0, 2]"));
    Tensor t = make(DType::kInt32, {1});
    EXPECT_THAT(g.all_reduce(t), kNotMember);
    EXPECT_THAT(g.barrier(), kNotMember);
    EXPECT_THAT(g.send(t, 0), kNotMember);
    EXPECT_THAT(g.recv(t, 0), kNotMember);
    EXPECT_THAT(g.irecv(t).wait(), kNotMember);
    EXPECT_THAT(g.all_gather_bytes({}), kNotMember);
    EXPECT_THAT(g.new_group({0}), kNotMember);
  }

  if (rank != 2) {
    ProcessGroup& h = **backwards;
    const int expected_rank = rank == 3 ? 0 : rank == 1 ? 1 : 2;
    EXPECT_EQ(h.rank(), expected_rank);
    Tensor t = make(DType::kFloat64, {rank == 3 ? 33.0 : 0.0});
    EXPECT_OK(h.broadcast(t, 0));
    EXPECT_EQ(values(t), std::vector<double>{33});
    // Point-to-point in group ranks: group rank 0 (global 3) to group rank 2 (global 0).
    if (expected_rank == 0) { EXPECT_OK(h.send(make(DType::kInt8, {7}), 2)); }
    if (expected_rank == 2) {
      Tensor u = make(DType::kInt8, {0});
      absl::StatusOr<int> from = h.recv(u);
      ASSERT_OK(from.status());
      EXPECT_EQ(*from, 0);
      EXPECT_EQ(values(u), std::vector<double>{7});
    }
  }

  // Mismatched or invalid lists fail on every rank alike.
  EXPECT_THAT(group->new_group(rank == 3 ? std::vector<int>{0, 1} : std::vector<int>{0, 2}),
              StatusIs(kInvalid, "new_group: ranks [0, 1] on rank 3 differ from [0, 2] on rank 0"));
  EXPECT_THAT(group->new_group({0, 0}), StatusIs(kInvalid, HasSubstr("rank 0 appears twice in [0, 0]")));
  EXPECT_THAT(group->new_group({1, 4}),
              StatusIs(kInvalid, HasSubstr("rank 4 in [1, 4] is out of range for a group of 4 ranks")));
  EXPECT_THAT(group->new_group({}), StatusIs(kInvalid, HasSubstr("empty")));

  // The parent still works, and so do the sub-groups made before the failures.
  Tensor t = make(DType::kInt32, {1});
  EXPECT_OK(group->all_reduce(t));
  EXPECT_EQ(values(t), std::vector<double>{4});
  if ((*even)->is_member()) { EXPECT_OK((*even)->barrier()); }
  EXPECT_OK(group->barrier());
}

TEST(ProcessGroupSubGroupTest, MembersNonMembersAndMismatches) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(
      ferry::testing::run_processes(4, [&](int rank) { subgroups_body(dir.path(), rank, 4); }, kTestDeadline));
}

// ---- gathered bytes and objects ------------------------------------------------------

struct WorkerInfo {
  std::string name;
  int32_t device_count = 0;
  std::map<std::string, std::vector<int>> device_maps;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(name, device_count, device_maps);
  }
  friend bool operator==(const WorkerInfo&, const WorkerInfo&) = default;
};

// Writes nothing when `write` is false, so the reader runs out of bytes.
struct MaybeWritten {
  bool write = true;
  int64_t value = 0;

  template <class Archive>
  void save(Archive& ar) const {
    if (write) ar(value);
  }
  template <class Archive>
  void load(Archive& ar) {
    ar(value);
  }
};

// Claims 2^60 strings in a few bytes: decoding must refuse it before allocating.
struct HostileCount {
  std::vector<std::string> values;
  template <class Archive>
  void save(Archive& ar) const {
    ar(uint64_t{1} << 60);
  }
  template <class Archive>
  void load(Archive& ar) {
    ar(values);
  }
};

WorkerInfo info_of(int rank) {
  WorkerInfo info{"worker" + std::to_string(rank), rank, {}};
  for (int k = 0; k < rank; ++k) info.device_maps["worker" + std::to_string(k)] = std::vector<int>(rank, k);
  return info;
}

void objects_body(const std::string& dir, int rank, int n) {
  std::unique_ptr<ProcessGroup> group = connect(dir, rank, n);
  ASSERT_NE(group, nullptr);

  // Sizes differ by rank, rank 0's is empty, one is larger than Gloo's segments.
  auto payload = [](int r) {
    Bytes b(r == 1 ? (1 << 20) + 3 : static_cast<size_t>(r) * 5);
    for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(i * 7 + r);
    return b;
  };
  absl::StatusOr<std::vector<Bytes>> all = group->all_gather_bytes(payload(rank));
  ASSERT_OK(all.status());
  ASSERT_EQ(all->size(), static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) EXPECT_EQ((*all)[r], payload(r)) << "bytes of rank " << r;

  absl::StatusOr<std::vector<Bytes>> empties = group->all_gather_bytes({});
  ASSERT_OK(empties.status());
  EXPECT_EQ(*empties, std::vector<Bytes>(n));

  absl::StatusOr<std::vector<std::string>> names = group->all_gather_object(std::string(rank * 3, 'a' + rank));
  ASSERT_OK(names.status());
  for (int r = 0; r < n; ++r) EXPECT_EQ((*names)[r], std::string(r * 3, 'a' + r));

  absl::StatusOr<std::vector<WorkerInfo>> infos = group->all_gather_object(info_of(rank));
  ASSERT_OK(infos.status());
  for (int r = 0; r < n; ++r) EXPECT_EQ((*infos)[r], info_of(r));

  // Bytes that are not a T fail to deserialize, naming the rank they came from.
  absl::StatusOr<std::vector<MaybeWritten>> broken = group->all_gather_object(MaybeWritten{rank != 2, rank});
  EXPECT_THAT(broken, StatusIs(absl::StatusCode::kDataLoss,
                               HasSubstr("all_gather_object: the 0 bytes from rank 2 do not deserialize")));
  absl::StatusOr<std::vector<HostileCount>> hostile = group->all_gather_object(HostileCount{});
  EXPECT_THAT(hostile, StatusIs(absl::StatusCode::kDataLoss,
                                AllOf(HasSubstr("the 8 bytes from rank 0"), HasSubstr("declares 1152921504606846976"))));
  EXPECT_OK(group->barrier());
}

// A small broadcast's or all_gather's data rides in the header messages; larger ones go
// through Gloo. Sizes on both sides of the boundary (16 KiB), in a row, from every
// root: the ring of header slots is reused with messages of other lengths, and int64
// counters are the data most likely to look like a stale trailer.
TEST(ProcessGroupInlineTest, CollectivesOnBothSidesOfTheInlineSizeDeliverEveryRanksBytes) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(
      3,
      [&](int rank) {
        std::unique_ptr<ProcessGroup> group = connect(dir.path(), rank, 3);
        ASSERT_NE(group, nullptr);
        auto counters = [](int owner, int64_t n) {
          Tensor t = *Tensor::empty({n}, DType::kInt64);
          for (int64_t i = 0; i < n; ++i) t.data_ptr<int64_t>()[i] = owner * 100000 + i;
          return t;
        };
        auto expect_counters = [](const Tensor& t, int owner, int64_t offset, int64_t n) {
          for (int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(t.data_ptr<int64_t>()[offset + i], owner * 100000 + i) << "size " << n << ", element " << i;
          }
        };
        const int64_t sizes[] = {1, 2047, 2048, 2049, 1, 60000, 3, 2048, 9};  // int64 elements
        for (int round = 0; round < 2; ++round) {
          for (size_t k = 0; k < std::size(sizes); ++k) {
            const int64_t n = sizes[k];
            const int root = static_cast<int>((k + round) % 3);
            Tensor t = counters(rank, n);
            ASSERT_OK(group->broadcast(t, root)) << "size " << n << ", root " << root;
            expect_counters(t, root, 0, n);

            std::vector<Tensor> outputs;
            for (int r = 0; r < 3; ++r) outputs.push_back(*Tensor::zeros({n}, DType::kInt64));
            ASSERT_OK(group->all_gather(outputs, counters(rank, n))) << "size " << n;
            for (int r = 0; r < 3; ++r) expect_counters(outputs[r], r, 0, n);

            Tensor flat = *Tensor::zeros({3 * n}, DType::kInt64);
            ASSERT_OK(group->all_gather_into_tensor(flat, counters(rank, n))) << "size " << n;
            for (int r = 0; r < 3; ++r) expect_counters(flat, r, r * n, n);
          }
        }
        // A mismatched size on one rank, across the boundary, still fails every rank.
        Tensor t = *Tensor::zeros({rank == 1 ? 2049 : 2048}, DType::kInt64);
        EXPECT_THAT(group->broadcast(t, 0), StatusIs(absl::StatusCode::kInvalidArgument,
                                                     HasSubstr("tensor shape [2049] on rank 1 differs from [2048]")));
        std::vector<Tensor> outputs;
        for (int r = 0; r < 3; ++r) outputs.push_back(*Tensor::zeros({rank == 2 ? 2049 : 2048}, DType::kInt64));
        EXPECT_THAT(group->all_gather(outputs, *Tensor::zeros({rank == 2 ? 2049 : 2048}, DType::kInt64)),
                    StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("[2049] on rank 2 differs from [2048]")));
        ASSERT_OK(group->barrier());
      },
      kTestDeadline));
}

TEST(ProcessGroupObjectsTest, AllGatherBytesAndObjectsOfDifferentSizes) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(
      ferry::testing::run_processes(3, [&](int rank) { objects_body(dir.path(), rank, 3); }, kTestDeadline));
}

// ---- CUDA tensors, staged through host memory ------------------------------------------

void cuda_body(const std::string& dir, int rank, int n) {
  set_cuda_runtime(std::make_shared<HostBackedCudaRuntime>(2));
  std::unique_ptr<ProcessGroup> group = connect(dir, rank, n);
  ASSERT_NE(group, nullptr);
  const Device mine = Device::cuda(rank % 2);
  const Device other = Device::cuda((rank + 1) % 2);

  Tensor t = make(DType::kFloat32, {double(rank), 1}, mine);
  EXPECT_OK(group->all_reduce(t));
  EXPECT_EQ(t.device(), mine);
  EXPECT_EQ(values(t), (std::vector<double>{1, 2}));

  Tensor b = make(DType::kInt64, {double(rank + 5)}, mine);
  EXPECT_OK(group->broadcast(b, 1));
  EXPECT_EQ(values(b), std::vector<double>{6});

  Tensor r = make(DType::kFloat16, {double(rank + 1)}, other);
  EXPECT_OK(group->reduce(r, 0, ReduceOp::kMax));
  EXPECT_EQ(values(r), std::vector<double>{2});  // the result on rank 0; rank 1's own 2 elsewhere

  // Outputs on mixed devices.
  std::vector<Tensor> outputs = {*Tensor::zeros({1}, DType::kInt32, other), *Tensor::zeros({1}, DType::kInt32)};
  EXPECT_OK(group->all_gather(outputs, make(DType::kInt32, {double(rank * 10)}, mine)));
  EXPECT_EQ(values(outputs[0]), std::vector<double>{0});
  EXPECT_EQ(values(outputs[1]), std::vector<double>{10});
  EXPECT_EQ(outputs[0].device(), other);

  Tensor flat = *Tensor::zeros({2}, DType::kInt32, mine);
  EXPECT_OK(group->all_gather_into_tensor(flat, make(DType::kInt32, {double(rank + 1)}, other)));
  EXPECT_EQ(values(flat), (std::vector<double>{1, 2}));

  std::vector<Tensor> gathered;
  if (rank == 0) gathered = {*Tensor::zeros({1}, DType::kInt32, mine), *Tensor::zeros({1}, DType::kInt32, other)};
  EXPECT_OK(group->gather(make(DType::kInt32, {double(rank + 3)}, mine), gathered, 0));
  if (rank == 0) {
    EXPECT_EQ(values(gathered[0]), std::vector<double>{3});
    EXPECT_EQ(values(gathered[1]), std::vector<double>{4});
  }

  Tensor scattered = *Tensor::zeros({1}, DType::kInt32, other);
  std::vector<Tensor> list;
  if (rank == 1) list = {make(DType::kInt32, {8}, mine), make(DType::kInt32, {9}, other)};
  EXPECT_OK(group->scatter(scattered, list, 1));
  EXPECT_EQ(values(scattered), std::vector<double>{8.0 + rank});

  if (rank == 0) {
    EXPECT_OK(group->send(make(DType::kBFloat16, {1.5, -2}, mine), 1));
  } else {
    Tensor in = *Tensor::zeros({2}, DType::kBFloat16, mine);
    Work w = group->irecv(in, 0);
    EXPECT_OK(w.wait());
    EXPECT_EQ(in.device(), mine);
    EXPECT_EQ(values(in), (std::vector<double>{1.5, -2}));
  }
  EXPECT_OK(group->barrier());
}

TEST(ProcessGroupCudaTest, CudaTensorsAreStagedThroughHost) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(
      ferry::testing::run_processes(2, [&](int rank) { cuda_body(dir.path(), rank, 2); }, kTestDeadline));
}

// ---- a rank that dies ------------------------------------------------------------------

// A header that arrived before its sender exited still counts: Gloo reports the end of
// the connection even over a message already in, and a rank that looks late must not
// lose it. Rank 2 enters the barrier and exits before rank 0 comes; rank 1, which met
// rank 2 there, completes it. Rank 0 can no longer deliver its own header to rank 2
// once that connection's end has reached it, and then fails at once.
TEST(ProcessGroupFailureTest, AHeaderThatArrivedBeforeItsSenderExitedStillCounts) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(
      3,
      [&](int rank) {
        std::unique_ptr<ProcessGroup> group = connect(dir.path(), rank, 3, milliseconds(5000));
        ASSERT_NE(group, nullptr);
        if (rank == 2) {
          Work pending = group->barrier_async();
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          _exit(0);
        }
        if (rank == 1) {
          EXPECT_OK(group->barrier());
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(800));
        const auto start = std::chrono::steady_clock::now();
        absl::Status s = group->barrier();
        if (!s.ok()) {
          EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("barrier (rank 0 of 3)")));
        }
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
      },
      kTestDeadline));
}

TEST(ProcessGroupFailureTest, DeadRankFailsOthersWithinTimeout) {
  constexpr milliseconds kShort{2000};
  ferry::testing::TempDir dir;
  std::vector<ferry::testing::ProcessResult> results = ferry::testing::run_processes(
      3,
      [&](int rank) {
        std::unique_ptr<ProcessGroup> group = connect(dir.path(), rank, 3, kShort);
        ASSERT_NE(group, nullptr);
        ASSERT_OK(group->barrier());
        if (rank == 2) raise(SIGKILL);
        // Rank 2 is gone before the collective: it must fail, not hang.
        const auto start = std::chrono::steady_clock::now();
        absl::Status s = group->all_reduce(make(DType::kFloat32, {1, 2, 3}));
        const auto elapsed = std::chrono::steady_clock::now() - start;
        EXPECT_THAT(s.code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded)) << s;
        EXPECT_THAT(std::string(s.message()), HasSubstr("all_reduce (rank "));
        EXPECT_LT(elapsed, kShort + std::chrono::seconds(3));
        // The group is broken now: later operations fail at once, with the cause.
        const auto later = std::chrono::steady_clock::now();
        EXPECT_THAT(group->barrier(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                               HasSubstr("is broken by an earlier error")));
        EXPECT_THAT(group->recv(make(DType::kFloat32, {0}), 2),
                    StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("broken")));
        EXPECT_LT(std::chrono::steady_clock::now() - later, std::chrono::seconds(1));
      },
      kTestDeadline);
  ASSERT_EQ(results.size(), 3u);
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(results[r].exited && results[r].exit_code == 0) << results[r].describe();
  EXPECT_EQ(results[2].term_signal, SIGKILL) << results[2].describe();

  // A peer that exits while another waits for its message.
  ferry::testing::TempDir dir2;
  results = ferry::testing::run_processes(
      2,
      [&](int rank) {
        std::unique_ptr<ProcessGroup> group = connect(dir2.path(), rank, 2, kShort);
        ASSERT_NE(group, nullptr);
        ASSERT_OK(group->barrier());
        if (rank == 1) _exit(0);
        const auto start = std::chrono::steady_clock::now();
        absl::StatusOr<int> from = group->recv(make(DType::kFloat32, {0}), 1);
        EXPECT_THAT(from.status().code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded))
            << from.status();
        EXPECT_LT(std::chrono::steady_clock::now() - start, kShort + std::chrono::seconds(3));
      },
      kTestDeadline);
  ferry::testing::expect_all_succeed(results);
}

}  // namespace
}  // namespace ferry
