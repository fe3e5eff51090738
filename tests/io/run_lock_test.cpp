// The run directory's lock (io/run_lock.h): a second writer is refused naming the holder's
// PID and command line, the lock is free again once its holder is gone (also when it is
// killed), and holder() reports a live holder only. Processes: a forked child holds the lock.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "data/data_test_util.h"
#include "spes/common/error.h"
#include "spes/io/run_lock.h"

using namespace spes;
using ::testing::HasSubstr;

namespace {

std::string refusal(const std::string& dir) {
  try {
    RunDirLock again(dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(RunDirLock, ASecondWriterIsRefusedWithTheHoldersPidAndCommandLine) {
  test::TempDir tmp;
  const std::string dir = tmp.file("run");
  EXPECT_FALSE(RunDirLock::holder(dir));  // no directory yet
  {
    RunDirLock lock(dir);
    const auto h = RunDirLock::holder(dir);
    ASSERT_TRUE(h);
    EXPECT_EQ(h->pid, ::getpid());
    EXPECT_THAT(h->command, HasSubstr("spes_tests"));
    const std::string why = refusal(dir);
    EXPECT_THAT(why, HasSubstr("'" + dir + "' is being written by process " +
                               std::to_string(::getpid())));
    EXPECT_THAT(why, HasSubstr("spes_tests"));
    EXPECT_THAT(why, HasSubstr("choose another --out"));
  }
  EXPECT_FALSE(RunDirLock::holder(dir));  // released with its holder
  EXPECT_EQ(refusal(dir), "");
}

TEST(RunDirLock, AKilledHolderLeavesTheDirectoryFree) {
  test::TempDir tmp;
  const std::string dir = tmp.file("run");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    RunDirLock lock(dir);
    (void)!::write(ready[1], "x", 1);
    ::pause();
    ::_exit(0);
  }
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  const auto h = RunDirLock::holder(dir);
  ASSERT_TRUE(h);
  EXPECT_EQ(h->pid, child);
  EXPECT_THAT(refusal(dir), HasSubstr("process " + std::to_string(child)));
  ::kill(child, SIGKILL);
  int st;
  ::waitpid(child, &st, 0);
  ::close(ready[0]);
  ::close(ready[1]);
  EXPECT_FALSE(RunDirLock::holder(dir));
  EXPECT_EQ(refusal(dir), "");
}

}  // namespace
