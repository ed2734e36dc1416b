// File: rpc/outgoing_call.h
//
// The call whose arguments are being written on this thread. call_async / call_sync
// open one around writing a request, so that a value which needs to know where it is
// going (an RRef, rpc/rref.h) can find out, and can keep itself alive until the reply.
//
//   internal::OutgoingCall call(agent, to);
//   Message request = internal::make_request<R>(fn, bytes, args...);   // RRefs consult call
//   auto keep = call.take_keep_alive();   // hold until the reply has arrived
//
// Scopes nest (the innermost is current) and belong to the thread that opened them.
#pragma once

#include <memory>
#include <vector>

namespace ferry {

class RpcAgent;

namespace internal {

class OutgoingCall {
 public:
  OutgoingCall(RpcAgent& agent, int to);
  ~OutgoingCall();
  OutgoingCall(const OutgoingCall&) = delete;
  OutgoingCall& operator=(const OutgoingCall&) = delete;

  RpcAgent& agent() const { return agent_; }
  // The worker id the call goes to.
  int to() const { return to_; }

  // Keeps `object` alive until the holder of take_keep_alive()'s result lets go.
  void keep_alive(std::shared_ptr<const void> object) { keep_alive_.push_back(std::move(object)); }
  std::vector<std::shared_ptr<const void>> take_keep_alive() { return std::move(keep_alive_); }

  // The innermost call open on this thread, or null.
  static OutgoingCall* current();

 private:
  RpcAgent& agent_;
  int to_;
  OutgoingCall* previous_;
  std::vector<std::shared_ptr<const void>> keep_alive_;
};

}  // namespace internal
}  // namespace ferry
