# FindTensorpipe: Debian's libtensorpipe-dev ships TensorpipeTargets.cmake (an imported
# target named `tensorpipe`) but no TensorpipeConfig.cmake, so find_package cannot load it
# by itself. This module loads the targets file and adds the namespaced alias
# Tensorpipe::Tensorpipe.
include(FindPackageHandleStandardArgs)

find_file(Tensorpipe_TARGETS_FILE TensorpipeTargets.cmake
  PATHS /usr/share/cmake/Tensorpipe /usr/local/share/cmake/Tensorpipe
        ${CMAKE_PREFIX_PATH}
  PATH_SUFFIXES share/cmake/Tensorpipe)
find_path(Tensorpipe_INCLUDE_DIR tensorpipe/tensorpipe.h)

if(Tensorpipe_TARGETS_FILE AND NOT TARGET tensorpipe)
  include(${Tensorpipe_TARGETS_FILE})
endif()

find_package_handle_standard_args(Tensorpipe
  REQUIRED_VARS Tensorpipe_TARGETS_FILE Tensorpipe_INCLUDE_DIR)

if(Tensorpipe_FOUND AND NOT TARGET Tensorpipe::Tensorpipe)
  add_library(Tensorpipe::Tensorpipe INTERFACE IMPORTED)
  set_target_properties(Tensorpipe::Tensorpipe PROPERTIES INTERFACE_LINK_LIBRARIES tensorpipe)
endif()
mark_as_advanced(Tensorpipe_TARGETS_FILE Tensorpipe_INCLUDE_DIR)
