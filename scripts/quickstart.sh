#!/usr/bin/env bash
# The default job: installs what is missing, builds, extracts the built-in English corpus from
# Debian packages, tokenizes it and trains the default model, ending with the validation loss
# next to the unigram baseline and a generated sample. Safe to rerun (finished steps are kept).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
bash scripts/build.sh
bash scripts/get_corpus.sh data/corpus
if [ ! -f data/bible-tokens/manifest.json ]; then
  build/spes prepare --input data/corpus/kjv.txt data/corpus/web.txt --vocab-size 8192 \
    --out data/bible-tokens
fi
build/spes train --config configs/default.yaml --out runs/default --resume none "$@"
