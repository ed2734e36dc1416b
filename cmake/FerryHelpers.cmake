# ferry_add_library(NAME <folder> SRCS ... HDRS ... DEPS ... PRIVATE_DEPS ... [EXPORT set])
#
# Makes the library ferry_<folder>, aliased ferry::<folder>, modelled on Abseil's
# absl_cc_library. HDRS are public headers, installed under include/<folder>/ and
# included from the repo root ("tensor/tensor.h"). A dependency is PUBLIC (DEPS)
# only when a public header includes it; everything else goes in PRIVATE_DEPS.
# EXPORT names the install export set (default ferryTargets); an optional component
# has its own, loaded by ferryConfig.cmake only when the component is asked for.
function(ferry_add_library)
  cmake_parse_arguments(FAL "" "NAME;EXPORT" "SRCS;HDRS;DEPS;PRIVATE_DEPS" ${ARGN})
  if(NOT FAL_EXPORT)
    set(FAL_EXPORT ferryTargets)
  endif()
  set(_t ferry_${FAL_NAME})
  add_library(${_t} STATIC ${FAL_SRCS})
  add_library(ferry::${FAL_NAME} ALIAS ${_t})
  set_target_properties(${_t} PROPERTIES EXPORT_NAME ${FAL_NAME})
  target_sources(${_t} PUBLIC FILE_SET HEADERS BASE_DIRS ${PROJECT_SOURCE_DIR} FILES ${FAL_HDRS})
  target_compile_features(${_t} PUBLIC cxx_std_20)
  target_link_libraries(${_t} PUBLIC ${FAL_DEPS} PRIVATE ${FAL_PRIVATE_DEPS} ferry_warnings ferry_sanitize)
  if(FERRY_SANITIZE)
    # Consumers of a sanitized static library need the runtime at link time.
    target_link_options(${_t} INTERFACE -fsanitize=${FERRY_SANITIZE})
  endif()
  if(FERRY_INSTALL)
    install(TARGETS ${_t} EXPORT ${FAL_EXPORT}
      ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
      FILE_SET HEADERS DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ferry)
  endif()
endfunction()

# ferry_add_test(NAME <name> SRCS ... DEPS ... LABELS ... [TIMEOUT s] [NO_PCH])
#
# One gtest executable, every test discovered by gtest_discover_tests with the
# given ctest LABELS and a TIMEOUT (default 60 s), so a hang is a failure. It reuses the
# tests' precompiled header (tests/testing/pch.h) unless FERRY_TEST_PCH is off or the
# test says NO_PCH (one built with other flags, such as libtorch's, cannot reuse it).
function(ferry_add_test)
  cmake_parse_arguments(FAT "NO_PCH" "NAME;TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  if(NOT FAT_TIMEOUT)
    set(FAT_TIMEOUT 60)
  endif()
  add_executable(${FAT_NAME} ${FAT_SRCS})
  target_link_libraries(${FAT_NAME} PRIVATE ${FAT_DEPS} ferry_testing GTest::gmock GTest::gtest_main
    ferry_warnings ferry_sanitize)
  if(TARGET ferry_test_pch AND NOT FAT_NO_PCH)
    target_precompile_headers(${FAT_NAME} REUSE_FROM ferry_test_pch)
  endif()
  gtest_discover_tests(${FAT_NAME}
    PROPERTIES TIMEOUT ${FAT_TIMEOUT}
    DISCOVERY_TIMEOUT 60)
  # Labels go in through a ctest script of their own: gtest_discover_tests (CMake 3.25)
  # splits list-valued PROPERTIES, so "store;unit" applied only "store" and read "unit"
  # as a property name. The script runs after discovery's, which defines <name>_TESTS.
  set(_labels_file "${CMAKE_CURRENT_BINARY_DIR}/${FAT_NAME}_labels.cmake")
  file(WRITE "${_labels_file}"
    "if(${FAT_NAME}_TESTS)\n"
    "  set_tests_properties(\${${FAT_NAME}_TESTS} PROPERTIES LABELS \"${FAT_LABELS}\")\n"
    "endif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${_labels_file}")
endfunction()
