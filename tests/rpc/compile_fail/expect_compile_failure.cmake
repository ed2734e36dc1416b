# Builds TARGET in BUILD_DIR and passes only if the build fails with EXPECT in its
# output (the static_assert message), so an unrelated error does not count.
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${TARGET}
  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(result EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled, but it must not")
endif()
string(FIND "${out}${err}" "${EXPECT}" found)
if(found EQUAL -1)
  message(FATAL_ERROR "${TARGET} failed to compile, but not with \"${EXPECT}\":\n${out}${err}")
endif()
message(STATUS "${TARGET} failed to compile as expected: ${EXPECT}")
