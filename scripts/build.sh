#!/usr/bin/env bash
# Configures and builds everything into build/ (Release, Ninja when available).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
if [ ! -f build/CMakeCache.txt ]; then
  cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
cmake --build build -j "$(nproc)"
