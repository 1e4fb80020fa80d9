#!/usr/bin/env bash
# README command 2 (after install-deps.sh): builds and runs every test CI runs.
#  1. Release build (C++17) of tests, bench, examples (and every CUDA translation unit when nvcc is present: the GPU
#     tests' for sm_90a, the others to PTX only without a GPU; the GPU tests skip without a GPU), ctest;
#  2. C++20: every C++ translation unit of stage 1 (tests, bench, examples) compiled again as C++20, front end only;
#  3. install to a prefix and build an example copied out of the tree with find_package(fusedattn); the bench's
#     Python tools compile and read the baselines; the assignment (examples/09_assignment) copied out of the tree
#     with wrong kernels (the harness must fail them) and the reference solution (it must pass and give a report);
#  4. the CPU test suite under ASan + UBSan, its representative subset (FUSEDATTN_TEST_SUBSET; no [heavy] cases);
#  5. 60 s of libFuzzer on the attend() harness (in the background, beside stages 6 to 8).
#  6. fusedattn/dist over MPI: its tests under mpirun on 1, 2 and 3 ranks (oversubscribed), and example 13.
#  7. the Ascend backend installed against a stand-in CANN toolkit and used through find_package.
#  8. aarch64: the NEON build of a subset of the CPU tests and the Arm bf16 (BFDOT) set's tests, cross-compiled and
#     run under qemu-user.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${JOBS:-$(nproc)}
export CTEST_OUTPUT_ON_FAILURE=1
# Each stage header says how long the run has taken so far.
stage() { echo "== $* (at $((SECONDS / 60)) min $((SECONDS % 60)) s)"; }

stage "[1/3] Release, C++17: build and ctest"
# The CUDA translation units (when nvcc is present) are compiled for sm_90a only here: that target holds both flash
# kernels (mma.sync and wgmma), decode and backward, and nvcc is most of this stage's time on a 2-core machine.
# CI_CUDA_ARCHS="80;90a" compiles the library's default pair. Without a GPU, the CUDA programs outside tests/gpu
# (bench/gpu, examples 08 and 13, the NCCL test) compile to PTX only (FUSEDATTN_CUDA_PTX_ONLY: no ptxas, a third of
# their compile); tests/gpu's units keep real sm_90a code (SASS) of every kernel they test.
ptx_only=ON
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then ptx_only=OFF; fi
cmake -S . -B build/ci-release -DCMAKE_BUILD_TYPE=Release -DFUSEDATTN_BUILD_BENCH=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${CI_CUDA_ARCHS:-90a}" -DFUSEDATTN_CUDA_PTX_ONLY=$ptx_only \
  -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >/dev/null
cmake --build build/ci-release -j"$jobs"
ctest --test-dir build/ci-release -j"$jobs" --timeout 600

stage "[2/3] C++20: the C++ translation units of stage 1 compiled again as C++20 (front end only)"
# Each C++ entry of stage 1's compile_commands.json (tests, bench, examples, the GPU tests' host files; not the CUDA
# units) with its own flags, -std=gnu++20 and -fsyntax-only: parsing and every template instantiation the unit
# needs, no code generation (scripts/syntax-check.py), about a tenth of an optimising build. The headers have no
# path chosen by the language version (no __cplusplus test), so C++20 can break what compiles, not what runs: the
# tests run as C++17 in stage 1 and under the sanitizers in stage 4. (FUSEDATTN_TEST_STD=20 builds them as C++20.)
python3 scripts/syntax-check.py build/ci-release/compile_commands.json --std 20 -j "$jobs"

stage "[3/3] install, then build an example out of the tree with find_package(fusedattn)"
prefix=$PWD/build/ci-prefix
rm -rf "$prefix" build/ci-consumer build/ci-example
cmake --install build/ci-release --prefix "$prefix" >/dev/null
cp -r examples/01_naive_pipeline build/ci-example
cmake -S build/ci-example -B build/ci-consumer -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build build/ci-consumer -j"$jobs"
./build/ci-consumer/example_01_naive_pipeline

