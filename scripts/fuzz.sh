#!/usr/bin/env bash
# Fuzzes the readers of untrusted input with libFuzzer + AddressSanitizer + UBSan (clang):
#   safetensors     safetensors_parse: headers that lie (offsets, overlaps, sizes, dtypes)
#   config          config_parse: YAML text + `--set` overrides
#   upload_stream   the server's Upload handling: serialized UploadChunk records through the
#                   chunk decoding (zstd frames, chunk_coding.cpp), the chunk assembly
#                   (upload_assembly.cpp) and the stream parser (framing.cpp); its seeds of
#                   coded chunks come from tests/fuzz/make_upload_stream_seeds.py
#   round_rpc       the sync server's RPC handling (rpc_calls.cpp, behind the gRPC handlers) and
#                   round logic (RoundState) with a real tiny MoE model: sequences of calls of
#                   every RPC by the run's nodes and strangers (tests/fuzz/fuzz_round_rpc.cpp);
#                   after each call the server ticks and its status serialises, and at the end
#                   the honest nodes' next round publishes and downloads intact. Its server
#                   directories go to a tmpfs (/dev/shm) when there is one.
#   round_rpc_int8  the same with spes_config.compression int8 (honest uploads are int8 deltas;
#                   downloads may be deltas); its seeds are round_rpc's (same record format).
# The entry functions are tests/fuzz/fuzz_entries.cpp (the same code the regression test
# FuzzCases.* replays in the normal build). Builds into build-fuzz/ with clang++, compiling only
# the sources the targets need and linking the project's libtorch, protobuf, yaml-cpp, fmt,
# spdlog, OpenSSL and zstd. Each target runs SECONDS_PER_TARGET seconds (default 60) from its seed
# corpus tests/fuzz/corpus/<target>/ and the kept cases tests/fuzz/cases/<target>/ (so every
# kept case is replayed under the sanitizers; new inputs go to build-fuzz/corpus/<target>/). An
# input
# that crashes, leaks or triggers UB is copied to tests/fuzz/cases/<target>/ (the regression
# test then fails until the product code is fixed) and the script exits non-zero.
# Not run by CI (slow; needs clang). Usage:
#   bash scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

seconds="${1:-60}"
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(safetensors config upload_stream round_rpc round_rpc_int8)

need() {  # need COMMAND PACKAGE
  command -v "$1" >/dev/null ||
    { echo "fuzz.sh: $1 is required (apt-get install $2)" >&2; exit 2; }
}
need clang++ clang
need protoc protobuf-compiler

B=build-fuzz
mkdir -p "$B/obj" "$B/proto" "$B/gen/spes/common"
# libtorch of the project's PyTorch (scripts/setup.sh installs it into .venv/).
torch_dir="$(.venv/bin/python -c 'import os, torch; print(os.path.dirname(torch.__file__))')" ||
  { echo "fuzz.sh: run scripts/setup.sh first (PyTorch in .venv/)" >&2; exit 2; }
# What CMake's build_features.h says, for this build: the sync side is in, CUDA is not.
# Rewritten only when it changes: every object that includes it would be rebuilt.
features='#pragma once\n#define SPES_WITH_CUDA 0\n#define SPES_WITH_SYNC 1\n'
[ "$(printf "$features")" = "$(cat "$B/gen/spes/common/build_features.h" 2>/dev/null)" ] ||
  printf "$features" > "$B/gen/spes/common/build_features.h"
# Debian's fmt, spdlog and protobuf headers before the wheel's own copies (as CMake does,
# cmake/SpesTorch.cmake: spes_system_header_links).
mkdir -p "$B/system-headers-first"
for tree in fmt spdlog google; do
  ln -sfn "/usr/include/$tree" "$B/system-headers-first/$tree"
done

# Generated sources: the protobuf messages (no gRPC service needed) and the built-in default
# config that config.cpp links against (as CMakeLists.txt's spes_embed_text does).
pb="$B/proto/spes_sync.pb.cc"
if [ ! -f "$pb" ] || [ proto/spes_sync.proto -nt "$pb" ]; then
  protoc --proto_path=proto --cpp_out="$B/proto" proto/spes_sync.proto
fi
{
  echo 'namespace spes {'
  echo 'const char* builtin_default_config_yaml() {'
  echo '  return R"spes_embed('
  cat configs/default.yaml
  echo ')spes_embed";'
  echo '}'
  echo '}  // namespace spes'
} > "$B/gen/default_config.cpp.new"
cmp -s "$B/gen/default_config.cpp.new" "$B/gen/default_config.cpp" 2>/dev/null ||
  mv "$B/gen/default_config.cpp.new" "$B/gen/default_config.cpp"
rm -f "$B/gen/default_config.cpp.new"

