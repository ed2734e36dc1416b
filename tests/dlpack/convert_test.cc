#include "dlpack/convert.h"

#include <atomic>
#include <cstring>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensor/cuda.h"
#include "tensor/host_backed_cuda.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

// A CPU tensor over a heap buffer whose release is counted, so a test sees exactly when
// (and whether) ferry's side lets go of the memory.
Tensor counted_tensor(std::vector<int64_t> shape, std::atomic<int>* frees) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  auto* buffer = new float[static_cast<size_t>(n)];
  for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(i) + 0.5f;
  std::shared_ptr<void> storage(buffer, [frees](void* p) {
    delete[] static_cast<float*>(p);
    frees->fetch_add(1);
  });
  return *Tensor::from_blob(std::move(storage), std::move(shape), DType::kFloat32);
}

// A DLManagedTensor made the way another framework would: its own buffer, shape,
// strides and a deleter that counts its calls.
struct Foreign {
  std::vector<float> buffer;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  std::atomic<int>* deletes;
  DLManagedTensor managed{};
};

DLManagedTensor* make_foreign(std::vector<int64_t> shape, std::vector<int64_t> strides, std::atomic<int>* deletes) {
  auto* f = new Foreign;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  f->buffer.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) f->buffer[static_cast<size_t>(i)] = static_cast<float>(i * 10);
  f->shape = std::move(shape);
  f->strides = std::move(strides);
  f->deletes = deletes;
  DLTensor& dl = f->managed.dl_tensor;
  dl.data = f->buffer.data();
  dl.device = DLDevice{kDLCPU, 0};
  dl.ndim = static_cast<int>(f->shape.size());
  dl.dtype = DLDataType{kDLFloat, 32, 1};
  dl.shape = f->shape.data();
  dl.strides = f->strides.empty() ? nullptr : f->strides.data();
  dl.byte_offset = 0;
  f->managed.manager_ctx = f;
  f->managed.deleter = [](DLManagedTensor* self) {
    auto* owner = static_cast<Foreign*>(self->manager_ctx);
    owner->deletes->fetch_add(1);
    delete owner;
  };
  return &f->managed;
}

TEST(ToDlpack, SamePointerShapeStridesDtypeDevice) {
  std::atomic<int> frees{0};
  Tensor t = counted_tensor({2, 3, 4}, &frees);
  FERRY_ASSERT_OK_AND_ASSIGN(DLManagedTensorPtr dl, to_dlpack(t));
  EXPECT_EQ(dl->dl_tensor.data, t.data());
  EXPECT_EQ(dl->dl_tensor.byte_offset, 0u);
  EXPECT_EQ(dl->dl_tensor.device.device_type, kDLCPU);
  EXPECT_EQ(dl->dl_tensor.device.device_id, 0);
  ASSERT_EQ(dl->dl_tensor.ndim, 3);
  EXPECT_EQ(std::vector<int64_t>(dl->dl_tensor.shape, dl->dl_tensor.shape + 3), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(std::vector<int64_t>(dl->dl_tensor.strides, dl->dl_tensor.strides + 3),
            (std::vector<int64_t>{12, 4, 1}));
  EXPECT_EQ(dl->dl_tensor.dtype.code, kDLFloat);
  EXPECT_EQ(dl->dl_tensor.dtype.bits, 32);
  EXPECT_EQ(dl->dl_tensor.dtype.lanes, 1);
}

TEST(ToDlpack, MemoryOutlivesTheFerrySide) {
  std::atomic<int> frees{0};
  DLManagedTensorPtr dl;
  {
    Tensor t = counted_tensor({1000}, &frees);
    FERRY_ASSERT_OK_AND_ASSIGN(dl, to_dlpack(t));
  }
  EXPECT_EQ(frees.load(), 0) << "the DLPack side still holds the memory";
  // Read through the DLPack side after the ferry side is gone (ASan checks the reads).
  const float* values = static_cast<const float*>(dl->dl_tensor.data);
  EXPECT_EQ(values[0], 0.5f);
  EXPECT_EQ(values[999], 999.5f);
  dl.reset();
  EXPECT_EQ(frees.load(), 1);
}

TEST(ToDlpack, MemoryOutlivesTheDlpackSide) {
  std::atomic<int> frees{0};
  Tensor t = counted_tensor({16}, &frees);
  FERRY_ASSERT_OK_AND_ASSIGN(DLManagedTensorPtr dl, to_dlpack(t));
  dl.reset();
  EXPECT_EQ(frees.load(), 0);
  EXPECT_EQ(*t.at<float>({15}), 15.5f);
  t = Tensor();
  EXPECT_EQ(frees.load(), 1);
}

TEST(ToDlpack, RefusesUndefinedAndBool) {
  EXPECT_THAT(to_dlpack(Tensor()), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("undefined tensor")));
  Tensor b = *Tensor::zeros({3}, DType::kBool);
  EXPECT_THAT(to_dlpack(b), StatusIs(absl::StatusCode::kUnimplemented,
                                     HasSubstr("dtype bool has no type code in DLPack 0.6")));
}

