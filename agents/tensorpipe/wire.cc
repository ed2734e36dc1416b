#include "agents/tensorpipe/wire.h"

#include "base/env.h"

namespace ferry::internal {

size_t max_cached_receive_bytes() {
  static const size_t mb = static_cast<size_t>(env_int("FERRY_RECEIVE_CACHE_MB", 512, 0, 1 << 20));
  return mb << 20;
}

absl::StatusOr<Tensor> receive_buffer(const std::shared_ptr<BufferPool>& pool, size_t length) {
  if (length < kPooledBufferBytes) return Tensor::empty({static_cast<int64_t>(length)}, DType::kUInt8);
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<void> storage, pool->get(length));
  return Tensor::from_blob(std::move(storage), {static_cast<int64_t>(length)}, DType::kUInt8);
}

}  // namespace ferry::internal
