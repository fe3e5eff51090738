#!/usr/bin/env bash
# The outer-step grid of issue 37 item 4: where, at this project's scale, does DiLoCo's outer
# Nesterov step beat plain averaging, as the DiLoCo literature finds? The cluster runs of
# docs/RESULTS.md (configs/default.yaml shrunk to d_model 64, a 2048-piece vocabulary on the
# Bibles, NODES nodes, every node training every tensor) at equal tokens: every run takes
# SEQUENCES sequences per node, so a regime's steps are SEQUENCES / its batch. The grid:
#   REGIMES  HxB: sync every H steps, B sequences per node per step (rounds = steps / H)
#   OUTERS   avg: plain averaging (spes_config.mode fedavg, the reference of every difference);
#            LRxMU: DiLoCo's outer Nesterov step (mode diloco) at outer lr LR, momentum MU
# every pair at every seed of SEEDS. The warm-up keeps its tokens (WARMUP_SEQUENCES / B steps:
# the default job's 40 steps at B 4); validation EVALS times per run on VAL_WINDOWS windows.
# Seeds set the initial model and every node's data order, so the arms of a regime are compared
# seed by seed. Then scripts/experiment_outer_report.py writes docs/results/NAME.md (and puts it
# into docs/RESULTS.md): per regime the final validation loss per arm and seed, its paired
# difference from plain averaging (mean, sample standard deviation, seeds below), and a chart
# of validation loss per regime (first seed). Runs already finished in OUT are kept (RERUN=1
# runs them again). About 3 minutes per run on 2 idle cores (27 runs with the defaults).
#   bash scripts/experiment_outer.sh
#   SEQUENCES=160 REGIMES="5x4 5x8" SEEDS=1 OUT=/tmp/o DOC=/tmp/o/RESULTS.md \
#     bash scripts/experiment_outer.sh   # a quick smoke run
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/experiment_run.sh

SEQUENCES=${SEQUENCES:-6400}  # sequences per node per run (the baselines' 1600 steps of 4)
NODES=${NODES:-4}
REGIMES=${REGIMES:-20x4 5x4 5x16}
OUTERS=${OUTERS:-avg 0.7x0.9 0.4x0.9}
WARMUP_SEQUENCES=${WARMUP_SEQUENCES:-160}
EVALS=${EVALS:-10}
VAL_WINDOWS=${VAL_WINDOWS:-128}
SEEDS=${SEEDS:-1 2 3}
VOCAB=${VOCAB:-2048}
MODEL=${MODEL-d_model=64 mlp_hidden_size=256 vocab_size=$VOCAB}
DATA=${DATA:-data/bible-tokens-2k}
OUT=${OUT:-runs/experiment_outer}
NAME=${NAME:-outer}           # the report's section of DOC and its files
SPES=${SPES:-build/spes}      # the binary (a copy keeps a long experiment apart from rebuilds)
DOC=${DOC:-docs/RESULTS.md}
FIGS=$(dirname "$DOC")/results
CONFIG=configs/default.yaml

regime_steps() {  # regime_steps HxB: the steps of a run at batch B (equal tokens), refused when
  local h=${1%x*} b=${1#*x}  # they do not make whole rounds or B does not divide the windows
  [[ "$1" =~ ^[0-9]+x[0-9]+$ ]] || { echo "a regime is HxB (sync interval x batch), not '$1'" >&2; return 1; }
  local steps=$((SEQUENCES / b))
  if (( SEQUENCES % b || steps % h || VAL_WINDOWS % b || steps % EVALS )); then
    echo "regime $1: SEQUENCES ($SEQUENCES) / $b steps must be a whole number of rounds of $h" \
         "and of EVALS ($EVALS), and $b must divide VAL_WINDOWS ($VAL_WINDOWS)" >&2
    return 1
  fi
  echo "$steps"
}

arm_name() {  # avg or outer-lrLR-mMU
  case "$1" in
    avg) echo avg ;;
    *x*) echo "outer-lr${1%x*}-m${1#*x}" ;;
    *) echo "an outer setting is avg or LRxMU (outer lr x momentum), not '$1'" >&2; return 1 ;;
  esac
}

arm_settings() {  # the settings that make an outer setting, on top of the cluster's
  case "$1" in
    avg) echo spes_config.mode=fedavg ;;
    *) echo spes_config.mode=diloco "spes_config.outer_lr=${1%x*}" "spes_config.outer_momentum=${1#*x}" ;;
  esac
}

for r in $REGIMES; do regime_steps "$r" > /dev/null; done  # a bad grid fails before any run
for o in $OUTERS; do arm_name "$o" > /dev/null; done
[ -x "$SPES" ] || bash scripts/build.sh spes
prepare_bible_tokens "$SPES" "$DATA" "$VOCAB"
mkdir -p "$OUT" "$FIGS"

run() {  # run REGIME OUTER SEED: one run into OUT/hH-bB/ARM/seedSEED
  local regime=$1 outer=$2 seed=$3 h=${1%x*} b=${1#*x} steps dir kv args
  steps=$(regime_steps "$regime")
  dir=$OUT/h$h-b$b/$(arm_name "$outer")/seed$seed
  cluster_args args "$steps" "$b" "$h" $((steps / EVALS))
  local cmd=("$SPES" launch --out "$dir" "${args[@]}" --set "seed=$seed"
             --set "scheduler.t_warmup=$(( (WARMUP_SEQUENCES + b - 1) / b ))")
  for kv in $(arm_settings "$outer"); do cmd+=(--set "$kv"); done
  run_once "$dir" "${cmd[@]}"
}

for seed in $SEEDS; do  # seed by seed: a stopped experiment has every cell at some seeds
  for regime in $REGIMES; do
    for outer in $OUTERS; do run "$regime" "$outer" "$seed"; done
  done
done

specs=()
first=$(echo "$SEEDS" | awk '{print $1}')
for regime in $REGIMES; do
  h=${regime%x*} b=${regime#*x} dirs=() labels=""
  for outer in $OUTERS; do
    arm=$(arm_name "$outer")
    for seed in $SEEDS; do specs+=("h$h-b$b/$arm:$seed=$OUT/h$h-b$b/$arm/seed$seed"); done
    dirs+=("$OUT/h$h-b$b/$arm/seed$first"); labels+="${labels:+,}$arm"
  done
  "$SPES" plot "${dirs[@]}" --labels "$labels" --metric val_loss \
    --out "$FIGS/${NAME}_h$h-b${b}_val_loss.svg"
done
python3 scripts/experiment_outer_report.py --sequences "$SEQUENCES" --nodes "$NODES" \
  --model "$MODEL" --warmup-sequences "$WARMUP_SEQUENCES" --charts "results/${NAME}_{regime}_val_loss.svg" \
  --section "$NAME" --out "$FIGS/$NAME.md" --doc "$DOC" "${specs[@]}"
