#!/usr/bin/env bash
# The prepared check for the GPU machine (one NVIDIA H200, python3 with torch 2.11.0+cu130,
# nothing installable): one command, under 8 minutes, results as JSON under $OUT when set.
#   1. unpacks .gpu/bundle.tar.xz (made by scripts/gpu_bundle.sh on the CPU machine) and runs
#      the binaries against this machine's torch (LD_LIBRARY_PATH); without a bundle (or when
#      its binaries do not start) it says so and stops;
#   2. runs the CUDA tests (spes_tests --gtest_filter='Cuda*:...': CUDA-vs-CPU parity of each
#      kernel and of an fp32 training step, a bf16 run whose loss falls, memory statistics, the
#      memory meter first thing in a fresh process, no host synchronisation inside a step);
#   3. measures the bf16 matrix-product peak on the spot (8192^3, PyTorch);
#   4. benchmarks against that peak (MFU counts 4 FLOPs per parameter and token for frozen
#      experts instead of 6), amp_bf16, SPES nodes that own 1/4 of each layer's experts, each
#      shape as spes (with a profile of one more step: its CUDA kernel timeline as a chrome trace
#      and the top kernels with their share of the step; and the host synchronisations counted in
#      the timed steps, 0 expected), torch.compile and PyTorch eager (both
#      with grouped experts), most important first:
#        ref_1b:   the reference 1B model (d_model 768, 12 layers, 12 heads, 16 experts top-2,
#                  expert hidden 2048, vocabulary 151665, sequence 2048), batch 8;
#        ref_1b7b: the reference 1B-7B model (d_model 2048, 16 heads, 32 experts top-4, expert
#                  hidden 2048, vocabulary 151665, sequence 2048), batch 4, REF_COMPARE_LAYERS
#                  layers (4: torch.compile's first steps must fit the time); then spes alone
#                  with all 16 layers, batch 4, and as the reference YAML runs it (micro-batch 2,
#                  whole-layer checkpointing) with int8 and bf16 AdamW moments (48 GB card);
#        d512:     d_model 512, 8 layers, 8 experts, batch 32 x 256 (all trainable);
#   5. runs a 2-node SPES launch with both nodes on the one GPU;
#   6. with the time left, torch.compile and PyTorch eager on the d512 shape.
# Every step has its own time limit inside the 8 minutes (GPU_CHECK_BUDGET_S, 465 s of steps); a
# step that fails or runs out is recorded as such and the rest still runs. Prints the spes /
# eager / compile ratios and the kernel table of each shape at the end. Files under $OUT:
# gpu_check.json (all figures), gpu_check.log (every command's output), tests.xml (GoogleTest),
# traces.tar.gz (the chrome traces of the profiled steps).
# --cpu: the same steps on this CPU machine with tiny shapes and device cpu (checks the script
# itself, the bundle and the commands; the figures mean nothing).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
mode=gpu
[ "${1:-}" = "--cpu" ] && mode=cpu
out=${OUT:-$root/gpu_check_out}
mkdir -p "$out"
log=$out/gpu_check.log
json=$out/gpu_check.json
: > "$log"
t_start=$SECONDS
budget=${GPU_CHECK_BUDGET_S:-465}
results=$(mktemp)
trap 'rm -f "$results"' EXIT
py=${GPU_CHECK_PYTHON:-python3}
[ "$mode" = cpu ] && [ -x "$root/.venv/bin/python" ] && py=$root/.venv/bin/python

say() { echo "[gpu_check $((SECONDS - t_start))s] $*" | tee -a "$log"; }
# record KEY JSON: one result, merged into gpu_check.json at the end.
record() { printf '{"%s": %s}\n' "$1" "$2" >> "$results"; }
left() { echo $((budget - (SECONDS - t_start))); }
# run KEY LIMIT CMD...: runs CMD with min(LIMIT, time left) seconds, its output to the log;
# records {"rc", "s"} under KEY and leaves the output in $last.
last=$(mktemp)
run() {
  local key=$1 lim=$2
  shift 2
  local l
  l=$(left)
  [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -le 5 ]; then
    say "$key: skipped, out of time"
    record "$key" '{"rc": null, "skipped": "out of time"}'
    : > "$last"
    return 1
  fi
  say "$key: $* (limit ${lim}s)"
  local t0=$SECONDS
  timeout -k 5 "$lim" "$@" > "$last" 2>&1
  local rc=$?
  cat "$last" >> "$log"
  record "$key" "{\"rc\": $rc, \"s\": $((SECONDS - t0))}"
  [ $rc -eq 124 ] && say "$key: stopped at its time limit"
  return $rc
}
# The last JSON line a command printed (the benchmarks print one).
last_json() { grep '^{' "$last" | tail -1; }

