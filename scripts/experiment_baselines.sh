#!/usr/bin/env bash
# SPES against its baselines and its own ablations on the built-in corpus, at equal total
# tokens, with paired seeds, in two data regimes; writes docs/RESULTS.md.
#
# Arms (every cluster arm: NODES nodes of NODE_BATCH sequences per step, sync every SYNC steps):
#   centralized      one node, everything trainable, batch NODES x NODE_BATCH
#   centralized-lr-double  the same with the peak learning rate doubled
#   fedavg           every node trains everything; the server averages everything
#   diloco           fedavg + DiLoCo's outer Nesterov step (outer lr 0.7, momentum 0.9)
#   diloco-mild      the same with outer lr 1.0, momentum 0.5
#   spes-nomerge     SPES: the shared tensors + the node's own experts; no merging
#   spes-merge-a0.01 SPES with the merging warm-up as the paper runs it: a merge every 5 sync
#   spes-merge-a0.05   rounds, alpha from a0 decaying to 0 by 20% of training, K = E/4 donors
#                      (the reference's 4 of 16 experts, scaled)
#   spes-outer       SPES + the outer step (lr 1.0, momentum 0.5) on the shared tensors
#   spes-sync5       SPES synced every 5 steps (4x the rounds)
#   spes-lr-half     SPES with the peak learning rate halved and the warm-up 4x longer (a node's
#                    batch is a quarter of the centralized one)
#   spes-lr-double   SPES with the peak learning rate doubled
#   spes-overlap-k2  SPES with overlapping rounds (spes_config.overlap): a node trains on while
#   spes-overlap-k10   its round is in flight and applies the published model plus its progress
#                      since the upload exactly K steps after the upload (overlap_delay_steps:
#                      bit-reproducible, as a round that takes K steps' time)
# Data regimes: "whole" (every node samples the whole corpus in its own seeded order: the
# reference's behaviour) and "split" (data.split_across_nodes: each node on its own disjoint
# quarter). Seeds: cfg.seed sets the initial model and every node's data order; arm X with seed s
# and arm Y with seed s start from the same model, so arms are compared seed by seed.
#
# The model is the default job's (OLMoE-style, 4 layers, 8 experts top-2, sequence 128) shrunk so
# that the runs fit on 2 CPU cores: d_model 64, experts of F 128, a 2048-piece vocabulary
# trained by `spes prepare` on the same text (data/bible-tokens-2k). Runs already finished in
# OUT are kept (RERUN=1 runs them again). Each run's wall time is kept in its directory
# (wall_s) and the total is stated in the document.
#   bash scripts/experiment_baselines.sh
#   STEPS=40 EVAL=20 SYNC=10 SEEDS="1 2" WHOLE_ARMS="fedavg spes-nomerge" SPLIT_ARMS=fedavg \
#     OUT=/tmp/x DOC=/tmp/x/RESULTS.md bash scripts/experiment_baselines.sh   # a quick smoke run
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/experiment_run.sh

STEPS=${STEPS:-1600}         # optimizer steps per node
NODES=${NODES:-4}
NODE_BATCH=${NODE_BATCH:-4}  # sequences per step per node (centralized: NODES x NODE_BATCH)
SYNC=${SYNC:-20}             # steps between syncs
EVAL=${EVAL:-160}            # steps between validation passes (never a merge step, see below)
VAL_WINDOWS=${VAL_WINDOWS:-128}
SEEDS=${SEEDS:-1 2 3}
WHOLE_ARMS=${WHOLE_ARMS:-fedavg spes-nomerge spes-merge-a0.01 spes-merge-a0.05 diloco diloco-mild spes-outer spes-lr-double spes-overlap-k2 spes-overlap-k10}
SPLIT_ARMS=${SPLIT_ARMS:-fedavg spes-nomerge}
# Exploratory arms, run with the first seed only (REGIME/ARM) and reported apart.
EXPLORE_ARMS=${EXPLORE_ARMS:-whole/spes-sync5 whole/spes-lr-half split/spes-merge-a0.01}
CENTRAL_ARMS=${CENTRAL_ARMS:-centralized centralized-lr-double}  # the first is the reference
VOCAB=${VOCAB:-2048}
MODEL=${MODEL-d_model=64 mlp_hidden_size=256 vocab_size=$VOCAB}
DATA=${DATA:-data/bible-tokens-2k}
OUT=${OUT:-runs/experiment}
DOC=${DOC:-docs/RESULTS.md}
FIGS=$(dirname "$DOC")/results  # charts, linked from DOC as results/...
CONFIG=configs/default.yaml
EXPERTS=$(awk '/^  moe_num_experts:/ {print $2}' "$CONFIG")
MERGE_INTERVAL=$((5 * SYNC))   # every 5 sync rounds
MERGE_DECAY=$((STEPS / 5))     # alpha reaches 0 at 20% of training
MERGE_TOPK=$((EXPERTS / 4))

