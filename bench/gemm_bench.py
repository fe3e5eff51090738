#!/usr/bin/env python3
"""fp32 CPU matrix-product rate of the BLAS that PyTorch's sgemm_ reaches, for square sizes:
best of 3 repetitions, all threads. Prints one JSON line. bench/run_train_bench.sh runs it
twice: with the wheel's built-in MKL, and with Debian's OpenBLAS preloaded (LD_PRELOAD), which
is what spes's link order does (CMake SPES_CPU_BLAS=openblas, the default); and once per
OpenBLAS core type (OPENBLAS_CORETYPE=...), to measure what each of OpenBLAS's kernels gives on
this CPU. The JSON names the OpenBLAS core that served (openblas_get_corename), when it did."""
import argparse, ctypes, json, os, time

import torch


def rate(n: int, threads: int) -> float:
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    for _ in range(2):
        torch.mm(a, b, out=c)
    reps = max(2, int(4e9 / (2 * n ** 3)))
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=c)
        best = max(best, reps * 2 * n ** 3 / (time.perf_counter() - t0))
    return best


def openblas_core() -> str:
    """The core of the OpenBLAS in this process (preloaded), or "" when there is none."""
    try:
        f = ctypes.CDLL(None).openblas_get_corename
    except AttributeError:
        return ""
    f.restype = ctypes.c_char_p
    return f().decode()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", default="gemm")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--sizes", default="256,512,1024,2048")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    sizes = [int(s) for s in a.sizes.split(",")]
    gflops = {str(n): round(rate(n, a.threads) / 1e9, 1) for n in sizes}
    print(json.dumps({"name": a.name, "torch": torch.__version__, "threads": a.threads,
                      "ld_preload": os.environ.get("LD_PRELOAD", ""), "openblas_core": openblas_core(),
                      "gflop_s": gflops}))


if __name__ == "__main__":
    main()