# --- 1. the binaries ------------------------------------------------------------------------
torch_lib=$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
record machine "$("$py" - <<'PY'
import json, os, torch
d = {"torch": torch.__version__, "cuda": torch.version.cuda, "cores": os.cpu_count(),
     "gpus": torch.cuda.device_count()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    d.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
             multiprocessors=p.multi_processor_count)
print(json.dumps(d))
PY
)"
bundle=$root/.gpu/bundle.tar.xz
dest=${TMPDIR:-/tmp}/spes-gpu-$$
if [ ! -f "$bundle" ]; then
  say "no $bundle: run scripts/gpu_bundle.sh on the CPU machine and carry .gpu"
  record bundle '"missing"'
else
  mkdir -p "$dest"
  "$py" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$bundle" "$dest"
  record bundle "{\"commit\": \"$(cat "$dest/COMMIT" 2>/dev/null)\"}"
fi
export LD_LIBRARY_PATH="$dest/lib:$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPES_ASSETS_DIR=$root/assets SPES_SENTENCEPIECE_SHIM=$dest/lib/libspes_sentencepiece.so
export SPES_NCCL_MODULE=$dest/lib/libspes_nccl.so
spes=$dest/bin/spes
if ! run version 30 "$spes" --version; then
  say "the bundled spes does not start here; nothing else can run"
  "$py" - "$results" "$json" <<'PY'
import json, sys
r = {}
for line in open(sys.argv[1]): r.update(json.loads(line))
json.dump(r, open(sys.argv[2], "w"), indent=1)
PY
  exit 1
fi
record spes_version "\"$(tail -1 "$last")\""
device=cuda
[ "$mode" = cpu ] && device=cpu

# --- 2. CUDA tests ----------------------------------------------------------------------------
filter='Cuda*:GroupedExperts*:ChunkedLmHeadLoss*:ActivationCheckpoint*'
run tests 90 "$dest/bin/spes_tests" --gtest_filter="$filter" --gtest_output="xml:$out/tests.xml"
record tests_summary "\"$(grep -E '^\[  (PASSED|FAILED|SKIPPED)' "$last" | tr '\n' ' ' | tr -d '"')\""

# --- 3. bf16 matrix-product peak ----------------------------------------------------------------
peak_tflops=0
if [ "$mode" = gpu ]; then
  run peak_run 30 "$py" -c '
import json, time, torch
n, best = 8192, 0.0
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(3): a @ b
torch.cuda.synchronize()
for _ in range(10):
    t = time.perf_counter()
    for _ in range(10): a @ b
    torch.cuda.synchronize()
    best = max(best, 10 * 2 * n ** 3 / (time.perf_counter() - t))
print(json.dumps({"bf16_peak_tflops": best / 1e12, "shape": "8192^3, best of 10 x 10"}))'
  line=$(last_json)
  [ -n "$line" ] && record bf16_peak "$line" && \
    peak_tflops=$(echo "$line" | "$py" -c 'import json, sys; print(json.load(sys.stdin)["bf16_peak_tflops"])')
fi

# --- 4. benchmarks --------------------------------------------------------------------------------
bench=$dest/bin/train_bench
eager=$root/bench/pytorch_eager_bench.py
precision=amp_bf16
traces=$(mktemp -d)
if [ "$mode" = gpu ]; then
  ref_1b=(--d-model 768 --layers 12 --heads 12 --experts 16 --top-k 2 --hidden 2048 --vocab 151665
          --seq 2048 --batch 8 --frozen-fraction 0.75)
  ref_1b7b=(--d-model 2048 --heads 16 --experts 32 --top-k 4 --hidden 2048 --vocab 151665
            --seq 2048 --frozen-fraction 0.75)
  ref_1b7b_batch=4
  d512=(--d-model 512 --layers 8 --heads 8 --experts 8 --top-k 2 --hidden 1024 --vocab 8192
        --seq 256 --batch 32)
  ref_layers=16
  cmp_layers=${REF_COMPARE_LAYERS:-4}
  steps=(--steps 8 --warmup 3)
