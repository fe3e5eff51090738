# What the experiment scripts share (sourced, not run): one run of an arm at a seed into its
# directory, kept when it already finished; the tokenized Bibles; the cluster runs' options.
#   run_once DIR CMD...   runs CMD (its output in DIR.log) unless DIR/wall_s exists (RERUN=1
#                         runs it again); on success writes the wall seconds to DIR/wall_s; on
#                         failure prints the log's last lines and exits 1.
run_once() {
  local dir=$1
  shift
  if [ "${RERUN:-0}" != 1 ] && [ -f "$dir/wall_s" ]; then
    echo "== $dir: already finished (RERUN=1 to run it again)"
    return
  fi
  echo "== $dir: $*"
  mkdir -p "$dir"
  rm -f "$dir/wall_s"
  local start=$SECONDS
  "$@" > "$dir.log" 2>&1 || { echo "$dir failed; see $dir.log" >&2; tail -n 30 "$dir.log" >&2; exit 1; }
  echo $((SECONDS - start)) > "$dir/wall_s"
  echo "   done in $((SECONDS - start)) s"
}

# prepare_bible_tokens SPES DATA VOCAB: the King James + World English Bibles (downloaded by
# scripts/get_corpus.sh) tokenized by SPES into DATA with a VOCAB-piece vocabulary, unless DATA
# already holds them.
prepare_bible_tokens() {
  local spes=$1 data=$2 vocab=$3
  bash scripts/get_corpus.sh data/corpus
  if [ ! -f "$data/manifest.json" ]; then
    "$spes" prepare --input data/corpus/kjv.txt data/corpus/web.txt --vocab-size "$vocab" \
      --out "$data"
  fi
}

# cluster_args ARRAY STEPS NODE_BATCH SYNC EVAL: fills the array named ARRAY with the `spes
# launch` options the experiments' cluster runs share: CONFIG with NODES nodes (the caller's
# variables, as are DATA, VAL_WINDOWS and MODEL, a list of model KEY=VALUE) of NODE_BATCH
# sequences per step for STEPS steps, one thread each, mode spes without merging, sync every
# SYNC steps, validation every EVAL steps on VAL_WINDOWS windows.
cluster_args() {
  local -n _cluster_args=$1
  local steps=$2 batch=$3 sync=$4 eval=$5 kv
  _cluster_args=(--config "$CONFIG" --nodes "$NODES" --overwrite
        --set "max_duration=$steps" --set "eval_interval=$eval" --set "data.paths=[$DATA]"
        --set "global_train_batch_size=$batch" --set "device_train_microbatch_size=$batch"
        --set "eval_batches=$((VAL_WINDOWS / batch))" --set "spes_config.sync_steps=$sync"
        --set "spes_config.num_peers=$NODES" --set threads=1 --set spes_config.mode=spes
        --set spes_config.merge_interval=0)
  for kv in $MODEL; do _cluster_args+=(--set "model.$kv"); done
}
