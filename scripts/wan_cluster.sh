#!/usr/bin/env bash
# A SPES cluster on emulated WAN links, on this machine: `spes serve` and N `spes node`
# processes, each in its own Linux network namespace. Every node has its own link to the
# server's namespace (a veth pair, 10.201.<i>.2 <-> 10.201.<i>.1) with a rate limit in each
# direction (`tc tbf`), and reaches the server through its own relay (scripts/wan_relay.py, in
# the node's namespace) that adds the one-way delay and jitter each way and can cut the link
# for some seconds (every connection reset, new ones refused). The server listens on a
# non-loopback address, so the nodes authenticate with tokens (generated per run).
# Defaults: the default job (configs/default.yaml, the data of scripts/prepare_default_data.sh),
# its 4 nodes at 100 Mbit/s with a 40 ms round trip, the last node at 20 Mbit/s.
# At the end it writes OUT/wan_summary.txt and OUT/wan_summary.json (scripts/wan_report.py):
# per round the wall time, bytes up and down per node, the time nodes spent in the sync (and
# waiting for the round), and the validation loss against wall-clock time.
# Leaves out: packet loss (netem is missing from this kernel; a relay sees a byte stream, not
# packets) and TCP's reaction to delay (the relay's connections are local to each side): see
# docs/WAN.md. Needs root, iproute2 (ip, tc) and python3; cleans up every namespace, link,
# queueing discipline and process it created on exit, also on Ctrl-C.
# Usage: scripts/wan_cluster.sh [options] (--help lists them)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
me="wan_cluster.sh"

usage() {
  cat <<'EOF'
Usage: scripts/wan_cluster.sh [options]
  --config FILE        job config (default configs/default.yaml)
  --nodes N            number of nodes (default: the config's spes_config.num_peers, else 4)
  --out DIR            run directory (default runs/wan); an earlier run there is replaced
  --data DIR           token directory (sets data.paths; default: the config's)
  --steps N            training steps (sets max_duration)
  --set KEY=VALUE      any config override, repeatable (as `spes launch --set`)
  --rate R             every link's rate, each direction, tc syntax (default 100mbit)
  --node-rate I=R      node I's rate (repeatable; default: node N-1 at 20mbit; `none`: no
                       node differs)
  --rtt MS             round-trip time added by each link's relay (default 40)
  --node-rtt I=MS      node I's round trip (repeatable)
  --jitter MS          +- jitter of each one-way delay, per chunk (default 2)
  --cut I:AT:S         cut node I's link for S seconds (connections reset, new ones refused)
                       AT: `12s` seconds after the node started, `9000000b` once the link has
                       carried that many bytes toward the server, or `upR` halfway through the
                       node's upload of round R
  --timeout S          stop everything and fail after S seconds (default: no limit)
  --spes BIN           the spes binary (default: $SPES_BIN, else build/spes)
  --check              only check that this machine can run it (root, namespaces, veth, tbf)
  -h, --help           this text
EOF
}

die() { echo "$me: $*" >&2; exit 2; }

# --- options -------------------------------------------------------------------------------------
config="$root/configs/default.yaml"
nodes=""
out="$root/runs/wan"
data=""
steps=""
sets=()
rate="100mbit"
node_rates=()
node_rates_given=0
rtt=40
node_rtts=()
jitter=2
cuts=()
timeout_s=0
spes="${SPES_BIN:-$root/build/spes}"
check_only=0
abspath() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
need_arg() { [ $# -ge 2 ] || die "option $1 needs a value (see --help)"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --config) need_arg "$@"; config="$(abspath "$2")"; shift 2 ;;
    --nodes) need_arg "$@"; nodes="$2"; shift 2 ;;
    --out) need_arg "$@"; out="$(abspath "$2")"; shift 2 ;;
    --data) need_arg "$@"; data="$(abspath "$2")"; shift 2 ;;
    --steps) need_arg "$@"; steps="$2"; shift 2 ;;
    --set) need_arg "$@"; sets+=("$2"); shift 2 ;;
    --rate) need_arg "$@"; rate="$2"; shift 2 ;;
    --node-rate) need_arg "$@"; node_rates_given=1; [ "$2" = none ] || node_rates+=("$2"); shift 2 ;;
    --rtt) need_arg "$@"; rtt="$2"; shift 2 ;;
    --node-rtt) need_arg "$@"; node_rtts+=("$2"); shift 2 ;;
    --jitter) need_arg "$@"; jitter="$2"; shift 2 ;;
    --cut) need_arg "$@"; cuts+=("$2"); shift 2 ;;
    --timeout) need_arg "$@"; timeout_s="$2"; shift 2 ;;
    --spes) need_arg "$@"; spes="$(abspath "$2")"; shift 2 ;;
    --check) check_only=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
