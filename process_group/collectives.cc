// ProcessGroup's collectives: argument checks, then a queued task for the group's worker
// (see internal/group_impl.h).
#include "process_group/internal/group_impl.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "gloo/allgather.h"
#include "gloo/allgatherv.h"
#include "gloo/allreduce.h"
#include "gloo/broadcast.h"
#include "gloo/gather.h"
#include "gloo/reduce.h"
#include "gloo/scatter.h"
#include "process_group/internal/reduce.h"

namespace ferry {

// ---- collectives -------------------------------------------------------------------

Work ProcessGroup::broadcast_async(Tensor tensor, int src) {
  FERRY_PG_MEMBER_OR_RETURN_WORK("broadcast");
  absl::Status local = check_tensor("broadcast", "the tensor", tensor);
  if (local.ok()) local = check_root("broadcast", "src", src, world_size_);
  CollectiveHeader h = internal::make_header(CollectiveKind::kBroadcast, &tensor, src, ReduceOp::kSum, local);
  Impl::Body body = [tensor, src](Impl& impl, uint32_t tag, const std::vector<CollectiveHeader>& headers) -> absl::Status {
    if (tensor.nbytes() == 0) return absl::OkStatus();
    const bool root = impl.rank() == src;
    if (!headers.empty() && impl.is_inline(headers[src])) {
      // The bytes came with the root's header.
      return root ? absl::OkStatus() : copy_from_host(tensor, impl.inline_data(src), tensor.nbytes());
    }
    FERRY_ASSIGN_OR_RETURN(Tensor host, root ? host_input(tensor) : host_output(tensor));
    gloo::BroadcastOptions opts(impl.context_);
    opts.setRoot(src);
    opts.setOutput<uint8_t>(static_cast<uint8_t*>(host.data()), host.nbytes());
    opts.setTag(tag);
    opts.setTimeout(impl.context_->getTimeout());
    gloo::broadcast(opts);
    return root ? absl::OkStatus() : write_back(tensor, host);
  };
  return impl_->enqueue("broadcast", h, local, std::move(body), rank_ == src ? tensor : Tensor());
}

absl::Status ProcessGroup::broadcast(Tensor tensor, int src) {
  RunHereIfIdle here;
  return broadcast_async(std::move(tensor), src).wait();
}

Work ProcessGroup::all_reduce_async(Tensor tensor, ReduceOp op) {
  FERRY_PG_MEMBER_OR_RETURN_WORK("all_reduce");
  absl::Status local = check_tensor("all_reduce", "the tensor", tensor);
  internal::ReduceFn fn = nullptr;
  if (local.ok()) {
    absl::StatusOr<internal::ReduceFn> f = internal::reduce_function(tensor.dtype(), op, "all_reduce");
    if (f.ok()) fn = *f;
    else local = f.status();
  }
  CollectiveHeader h = internal::make_header(CollectiveKind::kAllReduce, &tensor, 0, op, local);
  return impl_->enqueue("all_reduce", h, local, [tensor, fn](Impl& impl, uint32_t tag, const auto&) -> absl::Status {
    if (tensor.numel() == 0) return absl::OkStatus();
    FERRY_ASSIGN_OR_RETURN(Tensor host, host_input(tensor));
    gloo::AllreduceOptions opts(impl.context_);
    visit_dtype(host.dtype(), [&]<typename T>() {
      opts.setOutput<T>(static_cast<T*>(host.data()), static_cast<size_t>(host.numel()));
    });
    opts.setReduceFunction(fn);
    opts.setTag(tag);
    opts.setTimeout(impl.context_->getTimeout());
    gloo::allreduce(opts);
    return write_back(tensor, host);
  });
}

absl::Status ProcessGroup::all_reduce(Tensor tensor, ReduceOp op) {
  RunHereIfIdle here;
  return all_reduce_async(std::move(tensor), op).wait();
}

Work ProcessGroup::reduce_async(Tensor tensor, int dst, ReduceOp op) {
  FERRY_PG_MEMBER_OR_RETURN_WORK("reduce");
  absl::Status local = check_tensor("reduce", "the tensor", tensor);
  if (local.ok()) local = check_root("reduce", "dst", dst, world_size_);
  internal::ReduceFn fn = nullptr;
  if (local.ok()) {
    absl::StatusOr<internal::ReduceFn> f = internal::reduce_function(tensor.dtype(), op, "reduce");
    if (f.ok()) fn = *f;
    else local = f.status();
  }
  CollectiveHeader h = internal::make_header(CollectiveKind::kReduce, &tensor, dst, op, local);
  return impl_->enqueue("reduce", h, local, [tensor, dst, fn](Impl& impl, uint32_t tag, const auto&) -> absl::Status {
    if (tensor.numel() == 0) return absl::OkStatus();
    const bool root = impl.rank() == dst;
    FERRY_ASSIGN_OR_RETURN(Tensor host, host_input(tensor));
    // Gloo's reduce uses its output as scratch on every rank: give the other ranks a
    // scratch output, so their tensors stay as they were.
    Tensor scratch;
    if (!root) {
      FERRY_ASSIGN_OR_RETURN(scratch, Tensor::empty(host.shape(), host.dtype(), Device::cpu()));
    }
    gloo::ReduceOptions opts(impl.context_);
    const size_t n = static_cast<size_t>(host.numel());
    visit_dtype(host.dtype(), [&]<typename T>() {
      if (root) {
        opts.setOutput<T>(static_cast<T*>(host.data()), n);
      } else {
        opts.setInput<T>(static_cast<T*>(host.data()), n);
        opts.setOutput<T>(static_cast<T*>(scratch.data()), n);
      }
    });
    opts.setRoot(dst);
    opts.setReduceFunction(fn);
    opts.setTag(tag);
    opts.setTimeout(impl.context_->getTimeout());
    gloo::reduce(opts);
    return root ? write_back(tensor, host) : absl::OkStatus();
  });
}

absl::Status ProcessGroup::reduce(Tensor tensor, int dst, ReduceOp op) {
  RunHereIfIdle here;
  return reduce_async(std::move(tensor), dst, op).wait();
}

namespace {

// All-gathers `input` (host) into `flat` (host, world * input.nbytes() bytes).
void gloo_all_gather(const std::shared_ptr<gloo::Context>& context, const Tensor& input, void* flat, uint32_t tag) {
  gloo::AllgatherOptions opts(context);
  opts.setInput<uint8_t>(static_cast<uint8_t*>(input.data()), input.nbytes());
  opts.setOutput<uint8_t>(static_cast<uint8_t*>(flat), input.nbytes() * context->size);
  opts.setTag(tag);
  opts.setTimeout(context->getTimeout());
  gloo::allgather(opts);
}

}  // namespace

Work ProcessGroup::all_gather_async(std::vector<Tensor> outputs, Tensor input) {
  FERRY_PG_MEMBER_OR_RETURN_WORK("all_gather");
  absl::Status local = check_tensor("all_gather", "the input tensor", input);
  if (local.ok()) local = check_list("all_gather", "outputs", outputs, input, world_size_);
  CollectiveHeader h = internal::make_header(CollectiveKind::kAllGather, &input, 0, ReduceOp::kSum, local);
  return impl_->enqueue(
      "all_gather", h, local,
      [outputs = std::move(outputs), input](Impl& impl, uint32_t tag, const auto& headers) -> absl::Status {
        const size_t n = input.nbytes();
        if (n == 0) return absl::OkStatus();
        FERRY_ASSIGN_OR_RETURN(Tensor host, host_input(input));
        if (!headers.empty() && Impl::is_inline(headers[0])) {
          // Every rank's input came with its header.
          for (int r = 0; r < impl.size(); ++r) {
            FERRY_RETURN_IF_ERROR(copy_from_host(outputs[r], r == impl.rank() ? host.data() : impl.inline_data(r), n));
          }
          return absl::OkStatus();
        }
        FERRY_ASSIGN_OR_RETURN(Tensor flat, Tensor::empty({static_cast<int64_t>(n) * impl.size()}, DType::kUInt8));
        gloo_all_gather(impl.context_, host, flat.data(), tag);
        for (int r = 0; r < impl.size(); ++r) {
          FERRY_RETURN_IF_ERROR(copy_from_host(outputs[r], static_cast<const uint8_t*>(flat.data()) + r * n, n));
        }
        return absl::OkStatus();
      },
      input);
}

absl::Status ProcessGroup::all_gather(std::vector<Tensor> outputs, Tensor input) {
  RunHereIfIdle here;
  return all_gather_async(std::move(outputs), std::move(input)).wait();
}

Work ProcessGroup::all_gather_into_tensor_async(Tensor output, Tensor input) {
  FERRY_PG_MEMBER_OR_RETURN_WORK("all_gather_into_tensor");
  absl::Status local = check_tensor("all_gather_into_tensor", "the input tensor", input);
  if (local.ok()) local = check_tensor("all_gather_into_tensor", "the output tensor", output);
  if (local.ok() && (output.dtype() != input.dtype() || output.numel() != input.numel() * world_size_)) {
    local = absl::InvalidArgumentError(absl::StrCat(
        "all_gather_into_tensor: the output is ", dtype_name(output.dtype()), " with ", output.numel(),
        " elements; expected ", dtype_name(input.dtype()), " with ", input.numel() * world_size_,
        " (world size x the input's ", input.numel(), ")"));
  }
  CollectiveHeader h = internal::make_header(CollectiveKind::kAllGather, &input, 0, ReduceOp::kSum, local);
  return impl_->enqueue(
      "all_gather_into_tensor", h, local,
      [output, input](Impl& impl, uint32_t tag, const auto& headers) -> absl::Status {
        const size_t n = input.nbytes();
        if (n == 0) return absl::OkStatus();
        FERRY_ASSIGN_OR_RETURN(Tensor host_in, host_input(input));
        FERRY_ASSIGN_OR_RETURN(Tensor host_out, host_output(output));
        if (!headers.empty() && Impl::is_inline(headers[0])) {
          // Every rank's input came with its header.
          for (int r = 0; r < impl.size(); ++r) {
            std::memcpy(static_cast<uint8_t*>(host_out.data()) + r * n,
                        r == impl.rank() ? host_in.data() : impl.inline_data(r), n);
          }
        } else {
          gloo_all_gather(impl.context_, host_in, host_out.data(), tag);
        }
        return write_back(output, host_out);
      },
      input);
}

absl::Status ProcessGroup::all_gather_into_tensor(Tensor output, Tensor input) {
  RunHereIfIdle here;
  return all_gather_into_tensor_async(std::move(output), std::move(input)).wait();
}

Work ProcessGroup::gather_async(Tensor input, std::vector<Tensor> gather_list, int dst) {
  FERRY_PG_MEMBER_OR_RETURN_WORK("gather");
  absl::Status local = check_tensor("gather", "the input tensor", input);
  if (local.ok()) local = check_root("gather", "dst", dst, world_size_);
  if (local.ok()) {
    if (rank_ == dst) {
      if (gather_list.empty()) {
        local = absl::InvalidArgumentError("gather: gather_list is a required argument in gather destination");
      } else {
        local = check_list("gather", "gather_list", gather_list, input, world_size_);
      }
    } else if (!gather_list.empty()) {
      local = absl::InvalidArgumentError(absl::StrCat(
          "gather: non-empty gather_list can be given only to gather destination (dst is ", dst, ", this is rank ",
          rank_, ")"));
    }
  }
  CollectiveHeader h = internal::make_header(CollectiveKind::kGather, &input, dst, ReduceOp::kSum, local);
  return impl_->enqueue(
      "gather", h, local,
      [input, gather_list = std::move(gather_list), dst](Impl& impl, uint32_t tag, const auto&) -> absl::Status {
        const size_t n = input.nbytes();
        if (n == 0) return absl::OkStatus();
        FERRY_ASSIGN_OR_RETURN(Tensor host, host_input(input));
        const bool root = impl.rank() == dst;
        Tensor flat;
        if (root) {
          FERRY_ASSIGN_OR_RETURN(flat, Tensor::empty({static_cast<int64_t>(n) * impl.size()}, DType::kUInt8));
        }
        gloo::GatherOptions opts(impl.context_);
        opts.setInput<uint8_t>(static_cast<uint8_t*>(host.data()), n);
        if (root) opts.setOutput<uint8_t>(static_cast<uint8_t*>(flat.data()), n * impl.size());
        opts.setRoot(dst);
        opts.setTag(tag);
        opts.setTimeout(impl.context_->getTimeout());
        gloo::gather(opts);
        if (root) {
          for (int r = 0; r < impl.size(); ++r) {
            FERRY_RETURN_IF_ERROR(copy_from_host(gather_list[r], static_cast<const uint8_t*>(flat.data()) + r * n, n));
          }
        }
        return absl::OkStatus();
      });
}

absl::Status ProcessGroup::gather(Tensor input, std::vector<Tensor> gather_list, int dst) {
  RunHereIfIdle here;
  return gather_async(std::move(input), std::move(gather_list), dst).wait();
}

Work ProcessGroup::scatter_async(Tensor output, std::vector<Tensor> scatter_list, int src) {
  FERRY_PG_MEMBER_OR_RETURN_WORK("scatter");
  absl::Status local = check_tensor("scatter", "the output tensor", output);
  if (local.ok()) local = check_root("scatter", "src", src, world_size_);
  if (local.ok()) {
    if (rank_ == src) {
      if (scatter_list.empty()) {
        local = absl::InvalidArgumentError("scatter: scatter_list is a required argument in scatter source");
      } else {
        local = check_list("scatter", "scatter_list", scatter_list, output, world_size_);
      }
    } else if (!scatter_list.empty()) {
      local = absl::InvalidArgumentError(absl::StrCat(
          "scatter: non-empty scatter_list can be given only to scatter source (src is ", src, ", this is rank ",
          rank_, ")"));
    }
  }
  CollectiveHeader h = internal::make_header(CollectiveKind::kScatter, &output, src, ReduceOp::kSum, local);
  return impl_->enqueue(
      "scatter", h, local,
      [output, scatter_list = std::move(scatter_list), src](Impl& impl, uint32_t tag, const auto&) -> absl::Status {
        const size_t n = output.nbytes();
        if (n == 0) return absl::OkStatus();
        const bool root = impl.rank() == src;
        FERRY_ASSIGN_OR_RETURN(Tensor host_out, host_output(output));
        std::vector<Tensor> host_in;
        std::vector<uint8_t*> ptrs;
        if (root) {
          for (const Tensor& t : scatter_list) {
            FERRY_ASSIGN_OR_RETURN(Tensor h, host_input(t));
            // Gloo copies the root's own part with memcpy: it must not overlap the output.
            if (h.data() == host_out.data()) {
              FERRY_ASSIGN_OR_RETURN(h, h.clone());
            }
            ptrs.push_back(static_cast<uint8_t*>(h.data()));
            host_in.push_back(std::move(h));
          }
        }
        gloo::ScatterOptions opts(impl.context_);
        if (root) opts.setInputs<uint8_t>(ptrs, n);
        opts.setOutput<uint8_t>(static_cast<uint8_t*>(host_out.data()), n);
        opts.setRoot(src);
        opts.setTag(tag);
        opts.setTimeout(impl.context_->getTimeout());
        gloo::scatter(opts);
        return write_back(output, host_out);
      });
}

absl::Status ProcessGroup::scatter(Tensor output, std::vector<Tensor> scatter_list, int src) {
  RunHereIfIdle here;
  return scatter_async(std::move(output), std::move(scatter_list), src).wait();
}

Work ProcessGroup::barrier_async() {
  FERRY_PG_MEMBER_OR_RETURN_WORK("barrier");
  CollectiveHeader h = internal::make_header(CollectiveKind::kBarrier, nullptr, 0, ReduceOp::kSum, absl::OkStatus());
  // The header exchange is itself the barrier (see Impl::run).
  return impl_->enqueue("barrier", h, absl::OkStatus(),
                        [](Impl&, uint32_t, const auto&) { return absl::OkStatus(); });
}

absl::Status ProcessGroup::barrier() {
  RunHereIfIdle here;
  return barrier_async().wait();
}

absl::StatusOr<std::vector<Bytes>> ProcessGroup::all_gather_bytes(const Bytes& data) {
  return all_gather_bytes_internal(data, absl::OkStatus(), "all_gather_bytes");
}

absl::StatusOr<std::vector<Bytes>> ProcessGroup::all_gather_bytes_internal(const Bytes& data,
                                                                           const absl::Status& local_error,
                                                                           std::string_view op_name) {
  const std::string name(op_name);
  if (!is_member()) return not_member_error(name, ranks_);
  // The headers carry every rank's size, so the data moves in one allgatherv.
  CollectiveHeader h = internal::make_header(CollectiveKind::kAllGatherBytes, nullptr, 0, ReduceOp::kSum, local_error,
                                             static_cast<int64_t>(data.size()));
  auto result = std::make_shared<std::vector<Bytes>>();
  RunHereIfIdle here;
  Work work = impl_->enqueue(
      name, h, local_error,
      [&data, result](Impl& impl, uint32_t tag, const std::vector<CollectiveHeader>& headers) -> absl::Status {
        std::vector<size_t> counts;
        size_t total = 0;
        for (const CollectiveHeader& hh : headers) {
          counts.push_back(static_cast<size_t>(hh.numel));
          total += counts.back();
        }
        std::vector<uint8_t> flat(total);
        if (total > 0) {
          // Gloo wants a real pointer even for an empty contribution.
          uint8_t dummy = 0;
          gloo::AllgathervOptions opts(impl.context_);
          opts.setInput<uint8_t>(data.empty() ? &dummy : const_cast<uint8_t*>(data.data()), data.size());
          opts.setOutput<uint8_t>(flat.data(), counts);
          opts.setTag(tag);
          opts.setTimeout(impl.context_->getTimeout());
          gloo::allgatherv(opts);
        }
        size_t offset = 0;
        for (size_t c : counts) {
          result->emplace_back(flat.begin() + offset, flat.begin() + offset + c);
          offset += c;
        }
        return absl::OkStatus();
      });
  // Blocking: `data` stays alive (it is captured by reference) until this returns.
  FERRY_RETURN_IF_ERROR(work.wait());
  return std::move(*result);
}

}  // namespace ferry

