#!/usr/bin/env bash
# tools/offline-bundle.sh DIR [--build BUILD] [--no-build]
#
# Packs what a GPU node without internet needs to run the engine's specs and benchmarks:
#   DIR/debs/*.deb   the runtime Debian packages: LuaJIT, busted and its Lua modules, lua-argparse (engine.cli), OpenMPI (mpirun, the
#                    MCA components, PMIx and the transports it links), OpenBLAS (pthread) and gfortran's
#                    runtime; base libraries every distribution has (libc, libstdc++, zlib, ...) are left out
#   DIR/build/       a prebuilt tree: engine, libengine.so, the C tests (--build BUILD, default build-gpu,
#                    configured with -DENGINE_NATIVE=OFF so it runs on any x86-64 CPU; built first when missing
#                    and nvcc is here; --no-build skips the tree), with the toolkit's libcupti.so.<major> (the kernel
#                    trace, ENGINE_PROFILE_KERNELS)
#   DIR/MANIFEST     the packages with their versions, the tree's commit and the sizes
# tools/gpu-check.sh installs the packages into a prefix with `dpkg -x` when the machine lacks them (no root
# package database is touched) and uses DIR/build when the checkout has no build of its own.
# The whole bundle stays under 60 MiB (checked at the end; about 20 MiB of packages).
set -euo pipefail
DIR=${1:?usage: tools/offline-bundle.sh DIR [--build BUILD] [--no-build]}
shift
BUILD=build-gpu
WITH_BUILD=1
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=${2:?--build needs a directory}; shift 2 ;;
    --no-build) WITH_BUILD=0; shift ;;
    *) echo "offline-bundle.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$DIR/debs"
DIR=$(cd "$DIR" && pwd)

# The runtime closure of the engine host, busted, mpirun and libopenblas, read off `ldd` of each binary and
# MCA component on Debian 12 (dpkg -S of every library they load, minus the base system).
PKGS=(luajit libluajit-5.1-2 libluajit-5.1-common
      lua-busted lua-cliargs lua-dkjson lua-filesystem lua-luassert lua-mediator lua-penlight lua-say
      lua-system lua-term lua-argparse
      openmpi-bin openmpi-common libopenmpi3 libpmix2 libevent-core-2.1-7 libevent-pthreads-2.1-7
      libhwloc15 libfabric1 libucx0 libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200 libpsm2-2
      libpsm-infinipath1 libnuma1 libmunge2 libyaml-0-2 libatomic1
      libopenblas0-pthread libgfortran5 libquadmath0)

cd "$DIR/debs"
rm -f ./*.deb
need_update=0
for p in "${PKGS[@]}"; do
  apt-cache show "$p" >/dev/null 2>&1 || need_update=1
done
if [ "$need_update" = 1 ]; then
  SUDO=""; [ "$(id -u)" != 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
fi
apt-get download -qq "${PKGS[@]}" 2>&1 | grep -v "unsandboxed as root" || true
n=$(ls ./*.deb | wc -l)
[ "$n" -eq "${#PKGS[@]}" ] || { echo "offline-bundle.sh: downloaded $n of ${#PKGS[@]} packages" >&2; exit 1; }

if [ "$WITH_BUILD" = 1 ]; then
  cd "$ROOT"
  if [ ! -x "$BUILD/engine" ]; then
    command -v nvcc >/dev/null || { echo "offline-bundle.sh: no $BUILD/engine and no nvcc to build one" >&2; exit 1; }
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DENGINE_NATIVE=OFF -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
  fi
  [ -f "$BUILD/CMakeCache.txt" ] && grep -q "ENGINE_NATIVE:BOOL=ON" "$BUILD/CMakeCache.txt" &&
    echo "offline-bundle.sh: warning: $BUILD was configured with ENGINE_NATIVE=ON (-march=native): it may not run on another CPU" >&2
  cmake --build "$BUILD" -j "$(nproc)" >/dev/null
  rm -rf "$DIR/build"; mkdir -p "$DIR/build/ctests"
  cp "$BUILD/engine" "$BUILD/libengine.so" "$DIR/build/"
  cp "$BUILD"/ctests/* "$DIR/build/ctests/" 2>/dev/null || true
  strip --strip-unneeded "$DIR/build/libengine.so" "$DIR/build/engine" 2>/dev/null || true
  # the kernel trace (ENGINE_PROFILE_KERNELS) loads libcupti at run time: the toolkit's, of the CUDA the tree was built
  # with (the records' layout), next to libengine.so (gpu-check.sh puts the tree on LD_LIBRARY_PATH)
  cupti=$(ls "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"/lib*/libcupti.so.[0-9]* \
            "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"/extras/CUPTI/lib64/libcupti.so.[0-9]* 2>/dev/null |
          grep -E 'libcupti\.so\.[0-9]+$' | head -1 || true)
  [ -n "$cupti" ] && cp -L "$cupti" "$DIR/build/" && echo "offline-bundle.sh: $(basename "$cupti") from $(dirname "$cupti")"
fi

cd "$DIR"
{
  echo "# offline bundle made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release; echo "$PRETTY_NAME")"
  echo "commit: $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  for d in debs/*.deb; do dpkg-deb -W --showformat='${Package} ${Version}\n' "$d"; done
  du -sh debs build 2>/dev/null || true
} > MANIFEST
total=$(du -sm "$DIR" | cut -f1)
echo "offline-bundle.sh: $DIR: ${#PKGS[@]} packages$([ "$WITH_BUILD" = 1 ] && echo " and the tree of $BUILD"), ${total} MiB"
if [ "$total" -ge 60 ]; then echo "offline-bundle.sh: the bundle is ${total} MiB, over the 60 MiB budget" >&2; exit 1; fi
