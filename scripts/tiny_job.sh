#!/usr/bin/env bash
# A tiny SPES job for the script tests (test_dashboard.sh, test_wan_cluster.sh), each adjusting
# it with --set: writes OUT_DIR/tokens, a small real corpus tokenized by `spes prepare` (the
# license texts every Debian system ships in /usr/share/common-licenses, about 200 kB of
# English, with a 512-piece SentencePiece vocabulary trained on them), and OUT_DIR/config.yaml,
# a 2-node model of 4 experts that syncs every 5 steps (merging every 10), 20 steps, one thread.
# Usage: scripts/tiny_job.sh SPES_BINARY OUT_DIR
set -euo pipefail
[ $# = 2 ] || { echo "usage: tiny_job.sh SPES_BINARY OUT_DIR" >&2; exit 2; }
spes="$1" out="$2"
mkdir -p "$out"
text="$(mktemp)"
trap 'rm -f "$text"' EXIT
for f in GPL-3 GPL-2 LGPL-2.1 GFDL-1.3 Apache-2.0 MPL-2.0 Artistic; do
  if [ -f "/usr/share/common-licenses/$f" ]; then cat "/usr/share/common-licenses/$f"; echo; fi
done > "$text"
[ "$(wc -c < "$text")" -gt 50000 ] || {
  echo "tiny_job.sh: too little text in /usr/share/common-licenses (install base-files)" >&2
  exit 1
}
"$spes" prepare --input "$text" --out "$out/tokens" --vocab-size 512
cat > "$out/config.yaml" <<EOC
run_name: tiny_check
model: {d_model: 32, n_layers: 2, n_heads: 2, mlp_hidden_size: 64, moe_num_experts: 4,
        moe_top_k: 2, vocab_size: 512, max_sequence_length: 32, rope_theta: 10000}
optimizer: {learning_rate: 0.003}
scheduler: {t_warmup: 5}
data: {paths: [$out/tokens], validation_fraction: 0.05}
spes_config: {mode: spes, num_peers: 2, sync_steps: 5, merge_interval: 10,
              merge_alpha_start: 0.1, merge_decay_steps: 1000, merge_topk: 1}
max_duration: 20
global_train_batch_size: 4
device_train_microbatch_size: 4
eval_interval: 0
eval_batches: 2
threads: 1
EOC
