#!/usr/bin/env bash
# Installs a built tree into a temporary prefix, then configures, builds and runs
# examples/find_package_consumer against it (find_package(spes), spes::spes), and runs the
# installed binary. Usage: scripts/test_install.sh [BUILD_DIR]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" > "$tmp/install.log"
proto=lib/libspes_proto.a  # only in builds with the sync side (SPES_WITH_SYNC)
grep -q '^SPES_WITH_SYNC:BOOL=OFF' "$build/CMakeCache.txt" && proto=
for f in bin/spes lib/libspes.a $proto lib/libspes_sentencepiece.so \
         include/spes/io/config.h include/spes/interop/hf_export.h \
         lib/cmake/spes/spesConfig.cmake lib/cmake/spes/spesConfigVersion.cmake \
         lib/cmake/spes/spesTargets.cmake; do
  [ -e "$tmp/prefix/$f" ] || { echo "missing after install: $f"; exit 1; }
done
"$tmp/prefix/bin/spes" --version
gen=()
command -v ninja > /dev/null 2>&1 && gen=(-G Ninja)
cmake -S "$root/examples/find_package_consumer" -B "$tmp/consumer" "${gen[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$tmp/prefix" > "$tmp/configure.log" \
  || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/consumer" > "$tmp/build.log" || { cat "$tmp/build.log"; exit 1; }
"$tmp/consumer/spes_consumer"
echo "install + find_package(spes) consumer: ok"
