#!/usr/bin/env bash
# CI's short version of scripts/wan_cluster.sh (CTest: wan_cluster_emulated_links): a tiny
# model, 2 nodes, 4 rounds, each node in its own network namespace behind an emulated WAN link
# (node 0 at 100 Mbit/s, node 1 at 20 Mbit/s, 40 ms round trip), and node 1's link cut for 3 s
# in the middle of its round 2 upload. Checks that every round publishes with both nodes, that
# both nodes hold the published model's digest after every round, that the cut happened while
# the upload was under way and that the upload resumed from the bytes the server kept (the
# resumable transfers), with no node falling back to catching up.
# Skips (exit 77, CTest SKIP_RETURN_CODE) when the machine cannot emulate links: not root, no
# network namespaces, veth or tbf (wan_cluster.sh --check says which).
# Usage: scripts/test_wan_cluster.sh [BUILD_DIR]   (SPES_BIN overrides BUILD_DIR/spes)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
spes="${SPES_BIN:-$build/spes}"
py="$root/.venv/bin/python"
[ -x "$py" ] || py="$(command -v python3)"

check_rc=0
why="$(bash "$root/scripts/wan_cluster.sh" --check 2>&1)" || check_rc=$?
if [ "$check_rc" = 3 ]; then
  echo "SKIP: $why"
  exit 77
fi
[ "$check_rc" = 0 ] || { echo "FAIL: wan_cluster.sh --check: $why"; exit 1; }
[ -x "$spes" ] || { echo "FAIL: $spes not built (scripts/build.sh)"; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
t0=$SECONDS

# The tiny job (scripts/tiny_job.sh), its model grown to 2.0 M trainable values per node: a
# 7.9 MB fp32 upload in 4 gRPC chunks of 2 MiB, so that a cut in the middle (3.9 MB sent, at
# most about 0.8 MB of it still in the relay's socket buffer and the tbf queue) leaves the server
# at least one whole verified chunk to resume from. 4 rounds, a validation loss every 10 steps.
bash "$root/scripts/tiny_job.sh" "$spes" "$tmp" > "$tmp/prepare.log" 2>&1 \
  || { cat "$tmp/prepare.log"; fail "scripts/tiny_job.sh"; }
run="$tmp/run"
rc=0
SPES_BIN="$spes" bash "$root/scripts/wan_cluster.sh" --config "$tmp/config.yaml" --nodes 2 \
  --set model.d_model=128 --set model.n_layers=4 --set model.n_heads=4 \
  --set model.mlp_hidden_size=1024 --set eval_interval=10 --set spes_config.dashboard_port=-1 \
  --out "$run" --rate 100mbit --node-rate 1=20mbit --rtt 40 --jitter 2 --cut 1:up2:3 \
  --timeout 240 > "$tmp/wan.log" 2>&1 || rc=$?
cat "$tmp/wan.log"
[ "$rc" = 0 ] || fail "wan_cluster.sh exited with code $rc"
grep -q 'cleaned up: .* namespaces (left: 0)' "$tmp/wan.log" || fail "no clean-up line with 0 namespaces left"

"$py" - "$run" <<'EOF' || fail "the run's figures (above)"
import json, sys
run = sys.argv[1]
rep = json.load(open(f"{run}/wan_summary.json"))
errors = []
def check(ok, what):
    if not ok:
        errors.append(what)
check(rep["rounds_published"] == 4, f"4 rounds published, found {rep['rounds_published']}")
for r in rep["rounds"]:
    check(r["nodes_used"] == [0, 1], f"round {r['round']} used nodes {r['nodes_used']}, not both")
    check(r["digests_agree"], f"round {r['round']}: a node's model digest differs from the published one")
for x in rep["nodes"]:
    check(x["rounds"] == 4, f"node {x['node']} synced {x['rounds']} rounds, not 4")
    check(x["caught_up"] == 0, f"node {x['node']} had to catch up {x['caught_up']} times")
    check(x["steps"] == 20, f"node {x['node']} trained {x['steps']} steps, not 20")
cut = rep["nodes"][1]["cuts"]
check(len(cut) == 1 and cut[0]["connections_reset"] >= 1,
      f"node 1's link: expected one cut that reset its connection, found {cut}")
check(not rep["nodes"][0]["cuts"], "node 0's link was cut")
r2 = next(r for r in rep["rounds"] if r["round"] == 2)
resumed = r2["server_bytes_in_resumed_per_node"][1]
check(resumed > 0, "round 2: the server resumed no bytes of node 1's upload (the cut was not "
      "survived by resuming)")
check(r2["per_node"][1]["upload_resumed_from"] == resumed,
      f"round 2: node 1 resumed from byte {r2['per_node'][1]['upload_resumed_from']}, the server "
      f"counts {resumed} resumed bytes")
check(rep["validation"], "no validation loss recorded")
for e in errors:
    print("  -", e)
if not errors:
    print(f"checks ok: 4 rounds, same digests on both nodes, node 1's round 2 upload cut and "
          f"resumed at byte {resumed}")
sys.exit(1 if errors else 0)
EOF
echo "wan cluster on emulated links: ok ($((SECONDS - t0)) s)"
