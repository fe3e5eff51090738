#!/usr/bin/env bash
# Configures build/ (Release, Ninja, against the libtorch in .venv/ that scripts/setup.sh
# installs) and builds the given targets, or everything (library, `spes`, tests, benchmarks)
# when none are given. Example: scripts/build.sh spes   (only what the default job runs)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  echo "error: .venv/ with PyTorch is missing; run: bash scripts/setup.sh" >&2
  exit 1
fi
if [ ! -f build/CMakeCache.txt ]; then
  gen=()
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  launcher=()
  command -v ccache >/dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S . -B build "${gen[@]}" "${launcher[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build build -j "$(nproc)" "${targets[@]}"