TEST(FromDlpack, SamePointerAndOwnershipUntilTheLastCopy) {
  std::atomic<int> deletes{0};
  DLManagedTensor* managed = make_foreign({4, 5}, {5, 1}, &deletes);
  void* data = managed->dl_tensor.data;
  Tensor copy;
  {
    FERRY_ASSERT_OK_AND_ASSIGN(Tensor t, from_dlpack(managed));
    EXPECT_EQ(t.data(), data);
    EXPECT_EQ(t.shape(), (std::vector<int64_t>{4, 5}));
    EXPECT_EQ(t.dtype(), DType::kFloat32);
    EXPECT_EQ(t.device(), Device::cpu());
    EXPECT_EQ(*t.at<float>({3, 4}), 190.0f);
    copy = t;
  }
  EXPECT_EQ(deletes.load(), 0) << "a copy of the tensor still shares the storage";
  EXPECT_EQ(*copy.at<float>({1, 2}), 70.0f);
  copy = Tensor();
  EXPECT_EQ(deletes.load(), 1);
}

TEST(FromDlpack, HonoursByteOffsetAndNullStrides) {
  std::atomic<int> deletes{0};
  DLManagedTensor* managed = make_foreign({8}, {}, &deletes);
  managed->dl_tensor.shape[0] = 6;
  managed->dl_tensor.byte_offset = 2 * sizeof(float);
  float* base = static_cast<float*>(managed->dl_tensor.data);
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor t, from_dlpack(managed));
  EXPECT_EQ(t.data(), base + 2);
  EXPECT_EQ(*t.at<float>({0}), 20.0f);
  t = Tensor();
  EXPECT_EQ(deletes.load(), 1);
}

TEST(FromDlpack, SizeOneDimensionsMayHaveAnyStride) {
  std::atomic<int> deletes{0};
  // PyTorch gives a [3, 1] column of a contiguous tensor the strides [1, 1].
  DLManagedTensor* managed = make_foreign({3, 1}, {1, 1}, &deletes);
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor t, from_dlpack(managed));
  EXPECT_EQ(*t.at<float>({2, 0}), 20.0f);
}