is_num() { [[ "$1" =~ ^[0-9]+(\.[0-9]+)?$ ]]; }
is_rate() { [[ "$1" =~ ^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit)$ ]]; }
[ -z "$nodes" ] || { is_uint "$nodes" && [ "$nodes" -ge 1 ] && [ "$nodes" -le 250 ]; } \
  || die "--nodes '$nodes' must be a whole number in [1, 250]"
[ -z "$steps" ] || is_uint "$steps" || die "--steps '$steps' must be a whole number"
is_rate "$rate" || die "--rate '$rate' is not a tc rate (e.g. 100mbit, 20mbit, 1gbit)"
is_num "$rtt" || die "--rtt '$rtt' must be milliseconds (e.g. 40)"
is_num "$jitter" || die "--jitter '$jitter' must be milliseconds (e.g. 2)"
is_uint "$timeout_s" || die "--timeout '$timeout_s' must be whole seconds"

# --- can this machine do it? ----------------------------------------------------------------------
py="$root/.venv/bin/python"
[ -x "$py" ] || py="$(command -v python3 || true)"
check_machine() {
  [ "$(id -u)" = 0 ] || { echo "needs root (network namespaces, veth links and tc): run it with sudo"; return 1; }
  command -v ip > /dev/null && command -v tc > /dev/null \
    || { echo "needs iproute2 (ip, tc): apt-get install iproute2 (scripts/setup.sh installs it)"; return 1; }
  [ -n "$py" ] || { echo "needs python3 for the link relay: apt-get install python3"; return 1; }
  local ns="spes-wan-check-$$" err
  if ! err="$(ip netns add "$ns" 2>&1)"; then
    echo "cannot create a network namespace ('ip netns add': $err): run it on a host or a container with CAP_SYS_ADMIN and CAP_NET_ADMIN"
    return 1
  fi
  local ok=1
  if ! err="$(ip -n "$ns" link add wcheck0 type veth peer name wcheck1 2>&1)"; then
    echo "cannot create a veth pair ('ip link add ... type veth': $err): the kernel needs veth"
    ok=0
  elif ! err="$(ip netns exec "$ns" tc qdisc add dev wcheck0 root tbf rate 10mbit burst 32kb latency 50ms 2>&1)"; then
    echo "cannot add a tbf rate limit ('tc qdisc add ... tbf': $err): the kernel needs sch_tbf"
    ok=0
  fi
  ip netns del "$ns" 2> /dev/null || true
  [ "$ok" = 1 ]
}
if ! why="$(check_machine)"; then
  echo "$me: cannot emulate WAN links here: $why" >&2
  exit 3
fi
# netem (delay, jitter, loss in the kernel) is checked and reported; the relay is used either way.
netem_probe() {
  local ns="spes-wan-netem-$$" err
  ip netns add "$ns" 2> /dev/null || return 0
  ip -n "$ns" link add wnetem0 type veth peer name wnetem1 2> /dev/null || true
  if err="$(ip netns exec "$ns" tc qdisc add dev wnetem0 root netem delay 1ms 2>&1)"; then
    echo "available (not used: the relay gives the same delay on every machine)"
  else
    echo "unavailable here ('tc qdisc add ... netem': ${err//$'\n'/ })"
  fi
  ip netns del "$ns" 2> /dev/null || true
}
netem="$(netem_probe)"
if [ "$check_only" = 1 ]; then
  echo "$me: this machine can run it (root, namespaces, veth, tbf); netem: $netem"
  exit 0
