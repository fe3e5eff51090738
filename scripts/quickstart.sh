#!/usr/bin/env bash
# The default job: installs what is missing (Debian packages, PyTorch into .venv/), builds the
# `spes` binary only (tests and benchmarks are scripts/test.sh's), extracts the built-in English
# corpus from Debian packages and tokenizes it, then trains the default model with SPES: a sync server and
# 4 nodes on localhost (`spes launch`), each training the shared weights plus 2 of the 8 experts
# of every layer and syncing every 20 steps. Ends with the cluster summary (bytes per round,
# peak RSS, whether every node held the same model after every sync), the validation loss next
# to the unigram baseline, and a generated sample. Extra arguments go to `spes launch`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
bash scripts/build.sh spes
bash scripts/prepare_default_data.sh
build/spes launch --config configs/default.yaml --out runs/default --overwrite "$@"