san=(-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
cxxflags=(-std=gnu++17 -O1 -g "${san[@]}" -D_GLIBCXX_USE_CXX11_ABI=1 -DFMT_SHARED
          -DSPDLOG_COMPILED_LIB -DSPDLOG_FMT_EXTERNAL -DSPDLOG_SHARED_LIB -pthread
          -DSPES_SOURCE_ASSETS_DIR="\"$PWD/assets\""
          -Isrc -Itests -I"$B/proto" -I"$B/gen" -isystem "$B/system-headers-first"
          -isystem "$torch_dir/include"
          -isystem "$torch_dir/include/torch/csrc/api/include" -w)
# The library code the targets reach: the readers, and for round_rpc the model and the sync
# server without its gRPC glue (server.cpp, call_auth.cpp and the limits around the handlers).
sources=($(ls src/spes/common/*.cpp src/spes/io/*.cpp src/spes/model/*.cpp \
              src/spes/train/{checkpoint,optimizer}.cpp src/spes/data/tokenizer_path.cpp \
              src/spes/sync/wire/*.cpp src/spes/sync/round/*.cpp \
              src/spes/sync/server/*.cpp |
           grep -v -E '/(server|call_auth|call_rates|stream_limits|long_poll_limits|log_throttle|dashboard_status)\.cpp$')
         tests/fuzz/fuzz_entries.cpp tests/fuzz/fuzz_round_rpc.cpp
         "$B/proto/spes_sync.pb.cc" "$B/gen/default_config.cpp")

# True when $1 (an object) is missing or older than a file its .d lists.
stale() {
  local obj="$1" dep="${1%.o}.d"
  [ -f "$obj" ] && [ -f "$dep" ] || return 0
  local f
  for f in $(sed -e 's/^[^:]*://' -e 's/\\$//' "$dep"); do
    [ "$f" -nt "$obj" ] && return 0
  done
  return 1
}

objs=()
for src in "${sources[@]}"; do
  obj="$B/obj/$(echo "$src" | tr '/' '_').o"
  objs+=("$obj")
  if stale "$obj"; then
    echo "fuzz.sh: compiling $src"
    # Coverage instrumentation (fuzzer-no-link) on the product code, not on generated code.
    cov=(-fsanitize=fuzzer-no-link)
    case "$src" in "$B"/*) cov=() ;; esac
    # Two compilers at a time (the machine's cores; a failed one stops the script).
    clang++ "${cxxflags[@]}" "${cov[@]}" -MMD -MF "${obj%.o}.d" -c "$src" -o "$obj" &
    [ "$(jobs -rp | wc -l)" -ge 2 ] && wait -n
  fi
done
wait

libs=(-L"$torch_dir/lib" -Wl,-rpath,"$torch_dir/lib" -Wl,--no-as-needed -ltorch -ltorch_cpu -lc10
      -Wl,--as-needed
      -lprotobuf -lyaml-cpp -lspdlog -lfmt -lcrypto -lzstd -pthread)
declare -A entry=([safetensors]=fuzz_safetensors [config]=fuzz_config
                  [upload_stream]=fuzz_upload_stream [round_rpc]=fuzz_round_rpc
                  [round_rpc_int8]=fuzz_round_rpc_int8)
for t in "${targets[@]}"; do
  [ -n "${entry[$t]:-}" ] ||
    { echo "fuzz.sh: unknown target '$t' (safetensors, config, upload_stream, round_rpc," \
           "round_rpc_int8)" >&2
      exit 2; }
  bin="$B/fuzz_$t"
  if [ ! -x "$bin" ] || [ tests/fuzz/fuzz_driver.cc -nt "$bin" ] ||
     [ -n "$(find "${objs[@]}" -newer "$bin" 2>/dev/null)" ]; then
    echo "fuzz.sh: linking $bin"
    clang++ "${cxxflags[@]}" -fsanitize=fuzzer -DSPES_FUZZ_ENTRY="${entry[$t]}" \
      tests/fuzz/fuzz_driver.cc "${objs[@]}" "${libs[@]}" -o "$bin"
  fi
done

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:symbolize=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export OMP_NUM_THREADS=1
[ -d /dev/shm ] && [ -w /dev/shm ] && export TMPDIR=/dev/shm  # round_rpc's server directories
status=0
for t in "${targets[@]}"; do
  work="$B/corpus/$t" art="$B/artifacts/$t/"
  mkdir -p "$work" "$art" "tests/fuzz/cases/$t"
  echo "fuzz.sh: running $t for $seconds s"
  rc=0
  # round_rpc's inputs are call sequences: let them grow past its seeds' sizes.
  extra=()
  case "$t" in round_rpc*) extra=(-max_len=4096) ;; esac
  seeds=("tests/fuzz/corpus/$t")
  [ "$t" = round_rpc_int8 ] && seeds=(tests/fuzz/corpus/round_rpc)
  "$B/fuzz_$t" "${extra[@]}" -max_total_time="$seconds" -print_final_stats=1 -rss_limit_mb=4096 \
    -timeout=20 -artifact_prefix="$art" "$work" "${seeds[@]}" "tests/fuzz/cases/$t" \
    > "$B/$t.log" 2>&1 || rc=$?
  grep -E '^(#[0-9]+ +(INITED|DONE)|stat::|==[0-9]+==ERROR|SUMMARY|.*runtime error|terminate)' \
    "$B/$t.log" || true
  for f in "$art"*; do
    [ -f "$f" ] || continue
    name="$(basename "$f")"
    cp "$f" "tests/fuzz/cases/$t/$name"
    echo "fuzz.sh: $t: kept $f as tests/fuzz/cases/$t/$name (see $B/$t.log)"
    rm -f "$f"
  done
  if [ "$rc" -ne 0 ]; then
    echo "fuzz.sh: $t failed (exit $rc); log: $B/$t.log" >&2
    status=1
  fi
done
exit $status