[ -x build/spes ] || bash scripts/build.sh spes
prepare_bible_tokens build/spes "$DATA" "$VOCAB"
mkdir -p "$OUT"
# An evaluation right after a merge measures the merge's transient, not the training: refuse it.
for ((s = MERGE_INTERVAL; s < MERGE_DECAY; s += MERGE_INTERVAL)); do
  if (( s % EVAL == 0 )); then
    echo "EVAL=$EVAL evaluates at step $s, right after a merge; pick another EVAL" >&2; exit 2
  fi
done

common=(--set "max_duration=$STEPS" --set "eval_interval=$EVAL" --set "data.paths=[$DATA]")
for kv in $MODEL; do common+=(--set "model.$kv"); done
cluster=(--set "global_train_batch_size=$NODE_BATCH" --set "device_train_microbatch_size=$NODE_BATCH"
         --set "eval_batches=$((VAL_WINDOWS / NODE_BATCH))" --set "spes_config.sync_steps=$SYNC"
         --set "spes_config.num_peers=$NODES" --set threads=1 --set spes_config.mode=spes
         --set spes_config.merge_interval=0)
central_batch=$((NODES * NODE_BATCH))
lr=$(awk '/^  learning_rate:/ {print $2}' "$CONFIG")
warmup=$(awk '/^  t_warmup:/ {print $2}' "$CONFIG")

arm_settings() {  # the settings that make an arm, on top of `cluster`
  case "$1" in
    fedavg) echo spes_config.mode=fedavg ;;
    diloco) echo spes_config.mode=diloco spes_config.outer_lr=0.7 spes_config.outer_momentum=0.9 ;;
    diloco-mild) echo spes_config.mode=diloco spes_config.outer_lr=1.0 spes_config.outer_momentum=0.5 ;;
    spes-nomerge) ;;
    spes-merge-a*) echo "spes_config.merge_interval=$MERGE_INTERVAL" \
                     "spes_config.merge_alpha_start=${1#spes-merge-a}" \
                     "spes_config.merge_decay_steps=$MERGE_DECAY" "spes_config.merge_topk=$MERGE_TOPK" ;;
    spes-outer) echo spes_config.outer_step=true spes_config.outer_lr=1.0 spes_config.outer_momentum=0.5 ;;
    spes-sync5) echo spes_config.sync_steps=5 ;;
    spes-overlap-k*) echo spes_config.overlap=true "spes_config.overlap_delay_steps=${1#spes-overlap-k}" ;;
    spes-lr-half) echo "optimizer.learning_rate=$(awk "BEGIN {print $lr / 2}")" \
                       "scheduler.t_warmup=$((4 * warmup))" ;;
    spes-lr-double|centralized-lr-double) echo "optimizer.learning_rate=$(awk "BEGIN {print $lr * 2}")" ;;
    centralized) ;;
    *) echo "unknown arm '$1'" >&2; return 1 ;;
  esac
}

run() {  # run REGIME ARM SEED: one run into OUT/REGIME/ARM/seedSEED (centralized: OUT/centralized)
  local regime=$1 arm=$2 seed=$3 dir cmd
  local kv
  if [[ "$arm" == centralized* ]]; then
    dir=$OUT/$arm/seed$seed
    cmd=(build/spes train --config "$CONFIG" --out "$dir" --resume none --no-summary
         --progress lines "${common[@]}" --set "seed=$seed" --set threads=2
         --set "global_train_batch_size=$central_batch"
         --set "device_train_microbatch_size=$central_batch"
         --set "eval_batches=$((VAL_WINDOWS / central_batch))")
  else
    dir=$OUT/$regime/$arm/seed$seed
    cmd=(build/spes launch --config "$CONFIG" --nodes "$NODES" --out "$dir" --overwrite
         "${common[@]}" "${cluster[@]}" --set "seed=$seed")
    [ "$regime" = split ] && cmd+=(--set data.split_across_nodes=true)
  fi
  for kv in $(arm_settings "$arm"); do cmd+=(--set "$kv"); done
  run_once "$dir" "${cmd[@]}"
}

