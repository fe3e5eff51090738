#!/usr/bin/env bash
# Runs the training benchmarks of docs/PERFORMANCE.md (run it on an otherwise idle machine) and
# prints one JSON line each: the CPU GEMM rate of the wheel's MKL and of Debian's OpenBLAS (the
# one spes uses, CMake SPES_CPU_BLAS) with the core it picks by itself and with each of its
# x86 core types (OPENBLAS_CORETYPE: what spes's start-up selection, common/cpu_blas.h, can
# choose from), three model sizes, the d_model 512 model with 3/4 of its
# experts frozen, and the same d_model 512 model in PyTorch 2.11 (the wheel in .venv/, the
# same libtorch spes is built against, MKL as shipped) eager and under torch.compile, run right
# after the spes run, and eager again with OpenBLAS preloaded; then the side-by-side ratios and
# the frozen-expert saving.
# Prints the load average first: the figures are only comparable on a quiet machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/build.sh train_bench >/dev/null
PY=.venv/bin/python
B=build/bench/train_bench
openblas=$(ldd "$B" | awk '/libopenblas/ {print $3; exit}')
out=$(mktemp)
trap 'rm -f "$out"' EXIT
echo "{\"load_average\": \"$(cut -d' ' -f1-3 /proc/loadavg)\", \"cores\": $(nproc)}"
run() { "$@" | tee -a "$out"; }
run $PY bench/gemm_bench.py --name gemm_mkl
if [ -n "$openblas" ]; then
  run env LD_PRELOAD="$openblas" $PY bench/gemm_bench.py --name gemm_openblas
  for core in Prescott Sandybridge Haswell Zen SkylakeX Cooperlake; do
    run env LD_PRELOAD="$openblas" OPENBLAS_CORETYPE=$core $PY bench/gemm_bench.py \
      --name "gemm_openblas_$core" --sizes 1024
  done
fi
run $B --name d256 --d-model 256 --layers 4 --heads 4 --hidden 512 --seq 256 --batch 8
run $B --name d512 --steps 5
run $B --name d512-one-pass --micro-batch 0 --steps 5
run $PY bench/pytorch_eager_bench.py --steps 5
run $PY bench/pytorch_eager_bench.py --steps 5 --compile
if [ -n "$openblas" ]; then  # the same eager model on the BLAS spes uses, for reference
  run env LD_PRELOAD="$openblas" $PY bench/pytorch_eager_bench.py --steps 5 --name pytorch_eager_openblas
fi
run $B --name d512-frozen75 --frozen-fraction 0.75 --steps 5
run $B --name d768 --d-model 768 --layers 8 --heads 12 --hidden 1536 --seq 256 --batch 8 --steps 3
$PY - "$out" <<'PY'
import json, sys
r = {d["name"]: d for d in map(json.loads, open(sys.argv[1]))}
a, e, c, f = r["d512"], r["pytorch_eager"], r["pytorch_compile"], r["d512-frozen75"]
frozen = a["trainable_params"] - f["trainable_params"]
print(json.dumps({"name": "summary", "d512_mfu": a["mfu"],
                  "spes_over_pytorch_eager_tokens_per_s": a["tokens_per_s"] / e["tokens_per_s"],
                  "spes_over_torch_compile_tokens_per_s": a["tokens_per_s"] / c["tokens_per_s"],
                  "frozen75_peak_rss_saving_mib": a["peak_rss_mb"] - f["peak_rss_mb"],
                  "frozen75_grad_plus_adamw_mib": frozen * 12 / 2**20}))
PY
echo "{\"load_average_after\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}"
