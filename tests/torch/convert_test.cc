// at::Tensor <-> ferry::Tensor <-> DLPack without copies: the same pointer on every
// side, and memory that lives while any side holds it.
#include "torch/convert.h"

#include <ATen/DLConvertor.h>
#include <ATen/Functions.h>

#include <atomic>
#include <vector>

#include "dlpack/convert.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensor/cuda.h"
#include "tensor/host_backed_cuda.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

// An at::Tensor over a heap buffer whose release is counted: libtorch calls the
// deleter when the last tensor (or view) over it goes.
at::Tensor counted_torch_tensor(std::vector<int64_t> sizes, std::atomic<int>* frees) {
  int64_t n = 1;
  for (int64_t d : sizes) n *= d;
  auto* buffer = new float[static_cast<size_t>(n)];
  for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(i) * 2.0f;
  return at::from_blob(
      buffer, sizes,
      [frees](void* p) {
        delete[] static_cast<float*>(p);
        frees->fetch_add(1);
      },
      at::TensorOptions().dtype(at::kFloat));
}

TEST(FromTorch, SamePointerAndTheAtTensorLivesWhileFerryHoldsIt) {
  std::atomic<int> frees{0};
  Tensor f;
  {
    at::Tensor t = counted_torch_tensor({3, 4}, &frees);
    FERRY_ASSERT_OK_AND_ASSIGN(f, from_torch(t));
    EXPECT_EQ(f.data(), t.data_ptr());
    EXPECT_EQ(f.shape(), (std::vector<int64_t>{3, 4}));
    EXPECT_EQ(f.dtype(), DType::kFloat32);
    EXPECT_EQ(f.device(), Device::cpu());
  }
  EXPECT_EQ(frees.load(), 0) << "ferry still holds the memory";
  EXPECT_EQ(*f.at<float>({2, 3}), 22.0f);
  f = Tensor();
  EXPECT_EQ(frees.load(), 1);
}

TEST(FromTorch, FerryLetsGoFirst) {
  std::atomic<int> frees{0};
  at::Tensor t = counted_torch_tensor({8}, &frees);
  { FERRY_ASSERT_OK_AND_ASSIGN(Tensor f, from_torch(t)); }
  EXPECT_EQ(frees.load(), 0);
  EXPECT_EQ(t[7].item<float>(), 14.0f);
  t = at::Tensor();
  EXPECT_EQ(frees.load(), 1);
}

TEST(FromTorch, AContiguousSliceKeepsItsOffset) {
  at::Tensor t = at::arange(12, at::kFloat).reshape({4, 3});
  at::Tensor rows = t.slice(0, 1, 3);  // rows 1 and 2: contiguous, at an offset
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor f, from_torch(rows));
  EXPECT_EQ(f.data(), rows.data_ptr());
  EXPECT_EQ(f.data(), static_cast<float*>(t.data_ptr()) + 3);
  EXPECT_EQ(*f.at<float>({0, 0}), 3.0f);
}

TEST(FromTorch, UndefinedAndEmpty) {
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor f, from_torch(at::Tensor()));
  EXPECT_FALSE(f.defined());
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor e, from_torch(at::empty({0, 5}, at::kLong)));
  EXPECT_EQ(e.shape(), (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(e.dtype(), DType::kInt64);
  FERRY_ASSERT_OK_AND_ASSIGN(at::Tensor u, to_torch(Tensor()));
  EXPECT_FALSE(u.defined());
}

TEST(FromTorch, RefusesWhatItWouldHaveToCopy) {
  at::Tensor m = at::arange(6, at::kFloat).reshape({2, 3});
  EXPECT_THAT(from_torch(m.t()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("non-contiguous tensor (sizes [3, 2], strides [1, 3]): ferry tensors are contiguous "
                                 "row-major and ferry does not copy; call .contiguous() first")));
  EXPECT_THAT(from_torch(at::_neg_view(m)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lazily negated view (is_neg())")));
  EXPECT_THAT(from_torch(at::zeros({2}, at::kComplexFloat)),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("dtype ComplexFloat has no ferry dtype")));
  EXPECT_THAT(from_torch(m.to_sparse()),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("layout Sparse (ferry tensors are dense")));
  EXPECT_THAT(from_torch(at::quantize_per_tensor(m, 0.1, 0, at::kQInt8)),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("quantized tensor of dtype QInt8")));
}

