// File: tests/testing/sanitizers.h
//
// Which sanitizer a test binary is built with, for the few tests whose bounds or
// conditions a sanitizer's runtime changes (it multiplies time and memory, and opens
// files of its own in its checks).
//
//   #ifdef FERRY_TEST_SANITIZED
//     GTEST_SKIP() << "why";
//   #endif
#pragma once

#if defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define FERRY_TEST_SANITIZED 1
#endif
#if __has_feature(thread_sanitizer)
#define FERRY_TEST_THREAD_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define FERRY_TEST_SANITIZED 1
#endif
#if defined(__SANITIZE_THREAD__)
#define FERRY_TEST_THREAD_SANITIZED 1
#endif
