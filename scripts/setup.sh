#!/usr/bin/env bash
# Installs what the project needs, safe to run any number of times:
#   - Debian packages: compiler and build tools, gRPC/protobuf, tokenizer and config libraries,
#     GoogleTest, gloo's headers (libtorch's Gloo process group includes them; the wheel does
#     not ship them), the default corpus (two public-domain Bibles), iproute2 (ip, tc: the
#     emulated WAN links of scripts/wan_cluster.sh);
#   - PyTorch 2.11.0 from PyPI (the CUDA 13.0 build; its libtorch is what CMake builds against)
#     into the project-local virtual environment .venv/ (git-ignored), with the packages of
#     scripts/requirements.txt.
# With --tests it also installs what only the test suite uses: the reference libraries from
# PyPI (Hugging Face tokenizers and transformers, scripts/requirements-tests.txt), and chromium
# for the dashboard's headless-browser test.
# Environment: SPES_PYTHON=/path/to/python3 picks the interpreter that creates .venv/.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

with_tests=0
for arg in "$@"; do
  case "$arg" in
    --tests) with_tests=1 ;;
    -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup.sh: unknown option '$arg' (use --tests or nothing)" >&2; exit 2 ;;
  esac
done

PKGS=(
  build-essential cmake ninja-build pkg-config git ca-certificates python3 python3-venv
  libopenblas0-openmp libopenblas-openmp-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libsentencepiece-dev sentencepiece libpcre2-dev libyaml-cpp-dev libcli11-dev
  libspdlog-dev libfmt-dev nlohmann-json3-dev libgtest-dev libgmock-dev libbenchmark-dev
  libzstd-dev libssl-dev zlib1g-dev libxxhash-dev
  libgloo-dev
  bible-kjv sword-text-web diatheke
  iproute2
)
if [ "$with_tests" = 1 ]; then
  PKGS+=(chromium fonts-dejavu-core)
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] apt: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "[setup] apt: all Debian packages present"
fi

# --- Python environment with PyTorch (and the test references) ---------------------------------
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
  py="${SPES_PYTHON:-python3}"
  if ! "$py" -m venv "$venv" >/dev/null 2>&1; then
    # An interpreter without the venv module (e.g. a PATH python3 without ensurepip): Debian's.
    rm -rf "$venv"
    /usr/bin/python3 -m venv "$venv"
  fi
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
fi
# Free space first: a disk that fills half-way through PyTorch's install leaves a broken .venv.
need_space() {  # need_space GB WHAT: stop with a clear message when a disk it uses lacks GB
  local gb=$1 what=$2 dir free
  for dir in "$here" "${TMPDIR:-/tmp}"; do
    free=$(df -Pk "$dir" | awk 'NR == 2 {print int($4 / 1048576)}')
    if [ "$free" -lt "$gb" ]; then
      echo "[setup] error: $what needs about $gb GB free on the disk of $dir, which has $free GB." >&2
      echo "[setup] Free some space (old clones' .venv/ and build/, runs/, 'pip cache purge') and run this again." >&2
      exit 1
    fi
  done
}
reqs=("$here/scripts/requirements.txt")
[ "$with_tests" = 1 ] && reqs+=("$here/scripts/requirements-tests.txt")
for r in "${reqs[@]}"; do
  stamp="$venv/.installed-$(basename "$r")"
  want="$(sha256sum < "$r" | cut -c1-16)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "[setup] python: $(basename "$r") already in .venv"
    continue
  fi
  echo "[setup] python: installing $(grep -v '^#' "$r" | grep . | tr '\n' ' ')into .venv"
  case "$r" in
    */requirements.txt) echo "[setup]   (PyTorch 2.11.0 with its CUDA 13 libraries: about 3 GB to download, 4.7 GB on disk)"
                        need_space 9 "installing PyTorch" ;;
    *) need_space 2 "installing the test references" ;;
  esac
  t0=$SECONDS
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$r"
  echo "$want" > "$stamp"
  echo "[setup] python: $(basename "$r") installed in $((SECONDS - t0)) s"
done
echo "[setup] done"