TEST(ToTorch, SamePointerAndFerryStorageLivesWhileTorchHoldsIt) {
  std::atomic<int> frees{0};
  at::Tensor t;
  void* data = nullptr;
  {
    auto* buffer = new int32_t[6]{0, 1, 2, 3, 4, 5};
    std::shared_ptr<void> storage(buffer, [&frees](void* p) {
      delete[] static_cast<int32_t*>(p);
      frees.fetch_add(1);
    });
    data = buffer;
    FERRY_ASSERT_OK_AND_ASSIGN(Tensor f, Tensor::from_blob(storage, {2, 3}, DType::kInt32));
    FERRY_ASSERT_OK_AND_ASSIGN(t, to_torch(f));
  }
  EXPECT_EQ(t.data_ptr(), data);
  EXPECT_EQ(t.scalar_type(), at::kInt);
  EXPECT_EQ(t.sizes().vec(), (std::vector<int64_t>{2, 3}));
  EXPECT_FALSE(t.requires_grad());
  EXPECT_EQ(frees.load(), 0) << "the at::Tensor still holds the ferry storage";
  at::Tensor view = t.view({6});
  t = at::Tensor();
  EXPECT_EQ(view[5].item<int32_t>(), 5);
  view = at::Tensor();
  EXPECT_EQ(frees.load(), 1);
}

// Where libtorch has no CUDA (Debian's is CPU-only), a CUDA ferry::Tensor cannot
// become an at::Tensor: the error says so instead of handing out a tensor whose
// kernels would fail later. The host-backed runtime stands in for a GPU.
TEST(ToTorch, CudaTensorWithoutCudaInLibtorch) {
  if (at::hasCUDA()) GTEST_SKIP() << "this libtorch has CUDA";
  std::shared_ptr<CudaRuntime> previous = set_cuda_runtime(std::make_shared<HostBackedCudaRuntime>(1));
  {
    FERRY_ASSERT_OK_AND_ASSIGN(Tensor f, Tensor::zeros({4}, DType::kFloat32, Device::cuda(0)));
    EXPECT_THAT(to_torch(f), StatusIs(absl::StatusCode::kFailedPrecondition,
                                      HasSubstr("to_torch: libtorch cannot wrap a Tensor(float32, [4], cuda:0)")));
  }
  set_cuda_runtime(previous);
}

TEST(TorchDtypes, EveryFerryDtypeMapsOneToOne) {
  for (int i = 0; i < kNumDTypes; ++i) {
    DType dtype = static_cast<DType>(i);
    SCOPED_TRACE(dtype_name(dtype));
    c10::ScalarType type = to_torch_dtype(dtype);
    EXPECT_EQ(c10::elementSize(type), dtype_size(dtype));
    FERRY_ASSERT_OK_AND_ASSIGN(DType back, from_torch_dtype(type));
    EXPECT_EQ(back, dtype);
    // Whole tensors: at -> ferry -> at keeps the pointer and the dtype.
    at::Tensor t = at::zeros({2, 2}, type);
    FERRY_ASSERT_OK_AND_ASSIGN(Tensor f, from_torch(t));
    FERRY_ASSERT_OK_AND_ASSIGN(at::Tensor round, to_torch(f));
    EXPECT_EQ(round.data_ptr(), t.data_ptr());
    EXPECT_EQ(round.scalar_type(), type);
  }
  EXPECT_EQ(to_torch_dtype(DType::kInt8), at::kChar);
  EXPECT_EQ(to_torch_dtype(DType::kUInt8), at::kByte);
  EXPECT_EQ(to_torch_dtype(DType::kBFloat16), at::kBFloat16);
}

// The zero-copy test: an at::Tensor into DLPack, into a ferry::Tensor, back
// out through DLPack into an at::Tensor: one pointer throughout, and the memory stays
// until the last holder on any side goes.
TEST(TorchDlpack, OnePointerThroughDlpackFerryAndBack) {
  std::atomic<int> frees{0};
  at::Tensor original = counted_torch_tensor({16, 16}, &frees);
  void* data = original.data_ptr();

  FERRY_ASSERT_OK_AND_ASSIGN(Tensor f, from_dlpack(at::toDLPack(original)));
  EXPECT_EQ(f.data(), data);
  EXPECT_EQ(f.dtype(), DType::kFloat32);
  FERRY_ASSERT_OK_AND_ASSIGN(DLManagedTensorPtr out, to_dlpack(f));
  at::Tensor back = at::fromDLPack(out.release());
  EXPECT_EQ(back.data_ptr(), data);
  EXPECT_TRUE(back.equal(original));

  // Drop holders one side at a time; the memory must stay until the very last.
  original = at::Tensor();
  EXPECT_EQ(frees.load(), 0);
  f = Tensor();
  EXPECT_EQ(frees.load(), 0);
  EXPECT_EQ(back[15][15].item<float>(), 510.0f);
  back = at::Tensor();
  EXPECT_EQ(frees.load(), 1);
}

TEST(TorchDlpack, FromTorchIntoDlpackAndBack) {
  std::atomic<int> frees{0};
  at::Tensor original = counted_torch_tensor({5}, &frees);
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor f, from_torch(original));
  FERRY_ASSERT_OK_AND_ASSIGN(DLManagedTensorPtr dl, to_dlpack(f));
  original = at::Tensor();
  f = Tensor();
  at::Tensor back = at::fromDLPack(dl.release());
  EXPECT_EQ(back[4].item<float>(), 8.0f);
  EXPECT_EQ(frees.load(), 0);
  back = at::Tensor();
  EXPECT_EQ(frees.load(), 1);
}

}  // namespace
}  // namespace ferry