else
  ref_1b=(--d-model 48 --layers 2 --heads 2 --experts 4 --top-k 2 --hidden 64 --vocab 512
          --seq 32 --batch 2 --frozen-fraction 0.75)
  ref_1b7b=(--d-model 64 --heads 4 --experts 8 --top-k 2 --hidden 64 --vocab 512 --seq 64
            --frozen-fraction 0.75)
  ref_1b7b_batch=2
  d512=(--d-model 64 --layers 2 --heads 2 --experts 4 --top-k 2 --hidden 64 --vocab 256 --seq 32
        --batch 4)
  ref_layers=2
  cmp_layers=1
  steps=(--steps 1 --warmup 1)
fi
peak_arg=(--peak-tflops "$peak_tflops")
spes_bench() {  # KEY LIMIT ARGS...: one spes shape, and a profile of one more step
  local key=$1 lim=$2
  shift 2
  run "${key}_run" "$lim" "$bench" --name "$key" --device "$device" --precision "$precision" \
    "${peak_arg[@]}" "${steps[@]}" --profile "$traces/$key.json" --sync-check "$@" && \
    record "$key" "$(last_json)"
}
torch_bench() {  # KEY LIMIT ARGS...
  local key=$1 lim=$2
  shift 2
  run "${key}_run" "$lim" "$py" "$eager" --name "$key" --device "$device" --precision "$precision" \
    --threads "$(nproc)" "${peak_arg[@]}" "${steps[@]}" --moe grouped "$@" && \
    record "$key" "$(last_json)"
}
# Limits: about twice what each step is expected to take on the H200 (process start, CUDA
# initialisation, model init, 11 steps + the profiled one; torch.compile's compilation).
spes_bench ref_1b_spes 45 "${ref_1b[@]}" --fast-init
torch_bench ref_1b_torch_compile 150 "${ref_1b[@]}" --compile
torch_bench ref_1b_pytorch_eager 40 "${ref_1b[@]}"
spes_bench ref_1b7b_spes 40 "${ref_1b7b[@]}" --batch "$ref_1b7b_batch" --layers "$cmp_layers" \
  --fast-init
torch_bench ref_1b7b_torch_compile 100 "${ref_1b7b[@]}" --batch "$ref_1b7b_batch" \
  --layers "$cmp_layers" --compile
torch_bench ref_1b7b_pytorch_eager 40 "${ref_1b7b[@]}" --batch "$ref_1b7b_batch" \
  --layers "$cmp_layers"
spes_bench ref_1b7b_16_layers_spes 45 "${ref_1b7b[@]}" --batch "$ref_1b7b_batch" \
  --layers "$ref_layers" --fast-init
# The 1B-7B node as the reference YAML runs it (micro-batch 2, whole-layer checkpointing) with
# 8-bit and bf16 AdamW moments: the 48 GB card (at most 46 GB of tensors) and what the moments'
# ATen update costs against torch's fused fp32 kernel (the issue's fp32 run: 14,964 tokens/s).
for md in int8 bf16; do
  spes_bench "ref_1b7b_16_layers_b2_${md}_spes" 45 "${ref_1b7b[@]}" --layers "$ref_layers" \
    --batch 2 --activation-checkpointing whole_layer --moment-dtype "$md" --fast-init
done
spes_bench d512_spes 30 "${d512[@]}"
tar -C "$traces" -czf "$out/traces.tar.gz" . && rm -rf "$traces"

# --- 5. a 2-node SPES launch on the one GPU ----------------------------------------------------------
work=$(mktemp -d)
"$py" - "$work/tokens.bin" <<'PY'
import random, struct, sys
random.seed(3)
v = 512
toks = [random.randrange(v) if random.random() < 0.1 else (i * 7) % v for i in range(300000)]
open(sys.argv[1], "wb").write(struct.pack("<%dI" % len(toks), *toks))
PY
launch_model="{d_model: 256, n_layers: 4, n_heads: 4, mlp_hidden_size: 512, moe_num_experts: 8,
        moe_top_k: 2, vocab_size: 512, max_sequence_length: 128}"