for a in $CENTRAL_ARMS $WHOLE_ARMS $SPLIT_ARMS; do arm_settings "$a" > /dev/null; done  # typos fail first
for a in $EXPLORE_ARMS; do arm_settings "${a#*/}" > /dev/null; done
for seed in $SEEDS; do  # seed by seed, so that a stopped experiment has every arm at some seeds
  for arm in $CENTRAL_ARMS; do run - "$arm" "$seed"; done
  for arm in $WHOLE_ARMS; do run whole "$arm" "$seed"; done
  for arm in $SPLIT_ARMS; do run split "$arm" "$seed"; done
done
first=$(echo "$SEEDS" | awk '{print $1}')
for a in $EXPLORE_ARMS; do run "${a%%/*}" "${a#*/}" "$first"; done

# --- the document --------------------------------------------------------------------------
seed_dirs() { local d="" s; for s in $SEEDS; do d+="${d:+,}$1/seed$s"; done; echo "$d"; }
specs=()
for arm in $WHOLE_ARMS; do specs+=("whole/$arm=$(seed_dirs "$OUT/whole/$arm")"); done
for arm in $SPLIT_ARMS; do specs+=("split/$arm=$(seed_dirs "$OUT/split/$arm")"); done
for a in $EXPLORE_ARMS; do specs+=("$a=$OUT/$a/seed$first"); done
central=()
for arm in $CENTRAL_ARMS; do central+=(--centralized "$arm=$(seed_dirs "$OUT/$arm")"); done
table=$(.venv/bin/python scripts/experiment_baselines_report.py --reference fedavg \
          "${central[@]}" "${specs[@]}")
mkdir -p "$FIGS"
for regime in whole split; do
  arms=$WHOLE_ARMS; [ "$regime" = split ] && arms=$SPLIT_ARMS
  for a in $EXPLORE_ARMS; do [ "${a%%/*}" = "$regime" ] && arms+=" ${a#*/}"; done
  dirs=("$OUT/centralized/seed$first"); labels=centralized
  for arm in $arms; do dirs+=("$OUT/$regime/$arm/seed$first"); labels+=",$arm"; done
  build/spes plot "${dirs[@]}" --labels "$labels" --metric val_loss --out "$FIGS/val_loss_$regime.svg"
done
dirs=("$OUT/centralized/seed$first"); labels=centralized
for arm in fedavg diloco spes-nomerge spes-merge-a0.01; do
  [ -d "$OUT/whole/$arm/seed$first" ] && { dirs+=("$OUT/whole/$arm/seed$first"); labels+=",$arm"; }
done
compare=$(build/spes compare "${dirs[@]}" --labels "$labels")
merge_run=$OUT/whole/spes-merge-a0.05/seed$first
[ -d "$merge_run" ] && build/spes plot "$merge_run" --out "$FIGS/spes-merge"
total=0
for f in $(find "$OUT" -name wall_s); do total=$((total + $(cat "$f"))); done
nruns=$(find "$OUT" -name wall_s | wc -l)
nseeds=$(echo "$SEEDS" | wc -w)

