#!/usr/bin/env bash
# Context parallelism on the GPUs of one host: tests/dist/test_dist_nccl (one process, a host thread per GPU), then
# example 13's NCCL version (one MPI process per GPU, MPI only bootstraps NCCL): builds them, checks the example
# against one GPU on the same inputs (2 GPUs, then 4 where there are 4), then benches
# causal, 32 heads, head_dim 128, bf16, S 32k-256k: one GPU's time, N GPUs' time, compute alone, communication
# alone, scaling efficiency (one GPU / (N x N GPUs)) and the communication hidden / exposed. NVLink multicast (NVLS)
# is left off. Logs, the table and JSON lines go to $OUT (default ./dist-out).
#   bench/gpu/dist_run.sh            configure and build in build-gpu-dist (needs .deps from shared/device/fetch-deps.sh)
#   bench/gpu/dist_run.sh BIN_DIR    use prebuilt example_13_context_parallel_nccl, example_13_context_parallel and
#                                    test_dist_nccl, all in BIN_DIR
#   SEQS=32768,65536 REPS=5 GPU_COUNTS="2 4" pick the sweep; BACKWARD=0 and PIECES=0 leave out the backward rows
#   and the timing of one ring step's kernel and transfer alone and together; OLD_BIN=dir also benches the
#   example_13_context_parallel_nccl in dir (another build, e.g. an earlier commit's) in the same run.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/dist-out}
mkdir -p "$OUT"
SEQS=${SEQS:-32768,65536,131072,262144}
REPS=${REPS:-5}
if [[ $# -ge 1 ]]; then
  BIN=$1
else
  cmake -S . -B build-gpu-dist -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PWD/.deps/usr" \
    -DFUSEDATTN_WITH_CUDA=ON -DFUSEDATTN_WITH_MPI=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DFUSEDATTN_BUILD_BENCH=OFF >"$OUT/configure.log" 2>&1 &&
    cmake --build build-gpu-dist --target example_13_context_parallel_nccl example_13_context_parallel test_dist_nccl \
      >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  BIN=build-gpu-dist/bin
  mkdir -p "$BIN"
  ln -sf ../examples/13_context_parallel/example_13_context_parallel_nccl "$BIN/"
  ln -sf ../examples/13_context_parallel/example_13_context_parallel "$BIN/"
  ln -sf ../tests/dist/test_dist_nccl "$BIN/"
fi
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi -L | tee "$OUT/gpus.txt"
nvidia-smi topo -m >"$OUT/topo.txt" 2>&1
GPU_COUNTS=${GPU_COUNTS:-$( [[ $gpus -ge 4 ]] && echo "2 4" || echo "2")}
export NCCL_NVLS_ENABLE=0
MPIRUN=(mpirun --oversubscribe --allow-run-as-root --bind-to none -x LD_LIBRARY_PATH)
for var in $(compgen -e | grep '^NCCL_'); do MPIRUN+=(-x "$var"); done  # every NCCL_* setting reaches the ranks
rc=0
echo "== tests/dist/test_dist_nccl (one process, every GPU here up to 4)"
"$BIN/test_dist_nccl" 2>&1 | tee "$OUT/test_dist_nccl.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
if [[ -x $BIN/example_13_context_parallel ]]; then
  echo "== MPI on CPU processes (2 ranks)"
  "${MPIRUN[@]}" -np 2 -x OMP_NUM_THREADS=4 "$BIN/example_13_context_parallel" 2>&1 | tee "$OUT/cpu_check.log" || rc=1
fi
rm -f "$OUT/dist_bench.jsonl"
for n in $GPU_COUNTS; do
  [[ $n -le $gpus ]] || continue
  echo "== NCCL check, $n GPUs"
  "${MPIRUN[@]}" -np "$n" "$BIN/example_13_context_parallel_nccl" 2>&1 | tee "$OUT/nccl_check_$n.log" || rc=1
  echo "== NCCL bench, $n GPUs"
  "${MPIRUN[@]}" -np "$n" "$BIN/example_13_context_parallel_nccl" --bench --seq "$SEQS" --reps "$REPS" \
    --json "$OUT/dist_bench.jsonl" 2>&1 | tee "$OUT/nccl_bench_$n.log" || rc=1
  if [[ -n ${OLD_BIN:-} ]]; then
    echo "== NCCL bench, $n GPUs, $OLD_BIN"
    "${MPIRUN[@]}" -np "$n" "$OLD_BIN/example_13_context_parallel_nccl" --bench --seq "$SEQS" --reps "$REPS" 2>&1 |
      tee "$OUT/nccl_bench_old_$n.log" || rc=1
  fi
  if [[ ${PIECES:-1} != 0 ]]; then
    echo "== one ring step's pieces, $n GPUs"
    "${MPIRUN[@]}" -np "$n" "$BIN/example_13_context_parallel_nccl" --pieces --seq "$SEQS" --reps "$REPS" 2>&1 |
      tee "$OUT/nccl_pieces_$n.log" || rc=1
  fi
  if [[ ${BACKWARD:-1} != 0 ]]; then
    echo "== NCCL backward bench, $n GPUs"
    "${MPIRUN[@]}" -np "$n" "$BIN/example_13_context_parallel_nccl" --backward --seq "$SEQS" --reps "$REPS" 2>&1 |
      tee "$OUT/nccl_backward_$n.log" || rc=1
  fi
done
echo "== table (card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"
cat "$OUT"/nccl_bench_[0-9]*.log 2>/dev/null | grep -E '^(S|[0-9])' | sort -u -k2,2n -k1,1n | tee "$OUT/table.txt"
if [[ -n ${OLD_BIN:-} ]]; then
  echo "== table, $OLD_BIN"
  cat "$OUT"/nccl_bench_old_*.log 2>/dev/null | grep -E '^(S|[0-9])' | sort -u -k2,2n -k1,1n | tee "$OUT/table_old.txt"
fi
exit $rc
