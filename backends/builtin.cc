// The built-in backends, one line each: the registry itself includes none of them.
#include "backends/backend_registry.h"
#include "backends/process_group/process_group_backend.h"
#include "backends/tensorpipe/tensorpipe_backend.h"

namespace ferry {

void register_builtin_backends() {
  static const bool done = [] {
    // Only a user registering one of these names first can make these fail; the user's wins.
    (void)register_backend(BackendType::TENSORPIPE.name, &construct_tensorpipe_options, &init_tensorpipe_backend);
    (void)register_backend(BackendType::PROCESS_GROUP.name, &construct_process_group_options,
                           &init_process_group_backend);
    return true;
  }();
  (void)done;
}

}  // namespace ferry
