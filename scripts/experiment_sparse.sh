#!/usr/bin/env bash
# What top-k sparse sync (spes_config.compression: topk, issue 37) costs in validation loss
# against fp32 and int8 transfers, at equal tokens, with paired seeds, and what each moves per
# round. The cluster runs of docs/RESULTS.md (scripts/experiment_baselines.sh: configs/default.yaml
# shrunk to d_model 64, a 2048-piece vocabulary on the Bibles, NODES nodes of NODE_BATCH
# sequences, sync every SYNC steps, STEPS steps, mode spes without merging), one run per arm and
# seed:
#   fp32              compression none (the reference of every paired difference)
#   int8              compression int8 (int8 deltas with error feedback, chunk coding auto)
#   topk-dD           compression topk, topk_density D (one arm per value of DENSITIES),
#                     topk_bits BITS, topk_decay DECAY; an entry D-downW of DENSITIES makes
#                     topk-dD-downW: the server publishes averaged tensors at
#                     topk_down_density W; a suffix -unsent (D-unsent, D-downW-unsent) adds
#                     topk_unsent_in_weights: the nodes train on the published model plus
#                     what they have not sent
# each also with the outer step (ARM+outer: spes_config.outer_step on the shared tensors, outer
# lr OUTER_LR, momentum OUTER_MOMENTUM) when OUTER has "on"; an entry of ARMS may name its own
# outer settings after a colon (ARMS="fp32:off topk:on": the fp32 reference without the outer
# step, top-k with it; the report then compares top-k+outer with fp32). Seeds set the initial model and
# every node's data order, so the arms of one seed are compared seed by seed. Then
# scripts/experiment_sparse_report.py writes docs/results/sparse.md (and puts it into
# docs/RESULTS.md): per arm the final validation loss per seed, the paired difference from fp32
# (the fp32 arm with the same outer setting; mean and sample standard deviation over seeds),
# the bytes each node moved per round (up + down, from the nodes' metrics) and their ratio to
# fp32's; and a chart of validation loss against bytes per round. Runs already finished in OUT
# are kept (RERUN=1 runs them again). About 3 minutes per run on 2 idle cores at the default
# scale (24 runs with the defaults).
#   bash scripts/experiment_sparse.sh
#   STEPS=200 SEEDS=1 ARMS="fp32 topk" DENSITIES=0.015625 OUTER=off \
#     OUT=/tmp/s DOC=/tmp/s/RESULTS.md bash scripts/experiment_sparse.sh   # a quick smoke run
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/experiment_run.sh

STEPS=${STEPS:-1600}          # optimizer steps per node (equal tokens in every arm)
NODES=${NODES:-4}
NODE_BATCH=${NODE_BATCH:-4}
SYNC=${SYNC:-20}
EVAL=${EVAL:-160}
VAL_WINDOWS=${VAL_WINDOWS:-128}
SEEDS=${SEEDS:-1 2 3}
ARMS=${ARMS:-fp32 int8 topk}  # topk: one arm per density
DENSITIES=${DENSITIES:-0.015625 0.0625}
BITS=${BITS:-2}
DECAY=${DECAY:-1}
OUTER=${OUTER:-off on}        # off: no outer step; on: SPES's outer step on the shared tensors
OUTER_LR=${OUTER_LR:-1.0}
OUTER_MOMENTUM=${OUTER_MOMENTUM:-0.5}
VOCAB=${VOCAB:-2048}
MODEL=${MODEL-d_model=64 mlp_hidden_size=256 vocab_size=$VOCAB}
DATA=${DATA:-data/bible-tokens-2k}
OUT=${OUT:-runs/experiment_sparse}
NAME=${NAME:-sparse}          # the report's section of DOC and its files (results/NAME.md, ..._val_loss.svg)
SPES=${SPES:-build/spes}      # the binary (a copy keeps a long experiment apart from rebuilds)
DOC=${DOC:-docs/RESULTS.md}
FIGS=$(dirname "$DOC")/results
CONFIG=configs/default.yaml

