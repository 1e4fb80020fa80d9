#!/usr/bin/env bash
# README command 1 (after install-deps.sh): builds Release and runs fusedattn-bench on its default shapes.
# Extra arguments go to the bench (Google Benchmark flags, e.g. --benchmark_filter=flash).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release -DFUSEDATTN_BUILD_TESTS=OFF -DFUSEDATTN_BUILD_EXAMPLES=OFF >/dev/null
cmake --build build/release -j"$(nproc)" --target fusedattn-bench
./build/release/bench/fusedattn-bench "$@"
