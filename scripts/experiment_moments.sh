#!/usr/bin/env bash
# What storing AdamW's moments in bf16 or 8-bit block-wise form (optimizer.moment_dtype,
# train/adamw_moments.h) costs in validation loss, and what it saves: the centralized run of
# scripts/experiment_baselines.sh (configs/default.yaml shrunk to d_model 64, 4 layers, 8 experts
# top-2, vocabulary 2048, on data/bible-tokens-2k; STEPS steps of 16 sequences of 128 tokens)
# once per moment dtype and seed, at equal tokens. A seed fixes the initial model and the data
# order, so the runs of one seed are paired across dtypes. Then the moments' bytes per trainable
# parameter as the CPU memory meter measures them (build/bench/train_bench --moment-dtype, the
# d_model 256 shape), and scripts/experiment_moments_report.py writes docs/results/moments.md and
# puts it into docs/RESULTS.md. Runs already finished in OUT are kept (RERUN=1 runs them again).
# About 3 minutes per run on 2 idle cores (9 runs).
#   bash scripts/experiment_moments.sh
#   SEEDS="1" STEPS=100 OUT=/tmp/m DOC=/tmp/m/RESULTS.md bash scripts/experiment_moments.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/experiment_run.sh

STEPS=${STEPS:-1600}
EVAL=${EVAL:-160}
BATCH=${BATCH:-16}
VAL_WINDOWS=${VAL_WINDOWS:-128}
SEEDS=${SEEDS:-1 2 3}
DTYPES=${DTYPES:-fp32 bf16 int8}   # the first is the reference
VOCAB=${VOCAB:-2048}
DATA=${DATA:-data/bible-tokens-2k}
OUT=${OUT:-runs/experiment_moments}
DOC=${DOC:-docs/RESULTS.md}
SECTION=$(dirname "$DOC")/results/moments.md

[ -x build/spes ] && [ -x build/bench/train_bench ] || bash scripts/build.sh spes train_bench
prepare_bible_tokens build/spes "$DATA" "$VOCAB"
mkdir -p "$OUT" "$(dirname "$SECTION")"

runs=()
for seed in $SEEDS; do
  for dtype in $DTYPES; do
    dir=$OUT/$dtype/seed$seed
    runs+=("$dtype:$seed=$dir")
    if [ "${RERUN:-0}" != 1 ] && [ -f "$dir/wall_s" ]; then
      echo "== $dir: already finished (RERUN=1 to run it again)"
      continue
    fi
    cmd=(build/spes train --config configs/default.yaml --out "$dir" --resume none --no-summary
         --progress lines --set "max_duration=$STEPS" --set "eval_interval=$EVAL"
         --set "data.paths=[$DATA]" --set model.d_model=64 --set model.mlp_hidden_size=256
         --set "model.vocab_size=$VOCAB" --set "seed=$seed" --set threads=2
         --set "global_train_batch_size=$BATCH" --set "device_train_microbatch_size=$BATCH"
         --set "eval_batches=$((VAL_WINDOWS / BATCH))" --set "optimizer.moment_dtype=$dtype")
    echo "== $dir: ${cmd[*]}"
    mkdir -p "$dir"
    start=$(date +%s)
    "${cmd[@]}" > "$dir.log" 2>&1 || { echo "$dir failed; see $dir.log" >&2; tail -n 30 "$dir.log" >&2; exit 1; }
    echo $(( $(date +%s) - start )) > "$dir/wall_s"
    echo "   done in $(cat "$dir/wall_s") s"
  done
done

bytes=$OUT/moment_bytes.jsonl
: > "$bytes"
for dtype in $DTYPES; do
  build/bench/train_bench --name "moments-$dtype" --moment-dtype "$dtype" --d-model 256 \
    --layers 4 --heads 4 --hidden 512 --seq 256 --batch 8 --steps 1 --warmup 0 >> "$bytes"
done

python3 scripts/experiment_moments_report.py --steps "$STEPS" --batch "$BATCH" \
  --bytes "$bytes" --out "$SECTION" --doc "$DOC" "${runs[@]}"
