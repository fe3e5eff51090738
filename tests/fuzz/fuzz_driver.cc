// libFuzzer driver for one fuzz target, chosen at compile time with -DSPES_FUZZ_ENTRY=<function
// of fuzz_entries.h>. Built only by scripts/fuzz.sh (clang -fsanitize=fuzzer); the .cc suffix
// keeps it out of the normal test build, which globs tests/**/*.cpp.
#include "fuzz/fuzz_entries.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  spes::fuzz::SPES_FUZZ_ENTRY(data, size);
  return 0;
}