fi

# --- the job ---------------------------------------------------------------------------------------
[ -x "$spes" ] || die "spes binary '$spes' not found: build it (bash scripts/build.sh spes) or pass --spes / SPES_BIN"
[ -f "$config" ] || die "config '$config' not found"
cd "$root"  # the configs' relative data paths (data/bible-tokens) are relative to the repository
[ -n "$data" ] && sets+=("data.paths=[$data]")
[ -n "$steps" ] && sets+=("max_duration=$steps")
set_args=()
for s in ${sets[@]+"${sets[@]}"}; do set_args+=(--set "$s"); done
config_json() { "$spes" config --config "$config" ${set_args[@]+"${set_args[@]}"} "$@" --json; }
if [ -z "$nodes" ]; then
  nodes="$(config_json | "$py" -c 'import json,sys; n=json.load(sys.stdin)["config_yaml"]
import re; m=re.search(r"num_peers: (\d+)", n); p=int(m.group(1)) if m else 0; print(p if p > 1 else 4)')" \
    || die "cannot read '$config' with '$spes config' (see the message above)"
fi
mkdir -p "$out"
# An earlier run there is replaced: only what this script writes (server/, node<digits>/, ...).
for d in "$out"/*; do
  name="${d##*/}"
  if [[ "$name" =~ ^(server|links|secrets|node[0-9]+)$ ]] && [ -d "$d" ]; then rm -rf "$d"; fi
done
rm -f "$out"/wan_summary.txt "$out"/wan_summary.json "$out"/timeline.tsv "$out"/wan.json
mkdir -p "$out/server" "$out/links" "$out/secrets"
chmod 700 "$out/secrets"
threads_set=()
cores="$(nproc)"
sets+=("spes_config.num_peers=$nodes" "spes_config.auth_tokens_file=$out/secrets/tokens.yaml")
if ! grep -qE '^threads=' <(printf '%s\n' "${sets[@]}"); then
  threads_set=(--set "threads=$(( cores / nodes > 0 ? cores / nodes : 1 ))")  # as spes launch
fi
set_args=()
for s in "${sets[@]}"; do set_args+=(--set "$s"); done
: > "$out/secrets/tokens.yaml"
chmod 600 "$out/secrets/tokens.yaml"
for ((i = 0; i < nodes; i++)); do
  tok="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  echo "$i: $tok" >> "$out/secrets/tokens.yaml"
  printf '%s\n' "$tok" > "$out/secrets/node$i.token"
  chmod 600 "$out/secrets/node$i.token"
done
resolved="$(config_json ${threads_set[@]+"${threads_set[@]}"})" \
  || die "the config does not resolve (see the message above)"
printf '%s' "$resolved" | "$py" -c 'import json,sys; sys.stdout.write(json.load(sys.stdin)["config_yaml"])' \
  > "$out/config.yaml"
# Upload size per node (for --cut I:upR): trainable values x bytes per value of the wire dtype.
upload_bytes() {
  printf '%s' "$resolved" | "$py" -c '
import json, re, sys
j = json.load(sys.stdin); node = int(sys.argv[1])
dtype = re.search(r"transfer_dtype: \"?(\w+)", j["config_yaml"]).group(1)
print(j["parameters"]["trainable_by_node"][node] * (2 if dtype in ("bf16", "fp16") else 4))' "$1"
}

# --- per-link settings ---------------------------------------------------------------------------
declare -a link_rate link_rtt link_cut link_cut_spec
for ((i = 0; i < nodes; i++)); do
  link_rate[i]="$rate"; link_rtt[i]="$rtt"; link_cut[i]=""; link_cut_spec[i]=""
done
if [ "$node_rates_given" = 0 ] && [ "$nodes" -gt 1 ]; then node_rates=("$((nodes - 1))=20mbit"); fi
for nr in ${node_rates[@]+"${node_rates[@]}"}; do
  [[ "$nr" =~ ^([0-9]+)=(.+)$ ]] || die "--node-rate '$nr' must be I=RATE (e.g. 3=20mbit)"
  i="${BASH_REMATCH[1]}"; r="${BASH_REMATCH[2]}"
  [ "$i" -lt "$nodes" ] || die "--node-rate '$nr': node $i does not exist (--nodes $nodes)"
  is_rate "$r" || die "--node-rate '$nr': '$r' is not a tc rate (e.g. 20mbit)"
  link_rate[i]="$r"
