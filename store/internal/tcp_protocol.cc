#include "store/internal/tcp_protocol.h"

namespace ferry::internal::tcp_store {

std::string op_name(uint8_t op) {
  switch (static_cast<Op>(op)) {
    case Op::kHello: return "hello";
    case Op::kSet: return "set";
    case Op::kGet: return "get";
    case Op::kAdd: return "add";
    case Op::kCompareSet: return "compare_set";
    case Op::kCheck: return "check";
    case Op::kWait: return "wait";
    case Op::kDeleteKey: return "delete_key";
    case Op::kNumKeys: return "num_keys";
    case Op::kMultiGet: return "multi_get";
    case Op::kMultiSet: return "multi_set";
    case Op::kAuth: return "auth";
  }
  return "unknown op " + std::to_string(op);
}

}  // namespace ferry::internal::tcp_store
