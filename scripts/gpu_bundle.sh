#!/usr/bin/env bash
# Prepares what scripts/gpu_check.sh needs on the GPU machine, where nothing can be installed:
# builds spes, spes_tests and train_bench here (against the same PyTorch 2.11.0 CUDA 13.0 wheel
# the GPU machine has), strips them, and packs them with every shared library they load that
# is neither glibc/libstdc++ nor PyTorch's/CUDA's own (gRPC, protobuf, abseil, yaml-cpp, fmt,
# spdlog, PCRE2, OpenSSL, ... from Debian) into .gpu/bundle.tar.xz (git-ignored).
# On the GPU machine gpu_check.sh unpacks it and runs the binaries with LD_LIBRARY_PATH =
# the bundle's lib/ + that machine's torch/lib (same torch version, so the same ABI).
# Checks: every library the binaries need resolves inside the bundle, the torch directory or
# the allowed system set (a clean-machine simulation of the loader), the binaries start from
# the unpacked copy, and the bundle plus the checkout stay under the 64 MiB a device call
# carries. Usage: bash scripts/gpu_bundle.sh   (then: carry .gpu to the GPU machine)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
limit=$((64 * 1024 * 1024))

if [ ! -f build/CMakeCache.txt ]; then
  launcher=()
  command -v ccache >/dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >/dev/null
fi
nice -n 10 cmake --build build -j2 --target spes spes_tests train_bench

torch_lib=$(grep '^SPES_TORCH_LIB_DIR' build/CMakeCache.txt | cut -d= -f2)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"
cp build/spes build/tests/spes_tests build/bench/train_bench "$stage/bin/"
# The project's modules (found by the binaries in ../lib): SentencePiece's shim, and the NCCL
# backend that ranks on GPUs load together with libtorch_cuda.
modules=("$stage/lib/libspes_sentencepiece.so" "$stage/lib/libspes_nccl.so")
cp build/libspes_sentencepiece.so build/libspes_nccl.so "$stage/lib/"
strip --strip-unneeded "$stage"/bin/* "${modules[@]}"

# Libraries the GPU machine provides itself: glibc, the C++ runtime, PyTorch and CUDA (through
# its torch), the kernel's vDSO.
system_lib() {
  case "$1" in
    linux-vdso*|ld-linux*|libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libutil.so*) return 0 ;;
    libstdc++.so*|libgcc_s.so*|libcuda.so*) return 0 ;;
  esac
  return 1
}
declare -A seen=()
collect() {  # copies every non-system dependency of $1 (ldd gives the transitive closure)
  while read -r name _ path _; do
    [ -n "${seen[$name]:-}" ] && continue
    seen[$name]=1
    system_lib "$name" && continue
    case "$path" in
      "$torch_lib"/*|*/site-packages/nvidia/*) continue ;;  # torch's own, and its CUDA wheels
      /*) cp -L "$path" "$stage/lib/$name" ;;
      *) echo "gpu_bundle: $1 needs $name, which does not resolve here" >&2; exit 1 ;;
    esac
  done < <(LD_LIBRARY_PATH="$torch_lib" ldd "$1" | awk '/=>/ {print $1, $2, $3, $4}')
}
for f in "$stage"/bin/* "${modules[@]}"; do collect "$f"; done
strip --strip-unneeded "$stage"/lib/*.so* 2>/dev/null || true

# Clean-machine simulation: with only the bundle and torch on the search path (no RUNPATH into
# this checkout), every dependency must resolve to the bundle, torch, CUDA's wheels or the
# allowed system set, and the binaries must start.
for f in "$stage"/bin/* "${modules[@]}"; do
  while read -r name _ path _; do
    system_lib "$name" && continue
    case "$path" in
      "$stage"/lib/*|"$torch_lib"/*|*/site-packages/nvidia/*) ;;
      *) echo "gpu_bundle: $(basename "$f"): $name resolves to '$path', outside the bundle" >&2
         exit 1 ;;
    esac
  done < <(LD_LIBRARY_PATH="$stage/lib:$torch_lib" ldd "$f" | awk '/=>/ {print $1, $2, $3, $4}')
done
LD_LIBRARY_PATH="$stage/lib:$torch_lib" "$stage/bin/spes" --version
LD_LIBRARY_PATH="$stage/lib:$torch_lib" "$stage/bin/spes_tests" --gtest_list_tests \
  --gtest_filter='Cuda*' | head -3

mkdir -p .gpu
git rev-parse HEAD > "$stage/COMMIT"
tar -C "$stage" -cJf .gpu/bundle.tar.xz .
bundle=$(stat -c %s .gpu/bundle.tar.xz)
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
echo "gpu_bundle: .gpu/bundle.tar.xz $((bundle / 1024 / 1024)) MiB ($(ls "$stage/lib" | wc -l)" \
     "libraries), checkout $((tree / 1024 / 1024)) MiB, limit 64 MiB"
if [ $((bundle + tree)) -ge "$limit" ]; then
  echo "gpu_bundle: bundle + checkout exceed the 64 MiB a device call carries" >&2
  exit 1
fi
