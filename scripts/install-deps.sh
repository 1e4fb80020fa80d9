#!/usr/bin/env bash
# Installs what fusedattn's build, tests and bench need from Debian, and only what is missing.
# Idempotent: runs `apt-get update` at most once, and not at all when everything is present.
#   library:        libeigen3-dev libxsimd-dev xtl-dev
#   tests, bench:   catch2 libbenchmark-dev cmake g++
#   optional peers: libopenblas-dev (naive-on-BLAS peer), python3-matplotlib (bench/plot.py)
#   fuzzing:        clang-14 libclang-rt-14-dev (libFuzzer, ASan, UBSan runtimes) libomp-14-dev (clang's OpenMP)
#   distributed:    libopenmpi-dev openmpi-bin (fusedattn/dist over MPI, its tests under mpirun)
#   aarch64:        g++-aarch64-linux-gnu qemu-user ninja-build (the NEON build cross-compiled with Ninja, its
#                   tests run by qemu-aarch64; the header-only Eigen, xsimd and Catch2 packages serve both arches)
set -euo pipefail
pkgs=(cmake g++ make libeigen3-dev libxsimd-dev xtl-dev catch2 libbenchmark-dev libopenblas-dev python3-matplotlib
  clang-14 libclang-rt-14-dev libomp-14-dev libopenmpi-dev openmpi-bin g++-aarch64-linux-gnu qemu-user ninja-build)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all present"
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# The cross toolchain and the emulator are called by name (cmake/toolchain-aarch64.cmake, run-tests stage 8).
for tool in aarch64-linux-gnu-g++ qemu-aarch64; do
  command -v "$tool" >/dev/null ||
    { echo "install-deps: $tool is missing after the install (g++-aarch64-linux-gnu, qemu-user)"; exit 1; }
done