{
  cat <<DOC
# Results: SPES against its baselines on the built-in corpus

Generated by \`bash scripts/experiment_baselines.sh\` on $(date -u +%Y-%m-%d) ($(nproc) CPU cores,
$(build/spes --version 2>/dev/null || echo spes)): $nruns runs, $((total / 60)) minutes of wall
time in all (each run's time is in its directory, \`$OUT/.../wall_s\`). Every figure below comes
from those run directories; \`scripts/experiment_baselines_report.py\`, \`spes compare\` and
\`spes plot\` on them reproduce the tables and the charts.

## Setup

- Model: \`$CONFIG\` shrunk to fit 2 CPU cores: \`${MODEL:-no changes}\` (OLMoE-style MoE,
  4 layers, 8 experts top-2, experts of F $(( $(echo "$MODEL" | tr ' ' '\n' | awk -F= '/mlp_hidden_size/ {print $2}') / 2 )),
  sequence 128), on the King James + World English Bibles tokenized by \`spes prepare\` with a
  $VOCAB-piece vocabulary (\`$DATA\`; the default job uses 8192 pieces).
- Equal total tokens: every run takes $STEPS optimizer steps of $central_batch sequences in all
  ($((STEPS * central_batch * 128)) tokens; centralized: one node with batch $central_batch; the
  others: $NODES nodes with batch $NODE_BATCH each), the default job's schedule (AdamW, peak lr
  $lr, warm-up $warmup steps, cosine to 0.1x), and is evaluated on the same $VAL_WINDOWS held-out
  windows every $EVAL steps. The final loss of a cluster run is that of the published model of
  the last round (every node holds it; the table's value is the mean over nodes).
- Sync every $SYNC steps ($((STEPS / SYNC)) rounds), fp32 transfers, equal weights. SPES: node i
  owns experts [2i, 2i+2) of every layer.
- Merging (spes-merge-a*): as the paper schedules it, a merge every 5 sync rounds
  ($MERGE_INTERVAL steps), alpha = a0 x max(0, 1 - t/$MERGE_DECAY) (zero from 20% of training),
  K = $MERGE_TOPK donors of $EXPERTS experts (the reference's 4 of 16, scaled); no evaluation
  falls on a merge step.
- centralized-lr-double: the centralized run with the peak learning rate doubled (is the
  default learning rate also the best one for one node?).
- DiLoCo: outer Nesterov step on the averaged pseudo-gradient, outer lr 0.7 and momentum 0.9
  (diloco), 1.0 and 0.5 (diloco-mild); spes-outer applies the mild one to the shared tensors of
  SPES (\`spes_config.outer_step\`). spes-sync5 syncs every 5 steps; spes-lr-half halves the
  peak learning rate and warms up over $((4 * warmup)) steps; spes-lr-double doubles it.
- Overlap (spes-overlap-kK): \`spes_config.overlap\` with \`overlap_delay_steps\` K: each node
  keeps training while its round is in flight and, exactly K steps after its upload, takes the
  published model plus its own progress since the upload (docs/PROTOCOL.md, "Overlap"); K = 2
  and K = 10 of the $SYNC steps between syncs stand for a round that takes 2 or 10 steps' time.
- Seeds $SEEDS ($nseeds per arm; the exploratory arms $EXPLORE_ARMS: seed $first only, marked
  "one seed"): the seed sets the initial model and every node's data order,
  so the runs of one seed are paired across arms. Spread: sample standard deviation over seeds
  and, for differences, over the per-seed differences.
- Data regimes. *whole*: every node draws windows from the whole corpus in its own seeded order
  (the reference's behaviour: nodes may see the same window). *split*: \`data.split_across_nodes\`,
  each node on its own disjoint $((100 / NODES))% of the windows ($((STEPS * NODE_BATCH)) windows drawn from it per node).

## Final validation loss over seeds

$table

![validation loss, data regime whole, seed $first](results/val_loss_whole.svg)
![validation loss, data regime split, seed $first](results/val_loss_split.svg)

Charts: seed $first of every arm.$([ -d "$merge_run" ] && printf ' %s\n%s' "Expert similarity and round statistics of spes-merge-a0.05:" "[results/spes-merge/](results/spes-merge/).")

## Memory and bytes per node (seed $first, data regime whole)

$compare

Measured figures come from the runs: peak RSS from each node's metrics (the largest node),
gradient + AdamW bytes measured on the tensors at the first step, bytes per round as sent and
received by node 0 (merge rounds separately). In brackets, the SPES.md formula for the same
config: gradient + AdamW = 12 bytes x trainable values (S + X/N for SPES, P otherwise); upload
S + X/N values, download P - X/N (P in merge rounds), P each way for FedAvg and DiLoCo; the rest
is the safetensors header of each stream.
DOC
  if [ -f "$FIGS/notes.md" ]; then printf '\n'; cat "$FIGS/notes.md"; fi
  # The sections of scripts/experiment_wan.sh and scripts/experiment_overlap.sh, kept when this
  # part is regenerated.
  for s in wan overlap; do
    if [ -f "$FIGS/$s.md" ]; then printf '\n'; cat "$FIGS/$s.md"; fi
  done
} > "$DOC"
echo "wrote $DOC"
