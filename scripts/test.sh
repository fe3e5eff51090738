#!/usr/bin/env bash
# Installs what the tests need (scripts/setup.sh --tests: the reference libraries from PyPI,
# chromium), builds everything and runs the whole test suite (CTest over GoogleTest).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --tests
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j 2 --timeout 900
