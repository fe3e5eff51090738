#!/usr/bin/env bash
# Issue 14's trade-off experiment: what compressed deltas and overlapping rounds buy over the
# internet. Eight arms of the default job (configs/default.yaml, its data, 4 nodes) on the
# emulated WAN of scripts/wan_cluster.sh (100 Mbit/s and a 40 ms round trip per node, the last
# node at 20 Mbit/s), at equal tokens (every arm STEPS optimizer steps per node):
#   fp32, bf16, int8   spes_config.compression none | bf16 | int8 (none sends fp32 tensors)
#   topk               spes_config.compression topk at its defaults (topk_density 1/64,
#                      topk_bits 2, topk_decay 1: top-k sparse deltas, issue 37)
#   each blocking and with spes_config.overlap: true
# Then scripts/experiment_wan_report.py writes docs/results/wan.md (final validation loss,
# bytes per round per node, the share of wall time training stood still for syncs, and the
# wall-clock time at which each arm first reached the loss that every arm reached) and puts
# it into docs/RESULTS.md as its last section (scripts/experiment_baselines.sh keeps it there).
# Arms already finished in OUT are kept (RERUN=1 runs them again). Needs what wan_cluster.sh
# needs (root, iproute2, python3, build/spes) and about 8 x 6 minutes on 2 idle cores.
#   sudo bash scripts/experiment_wan.sh
#   STEPS=40 EVAL=20 OUT=/tmp/w DOC=/tmp/w/RESULTS.md sudo -E bash scripts/experiment_wan.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

STEPS=${STEPS:-100}          # optimizer steps per node (the default job: 300)
EVAL=${EVAL:-20}             # steps between validation passes
EVAL_BATCHES=${EVAL_BATCHES:-8}
OUT=${OUT:-runs/experiment_wan}
DOC=${DOC:-docs/RESULTS.md}
SECTION=$(dirname "$DOC")/results/wan.md
ARMS=(fp32 bf16 int8 topk fp32-overlap bf16-overlap int8-overlap topk-overlap)

[ -x build/spes ] || bash scripts/build.sh spes
bash scripts/prepare_default_data.sh
bash scripts/wan_cluster.sh --check
mkdir -p "$OUT" "$(dirname "$SECTION")"

arm_sets() {  # the config overrides of one arm
  local comp=${1%-overlap}
  [ "$comp" = fp32 ] && comp=none
  echo "--set spes_config.compression=$comp"
  case "$1" in *-overlap) echo "--set spes_config.overlap=true" ;; esac
}

for arm in "${ARMS[@]}"; do
  if [ "${RERUN:-0}" != 1 ] && [ -f "$OUT/$arm/wan_summary.json" ]; then
    echo "== $arm: already finished in $OUT/$arm (RERUN=1 to run it again)"
    continue
  fi
  # shellcheck disable=SC2046  # arm_sets prints words without spaces inside them
  args=(--out "$OUT/$arm" --steps "$STEPS" --set "eval_interval=$EVAL"
        --set "eval_batches=$EVAL_BATCHES" $(arm_sets "$arm"))
  echo "== $arm: scripts/wan_cluster.sh ${args[*]}"
  start=$(date +%s)
  bash scripts/wan_cluster.sh "${args[@]}" > "$OUT/$arm.log" 2>&1 ||
    { echo "$arm failed; see $OUT/$arm.log" >&2; tail -n 30 "$OUT/$arm.log" >&2; exit 1; }
  echo "   done in $(( $(date +%s) - start )) s"
done

dirs=()
for arm in "${ARMS[@]}"; do dirs+=("$arm=$OUT/$arm"); done
python3 scripts/experiment_wan_report.py --steps "$STEPS" --eval "$EVAL" \
  --eval-batches "$EVAL_BATCHES" --out "$SECTION" --doc "$DOC" "${dirs[@]}"