[ "$mode" = cpu ] && launch_model="{d_model: 32, n_layers: 2, n_heads: 2, mlp_hidden_size: 32,
        moe_num_experts: 4, moe_top_k: 2, vocab_size: 512, max_sequence_length: 32}"
cat > "$work/launch.yaml" <<EOF
model: $launch_model
optimizer: {learning_rate: 0.002}
scheduler: {t_warmup: 10}
data: {paths: [$work/tokens.bin], validation_fraction: 0.02}
spes_config: {mode: spes, num_peers: 2, sync_steps: 10, transfer_dtype: bf16, merge_interval: 20}
max_duration: 40
global_train_batch_size: 8
device_train_microbatch_size: 8
eval_interval: 20
eval_batches: 4
device: $device
precision: $precision
activation_checkpointing: one_in_two
EOF
if run spes_launch_2_nodes 60 "$spes" launch --config "$work/launch.yaml" --nodes 2 \
     --out "$work/launch"; then
  record spes_launch_summary "$("$py" - "$work/launch" <<'PY'
import glob, json, os, sys
d = sys.argv[1]
out = {}
for node in sorted(glob.glob(os.path.join(d, "node*"))):
    lines = [json.loads(l) for l in open(os.path.join(node, "metrics.jsonl"))]
    syncs = [l["sync"] for l in lines if "sync" in l]
    out[os.path.basename(node)] = {"steps": len(lines), "first_loss": lines[0]["loss"],
                                   "last_loss": lines[-1]["loss"], "sync_rounds": len(syncs),
                                   "gpu_peak_allocated_mb": lines[-1].get("gpu_peak_allocated_mb")}
print(json.dumps(out))
PY
)"
fi
rm -rf "$work" "$dest"

# --- 6. what is left of the time: the small shape's PyTorch references ----------------------------------
torch_bench d512_torch_compile 75 "${d512[@]}" --compile
torch_bench d512_pytorch_eager 30 "${d512[@]}"

# --- summary ----------------------------------------------------------------------------------------
record elapsed_s "$((SECONDS - t_start))"
"$py" - "$results" "$json" <<'PY'
import json, sys
r = {}
for line in open(sys.argv[1]):
    r.update(json.loads(line))
def get(k, f):
    v = r.get(k)
    return v.get(f) if isinstance(v, dict) else None
s = {}
for shape in ("ref_1b", "ref_1b7b", "d512"):
    sp = get(f"{shape}_spes", "tokens_per_s")
    for other in ("pytorch_eager", "torch_compile"):
        o = get(f"{shape}_{other}", "tokens_per_s")
        if sp and o:
            s[f"{shape}_spes_over_{other}"] = round(sp / o, 3)
    for k in ("tokens_per_s", "mfu", "gpu_peak_allocated_mb", "host_syncs_per_step"):
        s[f"{shape}_spes_{k}"] = get(f"{shape}_spes", k)
    for other in ("pytorch_eager", "torch_compile"):
        s[f"{shape}_{other}_gpu_peak_allocated_mb"] = get(f"{shape}_{other}", "gpu_peak_allocated_mb")
for key in ("ref_1b7b_16_layers_spes", "ref_1b7b_16_layers_b2_int8_spes",
            "ref_1b7b_16_layers_b2_bf16_spes"):
    for k in ("tokens_per_s", "mfu", "gpu_peak_allocated_mb", "host_syncs_per_step"):
        s[f"{key}_{k}"] = get(key, k)
r["summary"] = s
json.dump(r, open(sys.argv[2], "w"), indent=1)
print(json.dumps(s, indent=1))
# The kernel table of each profiled shape (the spes run's "profile").
for key, v in r.items():
    p = v.get("profile") if isinstance(v, dict) else None
    if not p:
        continue
    busy = p.get("device_busy_share")
    print(f"\n{key}: one step {p['step_s'] * 1e3:.1f} ms, top {p['what']}"
          + (f", device busy {busy:.0%} of the step" if busy is not None else ""))
    for row in p["top"]:
        print(f"  {row['share']:6.1%} {row['ms']:9.2f} ms {row['calls']:5d}x  {row['name'][:110]}")
PY
say "done: $json"
