// Process facts (common/sysinfo.h): process_cpu_seconds against getrusage (an independent count
// of the same CPU time), for this process and for a child that burns a known amount of CPU, and
// its error for a process that no longer exists.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cmath>
#include <string>

#include "spes/common/error.h"
#include "spes/common/sysinfo.h"

namespace {

// Spins on this thread for about `seconds` of CPU time (as the thread's own clock counts it).
void burn_cpu(double seconds) {
  timespec start{}, now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &start);
  volatile double x = 1;
  do {
    for (int i = 0; i < 100000; ++i) x = std::sqrt(x + i);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  } while (static_cast<double>(now.tv_sec - start.tv_sec) +
               1e-9 * static_cast<double>(now.tv_nsec - start.tv_nsec) < seconds);
}

double rusage_seconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * t.tv_usec; };
  return s(ru.ru_utime) + s(ru.ru_stime);
}

}  // namespace

TEST(ProcessCpuSeconds, MatchesGetrusageForThisProcess) {
  const double before = spes::process_cpu_seconds(), before_ru = rusage_seconds();
  burn_cpu(0.3);
  const double used = spes::process_cpu_seconds() - before;
  const double used_ru = rusage_seconds() - before_ru;
  EXPECT_GE(used, 0.25);
  // /proc counts in clock ticks (10 ms), getrusage finer: a few ticks apart at most.
  EXPECT_NEAR(used, used_ru, 0.05);
  // This process named by its pid reads the same file's figures.
  EXPECT_NEAR(spes::process_cpu_seconds(getpid()), spes::process_cpu_seconds(), 0.05);
}

TEST(ProcessCpuSeconds, CountsAnotherProcessAndRefusesOneThatIsGone) {
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // burns 0.3 s of CPU, says so, then waits to be killed
    burn_cpu(0.3);
    const char c = 'x';
    if (write(ready[1], &c, 1) != 1) _exit(2);
    pause();
    _exit(0);
  }
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  const double used = spes::process_cpu_seconds(child);
  EXPECT_GE(used, 0.25);
  EXPECT_LT(used, 5.0);
  kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  close(ready[0]);
  close(ready[1]);
  try {
    spes::process_cpu_seconds(child);
    FAIL() << "a reaped process's CPU time was read";
  } catch (const spes::Error& e) {
    EXPECT_NE(std::string(e.what()).find("has the process exited?"), std::string::npos) << e.what();
  }
}