done
for nr in ${node_rtts[@]+"${node_rtts[@]}"}; do
  [[ "$nr" =~ ^([0-9]+)=([0-9]+(\.[0-9]+)?)$ ]] || die "--node-rtt '$nr' must be I=MS (e.g. 1=150)"
  [ "${BASH_REMATCH[1]}" -lt "$nodes" ] || die "--node-rtt '$nr': node ${BASH_REMATCH[1]} does not exist"
  link_rtt[BASH_REMATCH[1]]="${BASH_REMATCH[2]}"
done
for c in ${cuts[@]+"${cuts[@]}"}; do
  [[ "$c" =~ ^([0-9]+):([0-9]+(\.[0-9]+)?s|[0-9]+b|up[0-9]+):([0-9]+(\.[0-9]+)?)$ ]] \
    || die "--cut '$c' must be I:AT:SECONDS with AT like 12s, 9000000b or up2 (see --help)"
  i="${BASH_REMATCH[1]}"; at="${BASH_REMATCH[2]}"; secs="${BASH_REMATCH[4]}"
  [ "$i" -lt "$nodes" ] || die "--cut '$c': node $i does not exist (--nodes $nodes)"
  [ -z "${link_cut[i]}" ] || die "--cut '$c': node $i already has a cut (one per link)"
  link_cut_spec[i]="$secs s at $at"
  case "$at" in
    *s) link_cut[i]="--cut-at ${at%s} --cut-for $secs" ;;
    *b) link_cut[i]="--cut-after-bytes ${at%b} --cut-for $secs" ;;
    up*)
      r="${at#up}"
      [ "$r" -ge 1 ] || die "--cut '$c': rounds start at 1"
      u="$(upload_bytes "$i")"
      link_cut[i]="--cut-after-bytes $(( (r - 1) * u + u / 2 )) --cut-for $secs" ;;
  esac
done
rate_bits() {  # tc rate -> bits per second
  "$py" -c 'import re,sys; m=re.fullmatch(r"([0-9.]+)(bit|kbit|mbit|gbit)", sys.argv[1])
print(int(float(m.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]))' "$1"
}

# --- namespaces, links, processes; all of it undone on exit ----------------------------------------
tag="spes-wan-$$"
srv_ns="$tag-srv"
made_ns=()
pids=()
server_pid=""
declare -a node_pid relay_pid
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  for p in ${pids[@]+"${pids[@]}"}; do kill -TERM "$p" 2> /dev/null || true; done
  for _ in $(seq 50); do
    local alive=0
    for p in ${pids[@]+"${pids[@]}"}; do kill -0 "$p" 2> /dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for p in ${pids[@]+"${pids[@]}"}; do kill -KILL "$p" 2> /dev/null || true; done
  local links=0
  for ns in ${made_ns[@]+"${made_ns[@]}"}; do
    # Anything still inside one of our namespaces was started by this script.
    for p in $(ip netns pids "$ns" 2> /dev/null); do kill -KILL "$p" 2> /dev/null || true; done
  done
  for ns in ${made_ns[@]+"${made_ns[@]}"}; do
    # A node's veth pair (and the tbf qdiscs on both its ends) goes with its node-side end.
    if [ "$ns" != "$srv_ns" ] && ip -n "$ns" link del wan0 2> /dev/null; then links=$((links + 1)); fi
  done
  for ns in ${made_ns[@]+"${made_ns[@]}"}; do ip netns del "$ns" 2> /dev/null || true; done
  local left
  left="$(ip netns list 2> /dev/null | grep -c "^$tag-" || true)"
  if [ "${#made_ns[@]}" -gt 0 ]; then
    echo "$me: cleaned up: ${#pids[@]} processes, $links veth links with their tbf qdiscs, ${#made_ns[@]} namespaces (left: $left)"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ip netns add "$srv_ns"
