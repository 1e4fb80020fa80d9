#!/usr/bin/env bash
# Everything the GPU machine runs, in one script: GPU tests, compute-sanitizer on small shapes, a deliberately broken
# build's tests (they must fail), fusedattn's timings and PyTorch's (SDPA flash / cuDNN, FlexAttention) in the same
# run, block-sparse beside FlexAttention on the same layouts (bench_gpu's peer mode, bench/peers/torch_peer.py
# --block-sparse), and a table last. Logs and JSON go to $OUT (default ./gpu-out).
#   bench/gpu/run.sh            build in build-gpu (needs .deps from shared/device/fetch-deps.sh), then run
#   bench/gpu/run.sh BIN_DIR    use prebuilt test_gpu, bench_gpu (and optional test_gpu_broken) from BIN_DIR
#   STAGES="tests sanitize broken bench torch peer" (the default) picks stages; the optional stage "ragged" (not in the
#   default) runs fusedattn_bench_ragged and torch_peer.py --ragged (from BIN_DIR: $BIN/fusedattn_bench_ragged);
#   FLEX_BUDGET caps FlexAttention's seconds;
#   BROKEN_TAGS picks the test cases the broken build runs (default "[flash],[block_sparse]").
set -uo pipefail
STAGES=" ${STAGES:-tests sanitize broken bench torch peer} "
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if [[ $# -ge 1 ]]; then
  BIN=$1
else
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PWD/.deps/usr" \
    -DFUSEDATTN_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DFUSEDATTN_BENCH_TILE_SWEEP=ON \
    -DFUSEDATTN_BUILD_EXAMPLES=OFF >/dev/null &&
    cmake --build build-gpu --target test_gpu fusedattn_bench_gpu \
      $([[ $STAGES == *" ragged "* ]] && echo fusedattn_bench_ragged) || exit 1
  BIN=build-gpu
  [[ $STAGES == *" ragged "* ]] && ln -sf bench/gpu/fusedattn_bench_ragged build-gpu/fusedattn_bench_ragged
  ln -sf tests/gpu/test_gpu build-gpu/test_gpu
  ln -sf bench/gpu/fusedattn_bench_gpu build-gpu/bench_gpu
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"

if [[ $STAGES == *" tests "* ]]; then
echo "== GPU tests"
"$BIN/test_gpu" -r compact >"$OUT/tests.log" 2>&1
echo "test_gpu exit code $?" | tee -a "$OUT/tests.log"
tail -3 "$OUT/tests.log"
fi

if [[ $STAGES == *" sanitize "* ]]; then
echo "== compute-sanitizer (memcheck, racecheck, synccheck, initcheck) on small shapes of every kernel"
: >"$OUT/sanitizer.log"
for tool in memcheck racecheck synccheck initcheck; do
  compute-sanitizer --tool $tool --error-exitcode 9 "$BIN/test_gpu" "[sanitize]" -r compact >>"$OUT/sanitizer.log" 2>&1
  echo "compute-sanitizer --tool $tool: exit code $?" | tee -a "$OUT/sanitizer.log"
done
fi

if [[ $STAGES == *" broken "* && -x "$BIN/test_gpu_broken" ]]; then
  echo "== a deliberately broken build (test_gpu_broken: test_gpu built with a kernel bug on purpose) must fail the tests"
  "$BIN/test_gpu_broken" "${BROKEN_TAGS:-[flash],[block_sparse]}" -r compact >"$OUT/broken.log" 2>&1
  echo "test_gpu_broken exit code $? (non-zero expected)" | tee -a "$OUT/broken.log"
  tail -2 "$OUT/broken.log"
fi

: >"$OUT/bench.log"
if [[ $STAGES == *" bench "* ]]; then
  echo "== fusedattn timings"
  "$BIN/bench_gpu" "$OUT/fusedattn.jsonl" | tee -a "$OUT/bench.log"
fi
if [[ $STAGES == *" torch "* ]]; then
  echo "== PyTorch timings"
  PYTHONUNBUFFERED=1 python3 bench/peers/torch_peer.py --device cuda --suite gpu --backends flash,cudnn,flex \
    --flex-budget "${FLEX_BUDGET:-240}" --out "$OUT/torch.json" 2>&1 | tee -a "$OUT/bench.log"
fi
if [[ $STAGES == *" peer "* ]]; then
  echo "== block-sparse beside FlexAttention on the same layouts, and dense kernels on items as short"
  mkdir -p "$OUT/peer"
  "$BIN/bench_gpu" "$OUT/peer/fusedattn.jsonl" peer "$OUT/peer" >"$OUT/peer/bench.log" 2>&1
  PYTHONUNBUFFERED=1 python3 bench/peers/torch_peer.py --block-sparse "$OUT/peer" --ours "$OUT/peer/fusedattn.jsonl" \
    --out "$OUT/peer/torch.json" 2>&1 |
    tee "$OUT/peer/torch.log" | sed -n '/== summary/,$p'
fi
if [[ $STAGES == *" ragged "* ]]; then
  echo "== ragged prefill (attend_ragged) beside the dense kernel, and PyTorch's varlen flash on the same batches"
  "$BIN/fusedattn_bench_ragged" --json "$OUT/ragged.jsonl" 2>&1 | tee "$OUT/ragged.log"
  PYTHONUNBUFFERED=1 python3 bench/peers/torch_peer.py --device cuda --ragged --out "$OUT/torch_ragged.json" 2>&1 |
    tee -a "$OUT/ragged.log"
fi
python3 bench/gpu/table.py "$OUT/fusedattn.jsonl" "$OUT/torch.json" | tee "$OUT/table.txt"
