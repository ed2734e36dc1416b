// The built-in backends and transports, one line each: the registries themselves
// include none of them.
#include "agents/core/registry.h"
#include "agents/ring/factory.h"
#include "agents/tcp/factory.h"
#include "agents/tensorpipe/factory.h"
#include "backends/backend_registry.h"
#include "backends/process_group/process_group_backend.h"
#include "backends/tensorpipe/tensorpipe_backend.h"

namespace ferry {

void register_builtin_transports() {
  static const bool done = [] {
    // Only a user registering one of these names first can make these fail; the user's wins.
    (void)register_transport(ring_transport_entry());
    (void)register_transport(tcp_transport_entry());
    (void)register_transport(tensorpipe_transport_entry());
    return true;
  }();
  (void)done;
}

void register_builtin_backends() {
  static const bool done = [] {
    register_builtin_transports();
    // Only a user registering one of these names first can make these fail; the user's wins.
    (void)register_backend(BackendType::TENSORPIPE.name, &construct_tensorpipe_options, &init_tensorpipe_backend);
    (void)register_backend(BackendType::PROCESS_GROUP.name, &construct_process_group_options,
                           &init_process_group_backend);
    return true;
  }();
  (void)done;
}

}  // namespace ferry
