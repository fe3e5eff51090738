#!/usr/bin/env bash
# The five-arm experiment of SPES.md section 4 on the built-in corpus, at equal total tokens:
#   centralized   one node, everything trainable, batch NODES x NODE_BATCH
#   fedavg        NODES nodes train everything; the server averages everything
#   diloco        fedavg + an outer Nesterov step (outer lr 0.7, momentum 0.9)
#   spes-nomerge  NODES nodes train the shared tensors + their own experts; no merging
#   spes-merge    the same with the expert-merging warm-up
# Every arm runs STEPS optimizer steps with the same learning-rate schedule and evaluates the
# same VAL_WINDOWS validation windows every EVAL steps. Then it draws the curves (`spes plot`),
# tabulates loss, memory and bytes next to the SPES.md formulas (`spes compare`) and writes
# docs/RESULTS.md (keeping the section scripts/experiment_wan.sh wrote, docs/results/wan.md).
# Arms already finished in OUT are kept (RERUN=1 runs them again).
# The model is the default config's at half width (MODEL="d_model=128 mlp_hidden_size=512",
# experts of hidden size F 256: 5.5M parameters, 8 experts per layer), so that the five arms fit
# in well under an hour on 2 cores; MODEL="" runs the default width.
#   bash scripts/experiment_baselines.sh
#   STEPS=20 EVAL=10 SYNC=10 MERGE_INTERVAL=10 OUT=/tmp/x DOC=/tmp/x/RESULTS.md \
#     bash scripts/experiment_baselines.sh   # a quick smoke run
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

STEPS=${STEPS:-160}          # optimizer steps per node
NODES=${NODES:-4}
NODE_BATCH=${NODE_BATCH:-4}  # sequences per step per node (centralized: NODES x NODE_BATCH)
SYNC=${SYNC:-20}             # steps between syncs
EVAL=${EVAL:-40}             # steps between validation passes
VAL_WINDOWS=${VAL_WINDOWS:-128}
MERGE_INTERVAL=${MERGE_INTERVAL:-40}
MERGE_ALPHA=${MERGE_ALPHA:-0.05}
MERGE_DECAY=${MERGE_DECAY:-$((2 * STEPS))}
MERGE_TOPK=${MERGE_TOPK:-4}
MODEL=${MODEL-d_model=128 mlp_hidden_size=512}
THREADS=${THREADS:-1}        # intra-op threads per process (cluster arms: NODES processes)
OUT=${OUT:-runs/experiment}
DOC=${DOC:-docs/RESULTS.md}
FIGS=$(dirname "$DOC")/results  # charts, linked from DOC as results/...
CONFIG=configs/default.yaml
ARMS=(centralized fedavg diloco spes-nomerge spes-merge)

[ -x build/spes ] || bash scripts/build.sh
bash scripts/prepare_default_data.sh
mkdir -p "$OUT"

common=(--set "max_duration=$STEPS" --set "eval_interval=$EVAL" --set "threads=$THREADS")
for kv in $MODEL; do common+=(--set "model.$kv"); done
cluster=(--set "global_train_batch_size=$NODE_BATCH" --set "device_train_microbatch_size=$NODE_BATCH"
         --set "eval_batches=$((VAL_WINDOWS / NODE_BATCH))" --set "spes_config.sync_steps=$SYNC"
         --set "spes_config.num_peers=$NODES")
central_batch=$((NODES * NODE_BATCH))

arm_args() {  # the command line of one arm
  case "$1" in
    centralized) echo build/spes train --config "$CONFIG" --out "$OUT/centralized" --resume none \
                   --no-summary --progress lines "${common[@]}" \
                   --set "global_train_batch_size=$central_batch" \
                   --set "device_train_microbatch_size=$central_batch" \
                   --set "eval_batches=$((VAL_WINDOWS / central_batch))" ;;
    fedavg|diloco) echo build/spes launch --config "$CONFIG" --nodes "$NODES" --out "$OUT/$1" \
                   --overwrite "${common[@]}" "${cluster[@]}" --set "spes_config.mode=$1" ;;
    spes-nomerge) echo build/spes launch --config "$CONFIG" --nodes "$NODES" --out "$OUT/$1" \
                   --overwrite "${common[@]}" "${cluster[@]}" --set spes_config.mode=spes \
                   --set spes_config.merge_interval=0 ;;
    spes-merge) echo build/spes launch --config "$CONFIG" --nodes "$NODES" --out "$OUT/$1" \
                   --overwrite "${common[@]}" "${cluster[@]}" --set spes_config.mode=spes \
                   --set "spes_config.merge_interval=$MERGE_INTERVAL" \
                   --set "spes_config.merge_alpha_start=$MERGE_ALPHA" \
                   --set "spes_config.merge_decay_steps=$MERGE_DECAY" \
                   --set "spes_config.merge_topk=$MERGE_TOPK" ;;
  esac
}

