#!/usr/bin/env bash
# End-to-end check of the sync server's live dashboard in headless Chromium (CTest:
# dashboard_headless_chromium). Tokenizes a small real corpus (scripts/tiny_job.sh: the
# license texts every Debian system ships), starts a tiny two-node cluster with
# `spes launch` (the dashboard on a free loopback port; its URL from launch's "dashboard:"
# line), waits until 3 rounds are published, then loads the page while the nodes train and
# checks the rendered DOM: a row per node with a step > 0 and a loss, at least 3 round rows,
# a loss curve per node, a similarity curve and a similarity row per layer, no error shown.
# Saves a 1280x1000 screenshot of the live run (kept at $SPES_DASHBOARD_SCREENSHOT when set).
# Every process it starts is stopped on exit.
# Usage: scripts/test_dashboard.sh [BUILD_DIR]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$(cd "${1:-$root/build}" && pwd)"
spes="$build/spes"
shot_out="${SPES_DASHBOARD_SCREENSHOT:-}"
[ -z "$shot_out" ] || shot_out="$(cd "$(dirname "$shot_out")" && pwd)/$(basename "$shot_out")"
browser="$(command -v chromium || command -v chromium-browser || true)"
[ -n "$browser" ] || { echo "FAIL: chromium not found (scripts/setup.sh installs it)"; exit 1; }
[ -x "$spes" ] || { echo "FAIL: $spes not built (scripts/build.sh)"; exit 1; }

tmp="$(mktemp -d)"
launch_pid=""
cleanup() {
  if [ -n "$launch_pid" ] && kill -0 "$launch_pid" 2>/dev/null; then
    kill -TERM "$launch_pid" 2>/dev/null || true  # launch stops its server and nodes
    for _ in $(seq 50); do kill -0 "$launch_pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- "-$launch_pid" 2>/dev/null || true  # its process group, if still there
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  if [ -f "$tmp/launch.log" ]; then
    echo "--- last lines of spes launch ---"
    tail -n 30 "$tmp/launch.log"
  fi
  exit 1
}
t0=$SECONDS

# The tiny job (scripts/tiny_job.sh: syncs every 5 steps, merging every 10), running long
# enough for the page to be loaded while it trains.
bash "$root/scripts/tiny_job.sh" "$spes" "$tmp" > "$tmp/prepare.log" 2>&1 \
  || { cat "$tmp/prepare.log"; fail "scripts/tiny_job.sh"; }

# The cluster, in its own process group (cleanup can always stop all of it).
setsid "$spes" launch --config "$tmp/config.yaml" --nodes 2 --out "$tmp/run" --no-summary \
  --set max_duration=3000 --set spes_config.heartbeat_timeout=4 \
  --set spes_config.dashboard_port=0 > "$tmp/launch.log" 2>&1 &
launch_pid=$!
url=""
for _ in $(seq 600); do
  url="$(sed -n 's/^dashboard: \(http:[^ ]*\)$/\1/p' "$tmp/launch.log" | head -n 1)"
  [ -n "$url" ] && break
  kill -0 "$launch_pid" 2>/dev/null || fail "spes launch exited before printing the dashboard URL"
  sleep 0.1
done
[ -n "$url" ] || fail "spes launch printed no 'dashboard: http://...' line within 60 s"
echo "dashboard at $url"
rounds=0
for _ in $(seq 900); do
  [ -f "$tmp/run/server/rounds.jsonl" ] && rounds=$(wc -l < "$tmp/run/server/rounds.jsonl")
  [ "$rounds" -ge 3 ] && break
  kill -0 "$launch_pid" 2>/dev/null || fail "the cluster stopped before 3 rounds were published"
  sleep 0.2
done
[ "$rounds" -ge 3 ] || fail "fewer than 3 rounds published within 180 s"
echo "$rounds rounds published after $((SECONDS - t0)) s; loading the page"

# The page as Chromium renders it, after a few polls of /api/status (virtual time).
chrome() {
  timeout 90 "$browser" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage \
    --disable-extensions --no-first-run --user-data-dir="$tmp/profile" --hide-scrollbars \
    --window-size=1280,1000 --virtual-time-budget=5000 "$@" 2>> "$tmp/chromium.log"
}
chrome --dump-dom "$url" > "$tmp/dom.html" || fail "chromium --dump-dom failed: $(tail -n 5 "$tmp/chromium.log")"
dom="$tmp/dom.html"
count() { grep -o "$1" "$dom" | wc -l; }
grep -q 'id="live" class="ok"' "$dom" || fail "the page never got a status from the server"
if grep -q 'id="error">[^<]' "$dom"; then
  fail "the page shows an error: $(grep -o 'id="error">[^<]*' "$dom")"
fi
for n in 0 1; do
  row="$(grep -o "<tr data-node=\"$n\"[^>]*>" "$dom" | head -n 1 || true)"
  [ -n "$row" ] || fail "no row for node $n in the nodes table"
  step="$(echo "$row" | sed -n 's/.*data-step="\([0-9]*\)".*/\1/p')"
  [ "${step:-0}" -gt 0 ] || fail "node $n shows step '${step}' (expected > 0): $row"
  echo "$row" | grep -q 'data-loss="[0-9.e+-]*"' || fail "node $n shows no loss: $row"
  grep -q "data-series=\"node $n\"" "$dom" || fail "no loss curve for node $n"
done
[ "$(count '<tr data-round=')" -ge 3 ] || fail "fewer than 3 rows in the rounds table"
for l in 0 1; do
  grep -q "<tr data-layer=\"$l\"" "$dom" || fail "no similarity row for layer $l"
  grep -q "data-series=\"layer $l\"" "$dom" || fail "no similarity curve for layer $l"
done
grep -q '<svg id="loss"' "$dom" && grep -q '<svg id="similarity"' "$dom" || fail "a chart is missing"
echo "DOM ok: 2 nodes training with a loss, $(count '<tr data-round=') rounds, loss and similarity charts"

# The screenshot of the live run.
chrome --screenshot="$tmp/dashboard.png" "$url" > /dev/null || fail "chromium --screenshot failed"
[ "$(head -c 8 "$tmp/dashboard.png" | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ] \
  || fail "the screenshot is not a PNG"
[ "$(wc -c < "$tmp/dashboard.png")" -gt 20000 ] || fail "the screenshot is nearly empty"
if [ -n "$shot_out" ]; then cp "$tmp/dashboard.png" "$shot_out"; echo "screenshot: $shot_out"; fi
kill -0 "$launch_pid" 2>/dev/null || fail "the cluster stopped while the page was checked"
echo "dashboard in headless Chromium: ok ($((SECONDS - t0)) s)"
