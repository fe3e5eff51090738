#!/usr/bin/env bash
# What elastic expert ownership (issue 38) buys when a node leaves mid-run, at equal steps per
# node, paired by seed. The cluster runs of docs/RESULTS.md (scripts/experiment_sparse.sh's
# setting: configs/default.yaml shrunk to d_model 64, a 2048-piece vocabulary on the Bibles,
# NODES nodes of NODE_BATCH sequences, sync every SYNC steps, STEPS steps, SPES without
# merging), one run per arm and seed; node LEAVER leaves after round AT (default: a quarter of
# the rounds):
#   undisturbed      every node to the end
#   depart-fixed     LEAVER departs gracefully (`spes launch --depart-node`: SIGTERM to a node
#                    started with --depart; a departing Leave), reassign_after_rounds 0: its
#                    experts stay frozen at their last published value for the rest of the run
#   depart-reassign  the same departure, reassign_after_rounds REASSIGN: its experts go to the
#                    live nodes at the next round boundary
#   kill-reassign    LEAVER SIGKILLed (`--kill-node`): declared departed after REASSIGN missed
#                    rounds, its experts then handed on (the new owners start their AdamW
#                    moments at zero with the re-warm-up)
# Then scripts/experiment_elastic_report.py writes docs/results/elastic.md (and puts it into
# docs/RESULTS.md): the final validation loss per arm and seed, the paired differences
# reassign - fixed and undisturbed - reassign (mean, sample standard deviation), the tokens each
# arm trained, the round of each handoff, and a chart of validation loss (first seed). Runs
# already finished in OUT are kept (RERUN=1 runs them again). About 3 minutes per run on 2 idle
# cores at the default scale (12 runs with the defaults).
#   bash scripts/experiment_elastic.sh
#   STEPS=200 SEEDS=1 OUT=/tmp/e DOC=/tmp/e/RESULTS.md bash scripts/experiment_elastic.sh  # smoke
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/experiment_run.sh

STEPS=${STEPS:-1600}
NODES=${NODES:-4}
NODE_BATCH=${NODE_BATCH:-4}
SYNC=${SYNC:-20}
EVAL=${EVAL:-160}
VAL_WINDOWS=${VAL_WINDOWS:-128}
SEEDS=${SEEDS:-1 2 3}
ARMS=${ARMS:-undisturbed depart-fixed depart-reassign kill-reassign}
LEAVER=${LEAVER:-$((NODES - 1))}
AT=${AT:-$((STEPS / SYNC / 4))}
REASSIGN=${REASSIGN:-3}
VOCAB=${VOCAB:-2048}
MODEL=${MODEL-d_model=64 mlp_hidden_size=256 vocab_size=$VOCAB}
DATA=${DATA:-data/bible-tokens-2k}
OUT=${OUT:-runs/experiment_elastic}
SPES=${SPES:-build/spes}      # the binary (a copy keeps a long experiment apart from rebuilds)
DOC=${DOC:-docs/RESULTS.md}
FIGS=$(dirname "$DOC")/results
CONFIG=configs/default.yaml

[ -x "$SPES" ] || bash scripts/build.sh spes
prepare_bible_tokens "$SPES" "$DATA" "$VOCAB"
mkdir -p "$OUT" "$FIGS"

cluster_args common "$STEPS" "$NODE_BATCH" "$SYNC" "$EVAL"
common+=(--progress plain --progress-every 60)

arm_options() {  # the launch options that make an arm, on top of `common`
  case "$1" in
    undisturbed) ;;  # experiment_sparse.sh's fp32 arm: the same command, the same runs
    depart-fixed) echo --depart-node "$LEAVER" --at-round "$AT" \
                    --set spes_config.reassign_after_rounds=0 ;;
    depart-reassign) echo --depart-node "$LEAVER" --at-round "$AT" \
                       --set "spes_config.reassign_after_rounds=$REASSIGN" ;;
    kill-reassign) echo --kill-node "$LEAVER" --at-round "$AT" \
                     --set "spes_config.reassign_after_rounds=$REASSIGN" ;;
    *) echo "unknown arm '$1' (undisturbed, depart-fixed, depart-reassign, kill-reassign)" >&2
       return 2 ;;
  esac
}
for arm in $ARMS; do arm_options "$arm" > /dev/null; done  # unknown arms stop here, before any run

run() {  # run ARM SEED: one run into OUT/ARM/seedSEED
  local arm=$1 seed=$2 dir
  dir=$OUT/$arm/seed$seed
  local opts
  read -r -a opts <<< "$(arm_options "$arm")"
  local cmd=("$SPES" launch --out "$dir" "${common[@]}" --set "seed=$seed" "${opts[@]}")
  run_once "$dir" "${cmd[@]}"
}

for seed in $SEEDS; do  # seed by seed: a stopped experiment has every arm at some seeds
  for arm in $ARMS; do run "$arm" "$seed"; done
done

specs=()
for arm in $ARMS; do
  for seed in $SEEDS; do specs+=("$arm:$seed=$OUT/$arm/seed$seed"); done
done
first=$(echo "$SEEDS" | awk '{print $1}')
dirs=(); labels=""
for arm in $ARMS; do dirs+=("$OUT/$arm/seed$first"); labels+="${labels:+,}$arm"; done
"$SPES" plot "${dirs[@]}" --labels "$labels" --metric val_loss --out "$FIGS/elastic_val_loss.svg"
python3 scripts/experiment_elastic_report.py --steps "$STEPS" --sync "$SYNC" --nodes "$NODES" \
  --node-batch "$NODE_BATCH" --model "$MODEL" --leaver "$LEAVER" --at "$AT" \
  --reassign "$REASSIGN" --chart results/elastic_val_loss.svg --out "$FIGS/elastic.md" \
  --doc "$DOC" "${specs[@]}"
