// Runs the `spes` binary from a test with stdout and stderr captured separately.
#pragma once
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "data/data_test_util.h"
#include "python_reference.h"

namespace spes::interop_test {

struct CliResult {
  int code = -1;
  std::string out, err;
};

using spes::test::shell_quote;

inline std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// spes ARGS..., in the given scratch directory for the captured streams.
inline CliResult run_spes(const spes::test::TempDir& scratch, const std::vector<std::string>& args) {
  std::string cmd = shell_quote(SPES_BINARY);
  for (const auto& a : args) cmd += " " + shell_quote(a);
  const std::string out = scratch.file("cli.out"), err = scratch.file("cli.err");
  cmd += " > " + shell_quote(out) + " 2> " + shell_quote(err) + " < /dev/null";
  const int status = std::system(cmd.c_str());
  CliResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

}  // namespace spes::interop_test