stage "[3b] Python tools: every bench script compiles; the baselines parse (bench/gpu/table.py, bench_json.py)"
python3 -c 'import sys; [compile(open(f, encoding="utf-8").read(), f, "exec") for f in sys.argv[1:]]' \
  bench/*.py bench/peers/*.py bench/gpu/*.py
rows=$(PYTHONDONTWRITEBYTECODE=1 python3 bench/gpu/table.py bench/baselines/h200.jsonl bench/baselines/h100.jsonl | wc -l)
[[ $rows -gt 20 ]] || { echo "bench/gpu/table.py read $rows lines from the GPU baselines"; exit 1; }
PYTHONDONTWRITEBYTECODE=1 python3 -c 'import sys; sys.path.insert(0, "bench"); import bench_json
assert bench_json.load("bench/baselines/xeon-gpu-host-cpu.json")[1], "no rows in the CPU baseline"'

# 3c. The assignment as a student builds it: examples/09_assignment copied out of the tree, built against the
#     prefix with the reference solution and the wrong kernels of its ci/ folder. Each wrong kernel must make the
#     harness report a mismatch (exit 1); the reference must pass, be timed, and give a report (report.py).
stage "[3c] the assignment copied out of the tree: the harness fails each wrong kernel, passes the reference"
rm -rf build/ci-assignment build/ci-assignment-build
cp -r examples/09_assignment build/ci-assignment
cmake -S build/ci-assignment -B build/ci-assignment-build -DCMAKE_PREFIX_PATH="$prefix" -DASSIGNMENT_CI_KERNELS=ON >/dev/null
cmake --build build/ci-assignment-build -j"$jobs"
for bug in keys_512 no_max causal_strict tail_tile; do
  set +e
  out=$(./build/ci-assignment-build/assignment_bug_$bug --check-only 2>&1)
  rc=$?
  set -e
  if [[ $rc -ne 1 ]] || ! grep -q "FAILED: my_attention() does not match" <<<"$out"; then
    echo "$out"; echo "the assignment harness did not catch the wrong kernel '$bug' (exit $rc)"; exit 1
  fi
  echo "  wrong kernel $bug: caught"
done
./build/ci-assignment-build/assignment_bug_none --check-only >/dev/null
python3 build/ci-assignment/report.py --harness build/ci-assignment-build/assignment_reference --quick \
  --out build/ci-assignment-build/report >/dev/null
grep -q "All checks: \*\*PASS\*\*" build/ci-assignment-build/report/report.md
grep -q "^| 1024 | 1 |" build/ci-assignment-build/report/report.md
echo "  reference: passed, timed, report written"
# 4. The CPU test suite under ASan + UBSan (the `sanitize` preset's flags, -fno-sanitize-recover=all), compiled as
#    its representative subset (FUSEDATTN_TEST_SUBSET=ON, tests/CMakeLists.txt): every test program and every kernel
#    family (naive, flash, decode, paged, ragged, block-sparse, backward, modifiers, low precision, validation) with
#    fewer instantiations. The SIMD-arch lists keep naive, scalar, the narrowest and the widest compiled arch and
#    fusedattn's own AVX-512 sets (avx2 is left out where avx512 is compiled in); the typed cases keep float and a
#    16-bit type; the test cases tagged [heavy] (the long float64 oracle sweeps, each beside a smaller case of the
#    same feature) are compiled out, and FUSEDATTN_TEST_SPEC's ~[heavy] leaves out any the subset still has (~[.]
#    keeps hidden benchmarks out too). test_amx is not built (test_amx_emulated runs its cases with the tiles
#    emulated, and test_amx skips on CPUs without AMX), nor test_lowp_generic (test_lowp's code built a second time
#    for baseline x86-64; FUSEDATTN_TEST_LOWP_GENERIC=OFF). Stage 1 builds and runs every case of every list.
#    Built at -O1 with line tables only (-g1): enough for ASan's reports, and a fifth of the compile time of -O2 -g
#    on the template-heavy test units (tests/test_core.cpp: 49 s against 250 s with g++ 12).
stage "[4] sanitizers: ASan + UBSan build of the CPU test suite, ctest"
cmake --preset sanitize -B build/ci-sanitize -DFUSEDATTN_WITH_CUDA=OFF -DFUSEDATTN_TEST_SPEC='~[.]~[heavy]' \
  -DFUSEDATTN_TEST_SUBSET=ON -DFUSEDATTN_TEST_LOWP_GENERIC=OFF -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" >/dev/null
cmake --build build/ci-sanitize -j"$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build/ci-sanitize -j"$jobs" --timeout 600 -L cpu

# 5. libFuzzer (clang-14, ASan + UBSan): replay tests/fuzz/corpus, then fuzz for FUZZ_SECONDS (60); a crash fails CI
#    and leaves the input in build/ci-fuzz/artifacts/. Built at -O1 with line tables (the harness is one unit that
#    instantiates every CPU policy for every scalar type; its compile, not the fuzzing, is most of this stage).
#    One compile and one fuzzing process: the stage runs in the background beside stages 6 to 8, which use the other
#    core, with its output in build/ci-fuzz.log, printed (and its exit status checked) after stage 8.
stage "[5] fuzz: tests/fuzz/fuzz_attend for ${FUZZ_SECONDS:-60} s from tests/fuzz/corpus (beside stages 6-8)"
fuzz_stage() {
  cmake -S . -B build/ci-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -DNDEBUG" \
    -DCMAKE_CXX_COMPILER=clang++-14 \
    -DFUSEDATTN_BUILD_FUZZ=ON -DFUSEDATTN_WITH_CUDA=OFF -DFUSEDATTN_BUILD_TESTS=OFF -DFUSEDATTN_BUILD_BENCH=OFF -DFUSEDATTN_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build build/ci-fuzz -j1 --target fuzz_attend
  rm -rf build/ci-fuzz/corpus build/ci-fuzz/artifacts
  mkdir -p build/ci-fuzz/corpus build/ci-fuzz/artifacts
  UBSAN_OPTIONS=print_stacktrace=1 \
    ./build/ci-fuzz/tests/fuzz/fuzz_attend -max_total_time="${FUZZ_SECONDS:-60}" -timeout=20 -rss_limit_mb=4096 \
    -artifact_prefix=build/ci-fuzz/artifacts/ -print_final_stats=1 build/ci-fuzz/corpus tests/fuzz/corpus
  echo "fuzz stage ended at $((SECONDS / 60)) min $((SECONDS % 60)) s"
}
mkdir -p build
# setsid: the stage is a process group of its own, ended with the script if a later stage fails.
setsid -w bash -c "set -euo pipefail; SECONDS=$SECONDS; $(declare -f fuzz_stage); fuzz_stage" >build/ci-fuzz.log 2>&1 &
fuzz_pid=$!
trap 'kill -- -"$fuzz_pid" 2>/dev/null || true' EXIT
# 6. fusedattn/dist over Open MPI: the sharded-attention tests (forward and backward) under mpirun -np 1, 2 and 3 (--oversubscribe, and
#    --allow-run-as-root for CI's root user; one OpenMP thread per rank), then example 13 on 2 ranks.
stage "[6] MPI: fusedattn/dist tests and example 13 under mpirun"
cmake -S . -B build/ci-mpi -DCMAKE_BUILD_TYPE=Release -DFUSEDATTN_WITH_MPI=ON -DFUSEDATTN_WITH_CUDA=OFF \
  -DFUSEDATTN_BUILD_BENCH=OFF >/dev/null
cmake --build build/ci-mpi -j"$jobs" --target test_dist_mpi example_13_context_parallel
ctest --test-dir build/ci-mpi -L mpi --timeout 300
# 7. The Ascend backend as a user with CANN builds it: fusedattn installed with FUSEDATTN_WITH_ASCEND=ON against a
#    stand-in toolkit (the transcribed declarations as acl/acl.h and aclnnop/*.h, the recording fake as
#    libascendcl.so), then a program that takes fusedattn::ascend from find_package runs policy::ascend against
#    policy::cpu_naive. (test_ascend, in stages 1, 2 and 4, checks the marshalling itself.)
stage "[7] Ascend: fusedattn::ascend installed against a stand-in CANN toolkit, used through find_package"
tests/ascend/package/check.sh build/ci-ascend
# 8. aarch64: the flash, naive, contract, paged and backward tests cross-compiled at -O2 with Debian's
#    g++-aarch64-linux-gnu (cmake/toolchain-aarch64.cmake; no -march=native, so policy::cpu<> is xsimd::neon64) and
#    run under qemu-aarch64 -cpu max, one ctest test per Catch2 test case. Emulation makes the float64 oracle slow:
#    the cases of arm_skip (the forward oracle sweeps of the other scalar types, and two long cross-checks) are
#    left out; float, bf16 and the scalar path still meet the oracle, every SIMD path meets the scalar one, and the
#    backward tests run whole. test_arm_bf16 alone targets FEAT_BF16 (-march=armv8.6-a, tests/CMakeLists.txt): the
#    Arm bf16 kernel set (cpu::neon_bf16, BFDOT) against the oracle, every case (4 s under qemu), and its run-time
#    check once more under -cpu neoverse-n1 (no BF16).
stage "[8] aarch64 under qemu: NEON build of the flash, naive, contract, paged and backward tests, and the BFDOT set"
for tool in aarch64-linux-gnu-g++ qemu-aarch64; do
  command -v "$tool" >/dev/null || { echo "stage 8 needs $tool: run scripts/install-deps.sh"; exit 1; }
done
arm_tests=(test_flash test_naive test_contract test_paged test_backward test_arm_bf16)
arm_skip=("flash matches the float64 oracle - (double|Eigen::half)$" "flash agrees with the naive kernel$"
  "flash: decode split matches" "naive matches the float64 oracle - (double|Eigen::half|Eigen::bfloat16)$")
# Ninja: the six test programs compile side by side (Make's top level builds named targets one after another).
cmake -S . -B build/ci-arm -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/toolchain-aarch64.cmake -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" -DFUSEDATTN_NATIVE=OFF -DFUSEDATTN_WITH_CUDA=OFF \
  -DFUSEDATTN_BUILD_BENCH=OFF -DFUSEDATTN_BUILD_EXAMPLES=OFF -DFUSEDATTN_TEST_SPEC='~[.]~[heavy]' >/dev/null
cmake --build build/ci-arm -j"$jobs" --target "${arm_tests[@]}"
ctest --test-dir build/ci-arm -j"$jobs" --timeout 600 -R "^($(IFS='|'; echo "${arm_tests[*]}")):" \
  -E "$(IFS='|'; echo "${arm_skip[*]}")"
# The run-time check: on an Armv8.2 CPU without FEAT_BF16 the BFDOT program still runs, cpu_neon_bf16 is refused
# (nothing written) and cpu_auto takes NEON (test_arm_bf16's [arm_bf16_absent] case; it skips under -cpu max).
qemu-aarch64 -L /usr/aarch64-linux-gnu -cpu neoverse-n1 build/ci-arm/tests/test_arm_bf16 "[arm_bf16_absent]"
stage "[5] fuzz: waiting for the background stage (build/ci-fuzz.log)"
fuzz_rc=0
wait "$fuzz_pid" || fuzz_rc=$?
trap - EXIT
if [[ $fuzz_rc -ne 0 ]]; then
  cat build/ci-fuzz.log; echo "stage 5 (fuzz) failed with exit status $fuzz_rc"; exit 1
fi
sed -n '/^Done [0-9]* runs/,$p' build/ci-fuzz.log  # the fuzzer's totals and the stage's end
echo "run-tests: all passed in $((SECONDS / 60)) min $((SECONDS % 60)) s"
