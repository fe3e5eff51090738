#!/usr/bin/env bash
# Load runs against a real `spes serve` with two honest nodes training (issue 35): the tiny job
# of scripts/tiny_job.sh with mutual TLS (`spes certs`, `--tls-dir`) and node tokens on
# loopback; then scripts/attack_load.py runs its phases (undisturbed, an idle-connection flood,
# a header flood without a client certificate, slow handshakes, undisturbed again), measuring
# the server's CPU, descriptors and RSS and the rounds published, and prints a Markdown table
# (docs/SECURITY.md, "Load runs"). Every process it starts is stopped on exit.
# Usage: scripts/attack_load.sh [BUILD_DIR] [PHASE_SECONDS (default 30)]
# (SPES_ATTACK_KEEP=1 keeps the run's directory, with every process's log.)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$(cd "${1:-$root/build}" && pwd)"
phase_s="${2:-30}"
spes="$build/spes"
[ -x "$spes" ] || { echo "FAIL: $spes not built (scripts/build.sh)"; exit 1; }
tmp="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  sleep 1
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  if [ -n "${SPES_ATTACK_KEEP:-}" ]; then echo "kept $tmp"; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; tail -n 20 "$tmp"/*.log 2>/dev/null; exit 1; }

bash "$root/scripts/tiny_job.sh" "$spes" "$tmp" > "$tmp/prepare.log" 2>&1 || fail "tiny_job.sh"
"$spes" certs --out "$tmp/certs" --nodes 2 --host 127.0.0.1 > "$tmp/certs.log"
printf '0: %s\n1: %s\n' "$(openssl rand -hex 16)" "$(openssl rand -hex 16)" > "$tmp/tokens.yaml"
chmod 600 "$tmp/tokens.yaml"
for i in 0 1; do
  sed -n "s/^$i: //p" "$tmp/tokens.yaml" > "$tmp/node$i.token"
  chmod 600 "$tmp/node$i.token"
done
# The nodes train for as long as the phases last, syncing every 100 steps (two or three rounds a
# second: with the tiny job's 5 steps, or 40, rounds come faster than the server's call rate
# for uploads, 5 a second, and the nodes' retries wait out their backoff), with a drift bound
# the tiny model's fast honest training stays within (at 100 steps a round its lm_head moved
# 20x its norm over the 6-round window, past the default 20, and every upload was refused).
sets=(--set max_duration=1000000 --set spes_config.heartbeat_timeout=30
      --set spes_config.sync_steps=100 --set spes_config.merge_interval=200
      --set spes_config.max_drift_ratio=1000)
"$spes" serve --config "$tmp/config.yaml" --out "$tmp/server" --listen 127.0.0.1:0 \
  --tls-dir "$tmp/certs" --set spes_config.auth_tokens_file="$tmp/tokens.yaml" \
  --set spes_config.dashboard_port=-1 "${sets[@]}" > "$tmp/server.log" 2>&1 &
server_pid=$!
pids+=("$server_pid")
for _ in $(seq 300); do [ -f "$tmp/server/server.json" ] && break; sleep 0.1; done
[ -f "$tmp/server/server.json" ] || fail "the server wrote no server.json"
port="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["address"].rsplit(":",1)[1])' "$tmp/server/server.json")"
for i in 0 1; do
  "$spes" node --config "$tmp/config.yaml" --node-id "$i" --server "127.0.0.1:$port" \
    --out "$tmp/node$i" --token-file "$tmp/node$i.token" --tls-dir "$tmp/certs" "${sets[@]}" \
    > "$tmp/node$i.log" 2>&1 &
  pids+=("$!")
done
# Warm up: the first rounds published.
for _ in $(seq 1200); do
  [ -f "$tmp/server/rounds.jsonl" ] && [ "$(wc -l < "$tmp/server/rounds.jsonl")" -ge 3 ] && break
  kill -0 "$server_pid" 2>/dev/null || fail "the server stopped"
  sleep 0.1
done
[ "$(wc -l < "$tmp/server/rounds.jsonl" 2>/dev/null || echo 0)" -ge 3 ] || fail "no rounds published"
echo "attack_load.sh $(date -u +%Y-%m-%d), $(nproc) cores, server pid $server_pid on 127.0.0.1:$port (mutual TLS)"
python3 "$root/scripts/attack_load.py" "$server_pid" "$port" "$tmp/server" "$tmp/certs/ca.pem" "$phase_s"
kill -0 "$server_pid" 2>/dev/null || fail "the server died during the load"
grep -m 3 "connection guard" "$tmp/server.log" || true