finished() {  # an arm counts as done when its last metrics line reached STEPS
  local f="$OUT/$1/metrics.jsonl"
  [ "$1" = centralized ] || f="$OUT/$1/summary.json"
  [ -f "$f" ] || return 1
  [ "$1" != centralized ] && return 0
  tail -n 1 "$f" | grep -q "\"step\":$STEPS[,}]"
}

for arm in "${ARMS[@]}"; do
  if [ "${RERUN:-0}" != 1 ] && finished "$arm"; then
    echo "== $arm: already finished in $OUT/$arm (RERUN=1 to run it again)"
    continue
  fi
  echo "== $arm: $(arm_args "$arm")"
  start=$(date +%s)
  # shellcheck disable=SC2046  # arm_args prints words without spaces inside them
  $(arm_args "$arm") > "$OUT/$arm.log" 2>&1 || { echo "$arm failed; see $OUT/$arm.log" >&2; tail -n 30 "$OUT/$arm.log" >&2; exit 1; }
  echo "   done in $(( $(date +%s) - start )) s"
done

dirs=()
for arm in "${ARMS[@]}"; do dirs+=("$OUT/$arm"); done
labels=$(IFS=,; echo "${ARMS[*]}")
mkdir -p "$FIGS"
build/spes plot "${dirs[@]}" --labels "$labels" --metric val_loss --out "$FIGS/val_loss.svg"
build/spes plot "${dirs[@]}" --labels "$labels" --metric loss --smooth 20 \
  --out "$FIGS/train_loss.svg"
build/spes plot "$OUT/spes-merge" --out "$FIGS/spes-merge"
table=$(build/spes compare "${dirs[@]}" --labels "$labels")

{
  cat <<DOC
# Results: SPES against its baselines on the built-in corpus

Generated by \`bash scripts/experiment_baselines.sh\` on $(date -u +%Y-%m-%d) ($(nproc) CPU cores,
$(build/spes --version 2>/dev/null || echo spes)); every figure below comes from the run directories
in \`$OUT/\` (\`spes compare\` and \`spes plot\` on them reproduce the table and the charts).

## Setup

- Model: \`$CONFIG\` with \`${MODEL:-no changes}\` (OLMoE-style MoE, 4 layers, 8 experts top-2,
  vocabulary 8192, sequence 128), trained on the King James + World English Bibles tokenized by
  \`spes prepare\` (the default job's data).
- Equal total tokens: every arm runs $STEPS optimizer steps of $central_batch sequences in all
  (centralized: one node with batch $central_batch; the others: $NODES nodes with batch $NODE_BATCH each,
  each node on its own part of the data), the same warm-up + cosine schedule, and is evaluated on
  the same $VAL_WINDOWS held-out windows every $EVAL steps (the cluster curve is the mean over nodes).
- Sync every $SYNC steps ($((STEPS / SYNC)) rounds), fp32 transfers, equal weights. DiLoCo: outer lr
  0.7, momentum 0.9. SPES: node i owns experts [2i, 2i+2) of every layer. Merging (spes-merge
  only): a merge at the first sync at or after every $MERGE_INTERVAL steps, alpha = $MERGE_ALPHA x
  max(0, 1 - t/$MERGE_DECAY), K = $MERGE_TOPK donors.

## Validation loss against tokens

![validation loss against tokens](results/val_loss.svg)

Training loss (moving average over 20 steps, mean over nodes): [results/train_loss.svg](results/train_loss.svg).
Expert similarity and round statistics of the merging arm: [results/spes-merge/](results/spes-merge/).

## Loss, memory and bytes per node

$table

Measured figures come from the runs: peak RSS from each node's metrics (the largest node),
gradient + AdamW bytes measured on the tensors at the first step, bytes per round as sent and
received by node 0 (merge rounds separately). In brackets, the SPES.md formula for the same
config: gradient + AdamW = 12 bytes x trainable values (S + X/N for SPES, P otherwise); upload
S + X/N values, download P - X/N (P in merge rounds, when merging changed the node's own
experts), P each way for FedAvg and DiLoCo; the rest is the safetensors header of each stream.
DOC
  if [ -f "$FIGS/notes.md" ]; then printf '\n'; cat "$FIGS/notes.md"; fi
  # The WAN trade-off section of scripts/experiment_wan.sh, kept when this part is regenerated.
  if [ -f "$FIGS/wan.md" ]; then printf '\n'; cat "$FIGS/wan.md"; fi
} > "$DOC"
echo "wrote $DOC"
