# What the experiment scripts share (sourced, not run): one run of an arm at a seed into its
# directory, kept when it already finished.
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
