#!/usr/bin/env bash
# Installs the Debian packages the engine needs, only those missing.
# Usage: tools/install-deps.sh [--torch]   (--torch adds PyTorch for fixtures/baselines: Debian's python3-torch;
#   tools/install-torch.sh puts PyTorch 2.x from PyPI into tools/.venv for recipes/bench/tp_step.lua)
set -euo pipefail
pkgs=(build-essential cmake pkg-config luajit libluajit-5.1-dev lua-busted openmpi-bin libopenmpi-dev
      libopenblas-dev bible-kjv bible-kjv-text
      libdnnl2       # oneDNN's sgemm for f32 GEMMs, loaded at run time when present (kernels/cpu/gemm.c)
      lua-argparse   # engine.cli: the command line of every recipe and tool
      gnuplot-nox    # tools/plot.lua: loss and throughput curves of runs (make plot)
      clang libclang-rt-dev)  # clang + libFuzzer: the fuzz targets of spec/fuzz (make fuzz-build)
if [ "${1:-}" = "--torch" ]; then pkgs+=(python3-torch python3-numpy); fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
