#!/usr/bin/env bash
# README command 1 (after install-deps.sh): builds Release and runs fusedattn-bench on its default (quick) set:
# the measured ceilings, one row per (kernel, type, mask, shape, threads), the roofline table and the memory table.
# The JSON goes to build/release/fusedattn-bench.json and, when matplotlib is there, the pictures to
# build/release/roofline.png (and sparsity.png for block-sparse rows).
# Extra arguments go to the bench: --full, or Google Benchmark flags (e.g. --benchmark_filter=flash).
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/release
cmake -S . -B "$out" -DCMAKE_BUILD_TYPE=Release -DFUSEDATTN_BUILD_TESTS=OFF -DFUSEDATTN_BUILD_EXAMPLES=OFF >/dev/null
# The build's output goes to a log (GCC 12 prints pages of -Wmaybe-uninitialized false positives from its own
# AVX-512 headers inside Eigen's GEMM); shown when the build fails.
log=$out/build-bench.log
echo "run-bench: building fusedattn-bench (log: $log)"
if ! cmake --build "$out" -j"$(nproc)" --target fusedattn-bench >"$log" 2>&1; then
  cat "$log"
  exit 1
fi
json=$out/fusedattn-bench.json
has_out=0
for a in "$@"; do
  case "$a" in --benchmark_out=*) has_out=1 ;; esac
done
if [ "$has_out" -eq 1 ]; then
  "./$out/bench/fusedattn-bench" "$@"
  exit 0
fi
"./$out/bench/fusedattn-bench" --benchmark_out="$json" --benchmark_out_format=json "$@"
# The pictures, with the first python3 that has matplotlib (optional).
for py in python3 /usr/bin/python3; do
  if command -v "$py" >/dev/null && "$py" -c "import matplotlib" 2>/dev/null; then
    "$py" bench/plot.py "$json" --out "$out"
    break
  fi
done