[ -x "$SPES" ] || bash scripts/build.sh spes
prepare_bible_tokens "$SPES" "$DATA" "$VOCAB"
mkdir -p "$OUT" "$FIGS"

cluster_args common "$STEPS" "$NODE_BATCH" "$SYNC" "$EVAL"

arms=()  # every arm name: fp32, int8, topk-dD, each with +outer when OUTER has "on"
for entry in $ARMS; do
  base=${entry%%:*} outers=$OUTER
  [[ "$entry" == *:* ]] && outers=${entry#*:}
  case "$base" in
    fp32|int8) names=("$base") ;;
    topk) names=(); for d in $DENSITIES; do names+=("topk-d$d"); done ;;
    *) echo "unknown arm '$base' (fp32, int8, topk)" >&2; exit 2 ;;
  esac
  for n in "${names[@]}"; do
    for o in ${outers//,/ }; do
      case "$o" in
        off) arms+=("$n") ;;
        on) arms+=("$n+outer") ;;
        *) echo "OUTER takes off and on, not '$o'" >&2; exit 2 ;;
      esac
    done
  done
done

arm_settings() {  # the settings that make an arm, on top of `common`
  local arm=$1 base=${1%+outer}
  case "$base" in
    fp32) ;;
    int8) echo spes_config.compression=int8 ;;
    topk-d*) local density=${base#topk-d} down=0 unsent=false
             if [[ "$density" == *-unsent ]]; then unsent=true; density=${density%-unsent}; fi
             if [[ "$density" == *-down* ]]; then down=${density#*-down}; density=${density%%-down*}; fi
             echo spes_config.compression=topk "spes_config.topk_density=$density" \
               "spes_config.topk_bits=$BITS" "spes_config.topk_decay=$DECAY" \
               "spes_config.topk_down_density=$down" \
               "spes_config.topk_unsent_in_weights=$unsent" ;;
  esac
  if [[ "$arm" == *+outer ]]; then
    echo spes_config.outer_step=true "spes_config.outer_lr=$OUTER_LR" \
         "spes_config.outer_momentum=$OUTER_MOMENTUM"
  fi
}

run() {  # run ARM SEED: one run into OUT/ARM/seedSEED
  local arm=$1 seed=$2 dir kv
  dir=$OUT/$arm/seed$seed
  local cmd=("$SPES" launch --out "$dir" "${common[@]}" --set "seed=$seed")
  for kv in $(arm_settings "$arm"); do cmd+=(--set "$kv"); done
  run_once "$dir" "${cmd[@]}"
}

for seed in $SEEDS; do  # seed by seed: a stopped experiment has every arm at some seeds
  for arm in "${arms[@]}"; do run "$arm" "$seed"; done
done

specs=()
for arm in "${arms[@]}"; do
  for seed in $SEEDS; do specs+=("$arm:$seed=$OUT/$arm/seed$seed"); done
done
first=$(echo "$SEEDS" | awk '{print $1}')
dirs=(); labels=""
for arm in "${arms[@]}"; do dirs+=("$OUT/$arm/seed$first"); labels+="${labels:+,}$arm"; done
"$SPES" plot "${dirs[@]}" --labels "$labels" --metric val_loss --out "$FIGS/${NAME}_val_loss.svg"
python3 scripts/experiment_sparse_report.py --steps "$STEPS" --sync "$SYNC" --nodes "$NODES" \
  --node-batch "$NODE_BATCH" --model "$MODEL" --bits "$BITS" --decay "$DECAY" \
  --outer-lr "$OUTER_LR" --outer-momentum "$OUTER_MOMENTUM" --chart "results/${NAME}_val_loss.svg" \
  --section "$NAME" --out "$FIGS/$NAME.md" --doc "$DOC" "${specs[@]}"