namespace ferry {

absl::Status ProcessGroup::Impl::run_stand_in(const CollectiveHeader& h, uint32_t tag) {
  // The same Gloo operation, element type and sizes as the bodies above run for `h`:
  // only then do its messages match those of the ranks it stands in for.
  const auto dtype = static_cast<DType>(h.dtype);
  const size_t n = static_cast<size_t>(h.numel) * dtype_size(dtype);
  const int root = h.root;
  const bool is_root = rank() == root;
  const int world = size();
  FERRY_ASSIGN_OR_RETURN(Tensor scratch, Tensor::zeros({h.numel}, dtype));
  uint8_t* bytes = static_cast<uint8_t*>(scratch.data());
  switch (static_cast<CollectiveKind>(h.kind)) {
    case CollectiveKind::kBroadcast: {
      gloo::BroadcastOptions opts(context_);
      opts.setRoot(root);
      opts.setOutput<uint8_t>(bytes, n);
      opts.setTag(tag);
      opts.setTimeout(context_->getTimeout());
      gloo::broadcast(opts);
      return absl::OkStatus();
    }
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kReduce: {
      const bool all = static_cast<CollectiveKind>(h.kind) == CollectiveKind::kAllReduce;
      FERRY_ASSIGN_OR_RETURN(internal::ReduceFn fn,
                             internal::reduce_function(dtype, static_cast<ReduceOp>(h.reduce_op), "stand-in"));
      if (all) {
        gloo::AllreduceOptions opts(context_);
        visit_dtype(dtype, [&]<typename T>() { opts.setOutput<T>(reinterpret_cast<T*>(bytes), static_cast<size_t>(h.numel)); });
        opts.setReduceFunction(fn);
        opts.setTag(tag);
        opts.setTimeout(context_->getTimeout());
        gloo::allreduce(opts);
        return absl::OkStatus();
      }
      FERRY_ASSIGN_OR_RETURN(Tensor out, Tensor::zeros({h.numel}, dtype));
      gloo::ReduceOptions opts(context_);
      visit_dtype(dtype, [&]<typename T>() {
        if (is_root) {
          opts.setOutput<T>(reinterpret_cast<T*>(bytes), static_cast<size_t>(h.numel));
        } else {
          opts.setInput<T>(reinterpret_cast<T*>(bytes), static_cast<size_t>(h.numel));
          opts.setOutput<T>(static_cast<T*>(out.data()), static_cast<size_t>(h.numel));
        }
      });
      opts.setRoot(root);
      opts.setReduceFunction(fn);
      opts.setTag(tag);
      opts.setTimeout(context_->getTimeout());
      gloo::reduce(opts);
      return absl::OkStatus();
    }
    case CollectiveKind::kAllGather: {
      std::vector<uint8_t> flat(n * static_cast<size_t>(world));
      gloo::AllgatherOptions opts(context_);
      opts.setInput<uint8_t>(bytes, n);
      opts.setOutput<uint8_t>(flat.data(), flat.size());
      opts.setTag(tag);
      opts.setTimeout(context_->getTimeout());
      gloo::allgather(opts);
      return absl::OkStatus();
    }
    case CollectiveKind::kGather: {
      std::vector<uint8_t> flat(is_root ? n * static_cast<size_t>(world) : 0);
      gloo::GatherOptions opts(context_);
      opts.setInput<uint8_t>(bytes, n);
      if (is_root) opts.setOutput<uint8_t>(flat.data(), flat.size());
      opts.setRoot(root);
      opts.setTag(tag);
      opts.setTimeout(context_->getTimeout());
      gloo::gather(opts);
      return absl::OkStatus();
    }
    case CollectiveKind::kScatter: {
      std::vector<std::vector<uint8_t>> parts;
      std::vector<uint8_t*> ptrs;
      if (is_root) {
        for (int r = 0; r < world; ++r) {
          parts.emplace_back(n);
          ptrs.push_back(parts.back().data());
        }
      }
      gloo::ScatterOptions opts(context_);
      if (is_root) opts.setInputs<uint8_t>(ptrs, n);
      opts.setOutput<uint8_t>(bytes, n);
      opts.setRoot(root);
      opts.setTag(tag);
      opts.setTimeout(context_->getTimeout());
      gloo::scatter(opts);
      return absl::OkStatus();
    }
    case CollectiveKind::kBarrier:
    case CollectiveKind::kAllGatherBytes:
      break;
  }
  return absl::OkStatus();
}

}  // namespace ferry
