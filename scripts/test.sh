#!/usr/bin/env bash
# Builds and runs the whole test suite (CTest over GoogleTest).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j 2 --timeout 900
