#!/usr/bin/env bash
# The built-in corpus, ready to train on: extracts the two public-domain Bibles from Debian
# packages (scripts/get_corpus.sh) and tokenizes them into data/bible-tokens (a SentencePiece
# model of 8192 pieces trained on the text, uint16 shards). Skips what is already there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/get_corpus.sh data/corpus
if [ ! -f data/bible-tokens/manifest.json ]; then
  build/spes prepare --input data/corpus/kjv.txt data/corpus/web.txt --vocab-size 8192 \
    --out data/bible-tokens
fi
