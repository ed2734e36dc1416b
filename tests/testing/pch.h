// The headers nearly every test includes, compiled once per build and reused by every
// test binary (cmake/FerryHelpers.cmake, FERRY_TEST_PCH). Only the standard library and
// third-party headers that never change with ferry's sources: a ferry header here would
// recompile every test whenever it changed. Each test still includes what it uses, so a
// build with FERRY_TEST_PCH=OFF compiles the same sources.
#ifndef FERRY_TESTS_TESTING_PCH_H_
#define FERRY_TESTS_TESTING_PCH_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

#endif  // FERRY_TESTS_TESTING_PCH_H_
