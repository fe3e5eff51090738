// Runs the tests' Python reference scripts (tests/**/*.py) with the project's interpreter,
// .venv/bin/python, which scripts/setup.sh --tests fills with the independent references from
// PyPI: PyTorch, Hugging Face tokenizers and transformers, python-xxhash. A missing interpreter,
// a missing package or a failing script is a test failure naming the fix, never a skip.
#pragma once
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace spes::test {

inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// stdout of `python SCRIPT ARGS...` (SCRIPT relative to tests/); throws with the script's
// stderr when it fails.
inline std::string run_python_reference(const std::string& script,
                                        const std::vector<std::string>& args) {
  namespace fs = std::filesystem;
  const std::string python = SPES_PYTHON;
  if (!fs::exists(python))
    throw std::runtime_error("reference interpreter " + python +
                             " is missing: run bash scripts/setup.sh --tests");
  const fs::path err = fs::temp_directory_path() /
                       ("spes_pyref_" + std::to_string(::getpid()) + "_" +
                        std::to_string(reinterpret_cast<uintptr_t>(&args)) + ".err");
  std::string cmd = shell_quote(python) + " " +
                    shell_quote(std::string(SPES_SOURCE_DIR) + "/tests/" + script);
  for (const auto& a : args) cmd += " " + shell_quote(a);
  cmd += " 2> " + shell_quote(err.string());
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) throw std::runtime_error("cannot start " + cmd);
  std::string out;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  std::stringstream stderr_text;
  stderr_text << std::ifstream(err).rdbuf();
  std::error_code ec;
  fs::remove(err, ec);
  if (status != 0) {
    std::string e = stderr_text.str();
    if (e.size() > 4000) e = "..." + e.substr(e.size() - 4000);
    std::string hint;
    if (e.find("ModuleNotFoundError") != std::string::npos)
      hint = " (a reference package is missing: run bash scripts/setup.sh --tests)";
    throw std::runtime_error("reference script tests/" + script + " failed" + hint + ":\n" + e);
  }
  return out;
}

}  // namespace spes::test
