// at::Tensor as a wire type: in a message (no copy on either side for out-of-band
// tensors), and in real calls between two worker processes on 127.0.0.1.
#include "torch/wire.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>

#include <chrono>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

TEST(TorchWire, OutOfBandTensorsAreNotCopiedOnEitherSide) {
  at::Tensor big = at::arange(64 * 1024, at::kFloat);  // 256 KiB: out of band
  Message m(MessageType::kRequest, 1);
  {
    PayloadWriter w(m);
    w(big);
  }
  ASSERT_EQ(m.tensors().size(), 1u);
  EXPECT_EQ(m.tensors()[0].data(), big.data_ptr()) << "the message sends the at::Tensor's own memory";

  FERRY_ASSERT_OK_AND_ASSIGN(auto values, read_payload<at::Tensor>(m));
  const at::Tensor& received = std::get<0>(values);
  EXPECT_EQ(received.data_ptr(), m.tensors()[0].data()) << "the receiver wraps the buffer the message holds";
  EXPECT_TRUE(received.equal(big));
}

TEST(TorchWire, SmallTensorsTravelInlineAndUndefinedOnesStayUndefined) {
  at::Tensor small = at::tensor({1.5, -2.0, 3.25}, at::kDouble);
  at::Tensor mask = at::tensor({1, 0, 1}).to(at::kBool);
  Message m(MessageType::kRequest, 1);
  {
    PayloadWriter w(m);
    w(small, at::Tensor(), mask);
  }
  EXPECT_TRUE(m.tensors().empty());
  FERRY_ASSERT_OK_AND_ASSIGN(auto values, (read_payload<at::Tensor, at::Tensor, at::Tensor>(m)));
  EXPECT_TRUE(std::get<0>(values).equal(small));
  EXPECT_FALSE(std::get<1>(values).defined());
  EXPECT_EQ(std::get<2>(values).scalar_type(), at::kBool);
  EXPECT_TRUE(std::get<2>(values).equal(mask));
}

TEST(TorchWire, SameSignatureAsFerryTensor) {
  EXPECT_EQ((signature<at::Tensor, std::vector<at::Tensor>>()), "(Tensor, vector<Tensor>)");
  EXPECT_EQ((signature<at::Tensor, std::vector<at::Tensor>>()), (signature<Tensor, std::vector<Tensor>>()));
}

TEST(TorchWire, ARefusedTensorIsAnErrorNotACopy) {
  at::Tensor transposed = at::ones({3, 2}).t();
  Message m(MessageType::kRequest, 1);
  PayloadWriter w(m);
  try {
    w(transposed);
    ADD_FAILURE() << "a non-contiguous tensor was written";
  } catch (const cereal::Exception& e) {
    EXPECT_THAT(e.what(), HasSubstr("from_torch: non-contiguous tensor (sizes [2, 3], strides [1, 2])"));
  }
}

std::string name_of(int rank) { return "worker" + std::to_string(rank); }

void register_torch_functions() {
  (void)register_function("affine", [](at::Tensor x, at::Tensor w, at::Tensor b) { return at::addmm(b, x, w); });
  (void)register_function("sums", [](std::vector<at::Tensor> ts) {
    std::vector<double> out;
    for (const at::Tensor& t : ts) out.push_back(t.sum().item<double>());
    return out;
  });
  (void)register_function("positive", [](at::Tensor x) { return std::make_tuple(x > 0, x.numel()); });
  // A function of a ferry-only worker: called from libtorch code with at::Tensors.
  (void)register_function("ferry_scale", [](Tensor t, double s) { return t.mul(s); });
}

// Two workers; each calls the other, so both directions send and receive at::Tensors.
void two_workers_body(int rank, const std::string& store) {
  register_torch_functions();
  TensorPipeRpcBackendOptions options;
  options.init_method = "file://" + store;
  options.num_worker_threads = 2;
  options.rpc_timeout = std::chrono::seconds(30);
  ASSERT_OK(init_rpc(name_of(rank), rank, 2, options));
  const std::string peer = name_of(1 - rank);

  at::Tensor x = at::arange(6, at::kFloat).reshape({2, 3}) + rank;
  at::Tensor w = at::arange(12, at::kFloat).reshape({3, 4}) / 10.0;
  at::Tensor b = at::ones({2, 4}, at::kFloat) * (rank + 1);
  at::Tensor y = rpc_sync<at::Tensor>(peer, "affine", x, w, b);
  EXPECT_EQ(y.sizes().vec(), (std::vector<int64_t>{2, 4}));
  EXPECT_TRUE(at::allclose(y, at::addmm(b, x, w))) << y;

  // 1M floats (4 MiB) go out of band; values checked end to end.
  at::Tensor large = at::linspace(-1.0, 1.0, 1 << 20, at::kFloat);
  std::vector<at::Tensor> batch = {large, at::full({3}, 2, at::kLong), at::zeros({0}, at::kFloat)};
  std::vector<double> sums = rpc_sync<std::vector<double>>(peer, "sums", batch);
  ASSERT_EQ(sums.size(), 3u);
  EXPECT_NEAR(sums[0], large.sum().item<double>(), 1e-3);
  EXPECT_EQ(sums[1], 6.0);
  EXPECT_EQ(sums[2], 0.0);

  auto [mask, count] = rpc_sync<std::tuple<at::Tensor, int64_t>>(peer, "positive", at::tensor({-1, 2, 0, 5}));
  EXPECT_EQ(mask.scalar_type(), at::kBool);
  EXPECT_TRUE(mask.equal(at::tensor({0, 1, 0, 1}).to(at::kBool)));
  EXPECT_EQ(count, 4);

  at::Tensor scaled = rpc_sync<at::Tensor>(peer, "ferry_scale", at::arange(5000, at::kDouble), 0.5);
  EXPECT_TRUE(scaled.equal(at::arange(5000, at::kDouble) * 0.5));

  // A tensor ferry would have to copy fails the call before anything is sent.
  Future<at::Tensor> refused = rpc_async<at::Tensor>(peer, "affine", x.t(), w, b);
  EXPECT_THAT(refused.wait_for(std::chrono::seconds(10)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("call to \"affine\": cannot send its arguments: from_torch: non-contiguous")));
  ASSERT_OK(shutdown());
}

TEST(TorchWire, TwoWorkersCallEachOtherWithAtTensors) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(
      2, [&](int rank) { two_workers_body(rank, dir.path() + "/store"); }, std::chrono::seconds(90)));
}

}  // namespace
}  // namespace ferry