TEST(FromDlpack, ZeroElementsWithNullDataImportEmpty) {
  std::atomic<int> deletes{0};
  DLManagedTensor* managed = make_foreign({0, 4}, {4, 1}, &deletes);
  managed->dl_tensor.data = nullptr;
  FERRY_ASSERT_OK_AND_ASSIGN(Tensor t, from_dlpack(managed));
  EXPECT_EQ(t.shape(), (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(deletes.load(), 1) << "nothing to share, so the producer is released at once";
}

// Each refusal names what DLPack expressed and ferry cannot, and leaves the
// DLManagedTensor with the caller.
struct Refusal {
  const char* name;
  void (*edit)(DLTensor&);
  absl::StatusCode code;
  const char* message;
};

TEST(FromDlpack, RefusesWhatFerryCannotHoldWithoutTakingIt) {
  const Refusal refusals[] = {
      {"transposed view", [](DLTensor& dl) { dl.strides[0] = 1, dl.strides[1] = 2; },
       absl::StatusCode::kInvalidArgument,
       "non-contiguous tensor (shape [2, 3], strides [1, 2]; ferry tensors are contiguous row-major, strides [3, 1])"},
      {"every other column", [](DLTensor& dl) { dl.strides[0] = 6, dl.strides[1] = 2; },
       absl::StatusCode::kInvalidArgument, "non-contiguous tensor (shape [2, 3], strides [6, 2]"},
      {"vector lanes", [](DLTensor& dl) { dl.dtype.lanes = 4; }, absl::StatusCode::kUnimplemented,
       "dtype kDLFloat bits 32 lanes 4: vector types (lanes != 1) have no ferry dtype"},
      {"uint16", [](DLTensor& dl) { dl.dtype = DLDataType{kDLUInt, 16, 1}; }, absl::StatusCode::kUnimplemented,
       "dtype kDLUInt bits 16 lanes 1 has no ferry dtype"},
      {"uint64", [](DLTensor& dl) { dl.dtype = DLDataType{kDLUInt, 64, 1}; }, absl::StatusCode::kUnimplemented,
       "dtype kDLUInt bits 64 lanes 1 has no ferry dtype"},
      {"complex64", [](DLTensor& dl) { dl.dtype = DLDataType{kDLComplex, 64, 1}; }, absl::StatusCode::kUnimplemented,
       "dtype kDLComplex bits 64 lanes 1 has no ferry dtype"},
      {"float8", [](DLTensor& dl) { dl.dtype = DLDataType{kDLFloat, 8, 1}; }, absl::StatusCode::kUnimplemented,
       "dtype kDLFloat bits 8 lanes 1 has no ferry dtype"},
      {"opaque handle", [](DLTensor& dl) { dl.dtype = DLDataType{kDLOpaqueHandle, 64, 1}; },
       absl::StatusCode::kUnimplemented, "dtype kDLOpaqueHandle bits 64 lanes 1 has no ferry dtype"},
      {"unknown type code", [](DLTensor& dl) { dl.dtype = DLDataType{42, 32, 1}; }, absl::StatusCode::kUnimplemented,
       "dtype type code 42 bits 32 lanes 1 has no ferry dtype"},
      {"pinned host", [](DLTensor& dl) { dl.device = DLDevice{kDLCUDAHost, 0}; }, absl::StatusCode::kUnimplemented,
       "device kDLCUDAHost (pinned host memory) id 0 has no ferry device"},
      {"managed", [](DLTensor& dl) { dl.device = DLDevice{kDLCUDAManaged, 0}; }, absl::StatusCode::kUnimplemented,
       "device kDLCUDAManaged (CUDA managed memory) id 0 has no ferry device"},
      {"rocm", [](DLTensor& dl) { dl.device = DLDevice{kDLROCM, 1}; }, absl::StatusCode::kUnimplemented,
       "device kDLROCM id 1 has no ferry device"},
      {"vulkan", [](DLTensor& dl) { dl.device = DLDevice{kDLVulkan, 0}; }, absl::StatusCode::kUnimplemented,
       "device kDLVulkan id 0 has no ferry device"},
      {"cpu id 1", [](DLTensor& dl) { dl.device = DLDevice{kDLCPU, 1}; }, absl::StatusCode::kInvalidArgument,
       "device kDLCPU with device_id 1"},
      {"cuda id -1", [](DLTensor& dl) { dl.device = DLDevice{kDLCUDA, -1}; }, absl::StatusCode::kInvalidArgument,
       "kDLCUDA with negative device_id -1"},
      {"negative ndim", [](DLTensor& dl) { dl.ndim = -1; }, absl::StatusCode::kInvalidArgument, "negative ndim -1"},
      {"null shape", [](DLTensor& dl) { dl.shape = nullptr; }, absl::StatusCode::kInvalidArgument,
       "null shape with ndim 2"},
      {"negative dimension", [](DLTensor& dl) { dl.shape[1] = -3; }, absl::StatusCode::kInvalidArgument,
       "negative dimension in shape [2, -3]"},
      {"null data", [](DLTensor& dl) { dl.data = nullptr; }, absl::StatusCode::kInvalidArgument,
       "null data for shape [2, 3]"},
      {"too many elements", [](DLTensor& dl) { dl.shape[0] = dl.shape[1] = int64_t{1} << 40; },
       absl::StatusCode::kInvalidArgument, "shape [1099511627776, 1099511627776] is too large"},
      {"too many bytes", [](DLTensor& dl) { dl.shape[0] = int64_t{1} << 61, dl.shape[1] = 1, dl.strides[0] = 1; },
       absl::StatusCode::kInvalidArgument, "shape [2305843009213693952, 1] of float32 is too large"},
  };
  for (const Refusal& r : refusals) {
    SCOPED_TRACE(r.name);
    std::atomic<int> deletes{0};
    DLManagedTensorPtr managed(make_foreign({2, 3}, {3, 1}, &deletes));
    r.edit(managed->dl_tensor);
    EXPECT_THAT(from_dlpack(managed.get()), StatusIs(r.code, HasSubstr(r.message)));
    EXPECT_EQ(deletes.load(), 0) << "a refused import must leave the tensor with its caller";
    managed.reset();
    EXPECT_EQ(deletes.load(), 1);
  }
  EXPECT_THAT(from_dlpack(nullptr), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null DLManagedTensor")));
}

TEST(DlpackDtypes, EveryFerryDtypeMapsOneToOne) {
  struct Row {
    DType dtype;
    uint8_t code;
    uint8_t bits;
  };
  const Row rows[] = {
      {DType::kFloat16, kDLFloat, 16}, {DType::kBFloat16, kDLBfloat, 16}, {DType::kFloat32, kDLFloat, 32},
      {DType::kFloat64, kDLFloat, 64}, {DType::kInt8, kDLInt, 8},         {DType::kInt16, kDLInt, 16},
      {DType::kInt32, kDLInt, 32},     {DType::kInt64, kDLInt, 64},       {DType::kUInt8, kDLUInt, 8},
  };
  EXPECT_EQ(std::size(rows), static_cast<size_t>(kNumDTypes - 1)) << "every dtype but bool";
  for (const Row& row : rows) {
    SCOPED_TRACE(dtype_name(row.dtype));
    FERRY_ASSERT_OK_AND_ASSIGN(DLDataType dl, to_dlpack_dtype(row.dtype));
    EXPECT_EQ(dl.code, row.code);
    EXPECT_EQ(dl.bits, row.bits);
    EXPECT_EQ(dl.lanes, 1);
    EXPECT_EQ(dl.bits, 8 * dtype_size(row.dtype));
    FERRY_ASSERT_OK_AND_ASSIGN(DType back, from_dlpack_dtype(dl));
    EXPECT_EQ(back, row.dtype);

    // And through whole tensors: the same pointer comes back with the same dtype.
    Tensor t = *Tensor::zeros({2, 2}, row.dtype);
    FERRY_ASSERT_OK_AND_ASSIGN(DLManagedTensorPtr managed, to_dlpack(t));
    FERRY_ASSERT_OK_AND_ASSIGN(Tensor round, from_dlpack(managed.release()));
    EXPECT_EQ(round.data(), t.data());
    EXPECT_EQ(round.dtype(), row.dtype);
    EXPECT_EQ(round.shape(), t.shape());
  }
  EXPECT_THAT(to_dlpack_dtype(DType::kBool), StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("kDLBool")));
}

TEST(DlpackDevices, CpuAndEveryCudaIndexMapOneToOne) {
  EXPECT_EQ(to_dlpack_device(Device::cpu()).device_type, kDLCPU);
  EXPECT_EQ(to_dlpack_device(Device::cpu()).device_id, 0);
  EXPECT_EQ(*from_dlpack_device(DLDevice{kDLCPU, 0}), Device::cpu());
  for (int i : {0, 1, 7}) {
    DLDevice dl = to_dlpack_device(Device::cuda(i));
    EXPECT_EQ(dl.device_type, kDLCUDA);
    EXPECT_EQ(dl.device_id, i);
    EXPECT_EQ(*from_dlpack_device(dl), Device::cuda(i));
  }
}

// CUDA memory crosses as device pointers, untouched: the host-backed runtime stands in
// for a GPU here (and a real one is used where present, by the same code).
TEST(DlpackDevices, CudaTensorsRoundTripWithoutACopy) {
  std::shared_ptr<CudaRuntime> previous = set_cuda_runtime(std::make_shared<HostBackedCudaRuntime>(2));
  {
    Tensor t = *Tensor::zeros({3, 2}, DType::kFloat32, Device::cuda(1));
    ASSERT_OK(t.set<float>({2, 1}, 4.25f));
    FERRY_ASSERT_OK_AND_ASSIGN(DLManagedTensorPtr dl, to_dlpack(t));
    EXPECT_EQ(dl->dl_tensor.device.device_type, kDLCUDA);
    EXPECT_EQ(dl->dl_tensor.device.device_id, 1);
    EXPECT_EQ(dl->dl_tensor.data, t.data());
    FERRY_ASSERT_OK_AND_ASSIGN(Tensor back, from_dlpack(dl.release()));
    EXPECT_EQ(back.device(), Device::cuda(1));
    EXPECT_EQ(back.data(), t.data());
    t = Tensor();
    EXPECT_EQ(*back.at<float>({2, 1}), 4.25f);
  }
  set_cuda_runtime(previous);
}

}  // namespace
}  // namespace ferry
