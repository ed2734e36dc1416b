#include "base/logging.h"

#include "gtest/gtest.h"

namespace ferry {
namespace {

TEST(Logging, ParsesLevels) {
  LogLevel level = LogLevel::kOff;
  EXPECT_TRUE(parse_log_level("DEBUG", &level));
  EXPECT_EQ(level, LogLevel::kDebug);
  EXPECT_TRUE(parse_log_level("warning", &level));
  EXPECT_EQ(level, LogLevel::kWarning);
  EXPECT_TRUE(parse_log_level("off", &level));
  EXPECT_EQ(level, LogLevel::kOff);
  EXPECT_FALSE(parse_log_level("loud", &level));
}

TEST(Logging, LevelFiltersLines) {
  set_log_level(LogLevel::kWarning);
  ::testing::internal::CaptureStderr();
  FERRY_LOG(INFO) << "hidden line";
  FERRY_LOG(WARNING) << "shown line " << 42;
  std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(out.find("hidden line"), std::string::npos);
  EXPECT_NE(out.find("shown line 42"), std::string::npos);
  EXPECT_NE(out.find("logging_test.cc"), std::string::npos);
}

TEST(Logging, LevelIsReadFromEnvironment) {
  // log_level() reads FERRY_LOG_LEVEL once per process, so check it in a freshly
  // exec'd child ("threadsafe" death tests re-run the binary).
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("FERRY_LOG_LEVEL", "error", 1);
        _exit(log_level() == LogLevel::kError ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(LoggingDeathTest, CheckAbortsWithMessage) {
  EXPECT_DEATH(FERRY_CHECK(1 + 1 == 3) << "arithmetic", "check failed: 1 \\+ 1 == 3 arithmetic");
}

}  // namespace
}  // namespace ferry
