// The project's own shared modules (libspes_sentencepiece.so, libspes_nccl.so): libraries that
// the binaries load with dlopen when a feature needs them, found next to the running executable,
// one or two folders above it (bin/ -> lib/), in the build tree or in the install prefix.
#pragma once
#include <string>

namespace spes {

struct SharedModule {
  std::string file;          // e.g. "libspes_nccl.so"
  std::string env_override;  // environment variable naming the file to use instead (may be empty)
  std::string build_path;    // where the build tree has it (may be empty)
  std::string install_path;  // where `cmake --install` puts it (may be empty)
};

// dlopen()s the first candidate that exists, with `flags`; throws spes::Error listing every
// path tried (and why each failed) and the fix when none loads.
void* open_shared_module(const SharedModule& module, int flags);

// The symbol `name` of a module opened above; throws when it is missing.
void* shared_module_symbol(void* handle, const SharedModule& module, const char* name);

}  // namespace spes
