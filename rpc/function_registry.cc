#include "rpc/function_registry.h"

#include <atomic>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "base/status.h"
#include "serialization/error.h"

namespace ferry {

struct FunctionRegistry::Impl {
  mutable absl::Mutex mu;
  absl::flat_hash_map<std::string, std::shared_ptr<const RegisteredFunction>> functions ABSL_GUARDED_BY(mu);
  // How many of them are served inline: while none is, a request needs no lookup to
  // know it goes to the pool.
  std::atomic<int> inline_functions{0};
};

FunctionRegistry::FunctionRegistry() : impl_(std::make_unique<Impl>()) {}
FunctionRegistry::~FunctionRegistry() = default;

FunctionRegistry& FunctionRegistry::global() {
  static FunctionRegistry* registry = new FunctionRegistry();  // never destroyed: used until exit
  return *registry;
}

absl::Status FunctionRegistry::add(std::string name, RegisteredFunction function) {
  if (name.empty()) return absl::InvalidArgumentError("register_function: the name is empty");
  if (absl::StartsWith(name, kReservedFunctionPrefix)) {
    return absl::InvalidArgumentError(absl::StrCat("register_function: \"", name, "\": names starting with \"",
                                                   kReservedFunctionPrefix, "\" are reserved for ferry itself"));
  }
  absl::MutexLock lock(&impl_->mu);
  auto [it, inserted] = impl_->functions.try_emplace(name, nullptr);
  if (!inserted) {
    return absl::AlreadyExistsError(absl::StrCat("register_function: a function named \"", name,
                                                 "\" is already registered with signature ", it->second->signature));
  }
  if (function.serving == Serving::kInline) impl_->inline_functions.fetch_add(1, std::memory_order_release);
  it->second = std::make_shared<const RegisteredFunction>(std::move(function));
  return absl::OkStatus();
}

bool FunctionRegistry::remove(std::string_view name) {
  absl::MutexLock lock(&impl_->mu);
  auto it = impl_->functions.find(internal::av(name));
  if (it == impl_->functions.end()) return false;
  if (it->second->serving == Serving::kInline) impl_->inline_functions.fetch_sub(1, std::memory_order_release);
  impl_->functions.erase(it);
  return true;
}

bool FunctionRegistry::has_inline_functions() const {
  return impl_->inline_functions.load(std::memory_order_acquire) > 0;
}

std::shared_ptr<const RegisteredFunction> FunctionRegistry::find(std::string_view name) const {
  absl::ReaderMutexLock lock(&impl_->mu);
  auto it = impl_->functions.find(internal::av(name));
  return it == impl_->functions.end() ? nullptr : it->second;
}

absl::StatusOr<std::shared_ptr<const RegisteredFunction>> find_function(const FunctionRegistry& registry,
                                                                        std::string_view self,
                                                                        std::string_view name,
                                                                        std::string_view signature) {
  std::shared_ptr<const RegisteredFunction> fn = registry.find(name);
  if (fn == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(internal::av(self), ": no function named \"", internal::av(name), "\" is registered"));
  }
  if (fn->signature != signature) {
    return absl::InvalidArgumentError(absl::StrCat(internal::av(self), ": function \"", internal::av(name),
                                                   "\" has signature ", fn->signature,
                                                   " but the call was made with signature ", internal::av(signature)));
  }
  return fn;
}

namespace {

// A request's function name and signature, viewed where they lie in the payload (not
// copied); `reader` is left at the arguments.
absl::Status read_call_header(PayloadReader& reader, std::string_view& name, std::string_view& signature) {
  auto read_view = [&reader](std::string_view& out) {
    uint64_t size = 0;
    reader(cereal::make_size_tag(size));
    reader.check_size(size, 1);
    out = std::string_view(reader.position(), size);
    reader.skip(size);
  };
  return read_guarded("call header", [&] {
    read_view(name);
    read_view(signature);
  });
}

// Serves kSignatureOfFunction: the signature of the function named in its argument.
Message signature_of(const FunctionRegistry& registry, const std::string& self, std::string_view signature,
                     PayloadReader& reader, uint64_t id) {
  constexpr char kOwnSignature[] = "(string) -> string";
  if (signature != kOwnSignature) {
    return make_error_message(
        id, self,
        absl::InvalidArgumentError(absl::StrCat(self, ": function \"", kSignatureOfFunction, "\" has signature ",
                                                kOwnSignature, " but the call was made with signature ",
                                                internal::av(signature))));
  }
  std::string name;
  absl::Status read = read_guarded("arguments", [&] { reader(name); });
  if (!read.ok()) return make_error_message(id, self, absl::InvalidArgumentError(absl::StrCat(self, ": ", read.message())));
  std::shared_ptr<const RegisteredFunction> fn = registry.find(name);
  if (fn == nullptr) {
    return make_error_message(
        id, self, absl::NotFoundError(absl::StrCat(self, ": no function named \"", name, "\" is registered")));
  }
  Message response(MessageType::kResponse, id);
  PayloadWriter writer(response);
  writer(fn->signature);
  return response;
}

}  // namespace

bool serves_inline(const FunctionRegistry& registry, const Message& request) {
  if (!registry.has_inline_functions()) return false;
  PayloadReader reader(request);
  std::string_view name, signature;
  if (!read_call_header(reader, name, signature).ok()) return false;  // the pool reports it
  std::shared_ptr<const RegisteredFunction> fn = registry.find(name);
  return fn != nullptr && fn->serving == Serving::kInline;
}

Message dispatch_request(const FunctionRegistry& registry, std::string_view self_name, const Message& request) {
  std::string self(self_name);
  PayloadReader reader(request);
  std::string_view name, signature;
  absl::Status header = read_call_header(reader, name, signature);
  if (!header.ok()) {
    return make_error_message(request.id(), self, absl::InvalidArgumentError(absl::StrCat(self, ": ", header.message())));
  }
  if (name == kSignatureOfFunction) return signature_of(registry, self, signature, reader, request.id());
  absl::StatusOr<std::shared_ptr<const RegisteredFunction>> fn = find_function(registry, self, name, signature);
  if (!fn.ok()) return make_error_message(request.id(), self, fn.status());
  Message response(MessageType::kResponse, request.id());
  absl::Status s = run_function_guarded(self, name, [&] {
    if ((*fn)->serving != Serving::kInline) return (*fn)->invoke(reader, response);
    // The same rules wherever it runs: a request that arrived before this worker was
    // ready went to the pool, and must not be able to do what an inline one cannot.
    internal::InlineServingScope scope;
    return (*fn)->invoke(reader, response);
  });
  if (!s.ok()) return make_error_message(request.id(), self, s);
  return response;
}

}  // namespace ferry