made_ns+=("$srv_ns")
ip -n "$srv_ns" link set lo up
for ((i = 0; i < nodes; i++)); do
  ns="$tag-n$i"
  ip netns add "$ns"
  made_ns+=("$ns")
  ip -n "$ns" link set lo up
  ip link add wan0 netns "$ns" type veth peer name "node$i" netns "$srv_ns"
  ip -n "$ns" addr add "10.201.$i.2/24" dev wan0
  ip -n "$srv_ns" addr add "10.201.$i.1/24" dev "node$i"
  ip -n "$ns" link set wan0 up
  ip -n "$srv_ns" link set "node$i" up
  # The rate limit, each direction: node -> server on the node's side, server -> node on the
  # server's side. Bucket: 10 ms of the rate, at least 32 KiB; queue: 100 ms of the rate.
  bits="$(rate_bits "${link_rate[i]}")"
  burst=$(( bits / 800 > 32768 ? bits / 800 : 32768 ))
  ip netns exec "$ns" tc qdisc add dev wan0 root tbf rate "${link_rate[i]}" burst "$burst" latency 100ms
  ip netns exec "$srv_ns" tc qdisc add dev "node$i" root tbf rate "${link_rate[i]}" burst "$burst" latency 100ms
done

port=50551
relay_port=50600
cat > "$out/wan.json" <<EOF
{"nodes": $nodes, "started": $(date +%s), "date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)",
 "config": "$config", "spes": "$spes", "host_cores": $cores,
 "netem": "$(echo "$netem" | sed 's/\\/\\\\/g; s/"/\\"/g')",
 "links": [$(for ((i = 0; i < nodes; i++)); do
   [ "$i" -gt 0 ] && printf ', '
   printf '{"node": %d, "rate": "%s", "rate_bits": %s, "rtt_ms": %s, "jitter_ms": %s, "cut": "%s", "relay_cut_options": "%s"}' \
     "$i" "${link_rate[i]}" "$(rate_bits "${link_rate[i]}")" "${link_rtt[i]}" "$jitter" \
     "${link_cut_spec[i]}" "${link_cut[i]}"
 done)]}
EOF

echo "$me: $nodes nodes, each in its own network namespace ($tag-n<i>), the server in $srv_ns"
echo "  rate limit: tc tbf on both ends of each node's veth link (applied)"
echo "  delay and jitter: scripts/wan_relay.py in each node's namespace (applied; netem $netem)"
echo "  packet loss: not emulated (no netem; a TCP relay sees a byte stream, not packets)"
for ((i = 0; i < nodes; i++)); do
  echo "  node $i: ${link_rate[i]} each way, ${link_rtt[i]} ms round trip +- ${jitter} ms per direction${link_cut[i]:+, cut for ${link_cut_spec[i]} (relay: ${link_cut[i]})}"
done

"$py" -c 'import json,sys; json.load(open(sys.argv[1]))' "$out/wan.json" \
  || die "internal error: $out/wan.json is not valid JSON"

# The links are emulated on this machine (veth pairs between namespaces), so plaintext is
# accepted knowingly: off loopback `spes serve` needs TLS or --insecure (docs/SECURITY.md).
ip netns exec "$srv_ns" "$spes" serve --config "$out/config.yaml" --out "$out/server" \
  --listen "0.0.0.0:$port" --insecure --overwrite > "$out/server/log.txt" 2>&1 &
server_pid=$!
pids+=("$server_pid")
for ((i = 0; i < nodes; i++)); do
  ns="$tag-n$i"
  half="$("$py" -c 'import sys; print(float(sys.argv[1]) / 2)' "${link_rtt[i]}")"
  # shellcheck disable=SC2086  # link_cut holds options
  ip netns exec "$ns" "$py" "$root/scripts/wan_relay.py" --listen "127.0.0.1:$relay_port" \
    --target "10.201.$i.1:$port" --delay-ms "$half" --jitter-ms "$jitter" --seed "$i" \
    --name "node$i" --log "$out/links/node$i.jsonl" ${link_cut[i]} > "$out/links/node$i.log" 2>&1 &
  relay_pid[i]=$!
  pids+=("${relay_pid[i]}")
