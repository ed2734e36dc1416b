// The thread-role marks (see thread_role.h).
#include "base/thread_role.h"

namespace ferry::internal {
namespace {

thread_local bool agent_thread = false;
thread_local bool transport_thread = false;
thread_local bool inline_serving = false;
thread_local bool user_driving = false;

}  // namespace

void set_on_agent_thread(bool on) { agent_thread = on; }
bool on_agent_thread() { return agent_thread; }
void set_on_transport_thread(bool on) { transport_thread = on; }
bool on_transport_thread() { return transport_thread; }
void set_serving_inline(bool on) { inline_serving = on; }
bool serving_inline() { return inline_serving; }
void set_driving_for_user(bool on) { user_driving = on; }
bool driving_for_user() { return user_driving; }

}  // namespace ferry::internal
