#!/usr/bin/env bash
# Runs the training benchmarks of docs/PERFORMANCE.md on an otherwise idle machine and prints
# one JSON line each: three model sizes, the d_model 512 model with 3/4 of its experts frozen,
# and the same d_model 512 model in PyTorch eager (Debian's python3-torch, installed here).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/build.sh >/dev/null
B=build/bench/train_bench
$B --name d256 --d-model 256 --layers 4 --heads 4 --hidden 512 --seq 256 --batch 8
$B --name d512 --steps 5
$B --name d768 --d-model 768 --layers 8 --heads 12 --hidden 1536 --seq 256 --batch 8 --steps 3
$B --name d512-frozen75 --frozen-fraction 0.75 --steps 5
if ! /usr/bin/python3 -c "import torch" 2>/dev/null; then
  apt-get install -y -qq --no-install-recommends python3-torch >/dev/null
fi
/usr/bin/python3 bench/pytorch_eager_bench.py --steps 5