done
for ((i = 0; i < nodes; i++)); do  # each relay listening before its node starts
  for _ in $(seq 100); do
    grep -q '"event": "start"' "$out/links/node$i.jsonl" 2> /dev/null && break
    kill -0 "${relay_pid[i]}" 2> /dev/null || break
    sleep 0.1
  done
  grep -q '"event": "start"' "$out/links/node$i.jsonl" 2> /dev/null \
    || die "the relay of node $i did not start: $(tail -n 3 "$out/links/node$i.log")"
done
for ((i = 0; i < nodes; i++)); do
  mkdir -p "$out/node$i"
  ip netns exec "$tag-n$i" "$spes" node --config "$out/config.yaml" --node-id "$i" \
    --server "127.0.0.1:$relay_port" --out "$out/node$i" --token-file "$out/secrets/node$i.token" \
    --progress lines --resume none > "$out/node$i/log.txt" 2>&1 &
  node_pid[i]=$!
  pids+=("${node_pid[i]}")
done

# --- watch: the time each metrics line appeared (metrics.jsonl has no clock), rounds as they come --
t0=$SECONDS
failed=""
shown=0
declare -a node_rc
while :; do
  line="$(date +%s.%N | cut -c1-14)"
  running=0
  for ((i = 0; i < nodes; i++)); do
    n=0
    [ -f "$out/node$i/metrics.jsonl" ] && n=$(wc -l < "$out/node$i/metrics.jsonl")
    line="$line $n"
    if [ -z "${node_rc[i]:-}" ]; then
      if kill -0 "${node_pid[i]}" 2> /dev/null; then
        running=1
      else
        node_rc[i]=0
        wait "${node_pid[i]}" || node_rc[i]=$?
        [ "${node_rc[i]}" = 0 ] || failed="${failed:+$failed; }node $i exited with code ${node_rc[i]}"
      fi
    fi
  done
  echo "$line" >> "$out/timeline.tsv"
  if [ -f "$out/server/rounds.jsonl" ]; then
    while [ "$shown" -lt "$(wc -l < "$out/server/rounds.jsonl")" ]; do
      shown=$((shown + 1))
      sed -n "${shown}p" "$out/server/rounds.jsonl" | "$py" "$root/scripts/wan_report.py" --round-line
    done
  fi
  if [ -n "$failed" ]; then break; fi
  if ! kill -0 "$server_pid" 2> /dev/null && [ "$running" = 1 ]; then
    failed="the sync server exited while nodes were still running (see $out/server/log.txt)"
    break
  fi
  [ "$running" = 0 ] && break
  if [ "$timeout_s" -gt 0 ] && [ $((SECONDS - t0)) -ge "$timeout_s" ]; then
    failed="--timeout $timeout_s s reached"
    break
  fi
  sleep 0.5
done
if [ -z "$failed" ]; then
  # Every node left: the server exits by itself.
  for _ in $(seq 600); do kill -0 "$server_pid" 2> /dev/null || break; sleep 0.1; done
  server_rc=0
  if kill -0 "$server_pid" 2> /dev/null; then
    failed="the sync server did not exit within 60 s after every node left"
  else
    wait "$server_pid" || server_rc=$?
    [ "$server_rc" = 0 ] || failed="the sync server exited with code $server_rc"
  fi
fi
for ((i = 0; i < nodes; i++)); do
  kill -TERM "${relay_pid[i]}" 2> /dev/null || true
done
echo "$me: run took $((SECONDS - t0)) s"
"$py" "$root/scripts/wan_report.py" "$out" || failed="${failed:+$failed; }the report failed"
if [ -n "$failed" ]; then
  echo "$me: FAILED: $failed (logs: $out/server/log.txt, $out/node<i>/log.txt, $out/links/)" >&2
  for f in "$out"/server/log.txt "$out"/node*/log.txt "$out"/links/node*.log; do
    [ -f "$f" ] && { echo "--- last lines of $f ---" >&2; tail -n 8 "$f" >&2; }
  done
  exit 1
fi
