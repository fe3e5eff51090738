#!/usr/bin/env bash
# Installs every Debian package the project needs (build, tests, default corpus; chromium and a
# font for the dashboard's headless-browser test) and selects OpenBLAS-OpenMP as the system
# BLAS. Safe to run any number of times.
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libtorch-dev libopenblas0-openmp
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libsentencepiece-dev sentencepiece libpcre2-dev libyaml-cpp-dev libcli11-dev
  libspdlog-dev libfmt-dev nlohmann-json3-dev libgtest-dev libgmock-dev libbenchmark-dev
  libzstd-dev libssl-dev zlib1g-dev libcpp-httplib-dev
  bible-kjv sword-text-web diatheke
  chromium fonts-dejavu-core
)
# Node.js (for the reference tokenizer in tests) usually ships with the machine image; Debian's
# npm conflicts with that install, so only fall back to Debian's when no npm is on PATH.
command -v npm >/dev/null 2>&1 || PKGS+=(nodejs npm)

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "[setup] all Debian packages present"
fi

# Debian's default BLAS is the slow reference implementation: select OpenBLAS (OpenMP build).
arch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
for lib in libblas.so.3 liblapack.so.3; do
  target="/usr/lib/${arch}/openblas-openmp/${lib}"
  if [ -e "$target" ]; then
    $SUDO update-alternatives --set "${lib}-${arch}" "$target" >/dev/null
  fi
done

# The reference implementation of tokenizer.json (Hugging Face `tokenizers`, npm build) is used
# by the tests as the source of expected ids. Installed into tools/node/ (git-ignored).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -d "$here/tools/node/node_modules/tokenizers" ]; then
  mkdir -p "$here/tools/node"
  (cd "$here/tools/node" && npm install --silent --no-audit --no-fund tokenizers@0.23.2 >/dev/null 2>&1) \
    || echo "[setup] warning: npm package 'tokenizers' not installed; tokenizer.json reference test will be skipped"
fi
echo "[setup] done"
