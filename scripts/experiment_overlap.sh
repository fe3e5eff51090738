#!/usr/bin/env bash
# What an overlapped round costs in validation loss, as a function of how many steps it stays in
# flight. The default job (configs/default.yaml, its data, 4 nodes on loopback through
# `spes launch`) at equal tokens (STEPS optimizer steps per node), over several seeds:
#   blocking     every round blocks (spes_config.overlap: false)
#   overlap-K    spes_config.overlap: true, overlap_delay_steps: K: every round is applied
#                exactly K steps after its upload, whatever the link (K = sync_steps - 1 is the
#                latest a round may be applied, what a slow link gives)
# A fixed K makes each run deterministic and independent of link speed, so the difference from
# blocking at the same seed is the cost of the round's staleness alone; scripts/experiment_wan.sh
# shows how many steps rounds actually stay in flight on emulated WAN links. Then
# scripts/experiment_overlap_report.py writes docs/results/overlap.md and puts it into
# docs/RESULTS.md (scripts/experiment_baselines.sh keeps it there). Runs already finished in
# OUT are kept (RERUN=1 runs them again). About 80 s per run on 2 idle cores (12 runs).
#   bash scripts/experiment_overlap.sh
#   SEEDS="1 2" DELAYS="10" STEPS=60 OUT=/tmp/o DOC=/tmp/o/RESULTS.md bash scripts/experiment_overlap.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

STEPS=${STEPS:-100}          # optimizer steps per node (the default job: 300)
EVAL=${EVAL:-20}             # steps between validation passes
EVAL_BATCHES=${EVAL_BATCHES:-8}
SEEDS=${SEEDS:-6198 7 11}    # 6198: the default job's
DELAYS=${DELAYS:-5 10 19}    # overlap_delay_steps of the overlapped arms (each < sync_steps)
OUT=${OUT:-runs/experiment_overlap}
DOC=${DOC:-docs/RESULTS.md}
SECTION=$(dirname "$DOC")/results/overlap.md

[ -x build/spes ] || bash scripts/build.sh spes
bash scripts/prepare_default_data.sh
mkdir -p "$OUT" "$(dirname "$SECTION")"

arms=(blocking)
for k in $DELAYS; do arms+=("overlap-$k"); done
runs=()
for seed in $SEEDS; do
  for arm in "${arms[@]}"; do
    dir="$OUT/$arm-seed$seed"
    runs+=("$arm:$seed=$dir")
    if [ "${RERUN:-0}" != 1 ] && [ -f "$dir/summary.json" ]; then
      echo "== $arm, seed $seed: already finished in $dir (RERUN=1 to run it again)"
      continue
    fi
    args=(--out "$dir" --overwrite --no-summary --set "max_duration=$STEPS"
          --set "eval_interval=$EVAL" --set "eval_batches=$EVAL_BATCHES" --set "seed=$seed")
    case "$arm" in
      overlap-*) args+=(--set spes_config.overlap=true
                        --set "spes_config.overlap_delay_steps=${arm#overlap-}") ;;
    esac
    echo "== $arm, seed $seed: build/spes launch ${args[*]}"
    start=$(date +%s)
    build/spes launch "${args[@]}" > "$dir.log" 2>&1 ||
      { echo "$arm (seed $seed) failed; see $dir.log" >&2; tail -n 30 "$dir.log" >&2; exit 1; }
    echo "   done in $(( $(date +%s) - start )) s"
  done
done

python3 scripts/experiment_overlap_report.py --steps "$STEPS" --eval-batches "$EVAL_BATCHES" \
  --out "$SECTION" --doc "$DOC" "${runs[@]}"
