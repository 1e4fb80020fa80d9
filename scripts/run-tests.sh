#!/usr/bin/env bash
# README command 2 (after install-deps.sh): builds and runs every test CI runs.
#  1. Release build (C++17) of tests + examples, ctest;
#  2. the test suite again as C++20;
#  3. install to a prefix and build an example copied out of the tree with find_package(fusedattn).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${JOBS:-$(nproc)}
export CTEST_OUTPUT_ON_FAILURE=1

echo "== [1/3] Release, C++17: build and ctest"
cmake -S . -B build/ci-release -DCMAKE_BUILD_TYPE=Release -DFUSEDATTN_BUILD_BENCH=ON >/dev/null
cmake --build build/ci-release -j"$jobs"
ctest --test-dir build/ci-release -j"$jobs" --timeout 600

echo "== [2/3] tests as C++20"
# (the CUDA translation units were compiled in stage 1; nvcc is the slow part, so not again here)
cmake -S . -B build/ci-cxx20 -DCMAKE_BUILD_TYPE=Release -DFUSEDATTN_TEST_STD=20 \
  -DFUSEDATTN_BUILD_BENCH=OFF -DFUSEDATTN_BUILD_EXAMPLES=OFF -DFUSEDATTN_WITH_CUDA=OFF >/dev/null
cmake --build build/ci-cxx20 -j"$jobs"
ctest --test-dir build/ci-cxx20 -j"$jobs" --timeout 600

echo "== [3/3] install, then build an example out of the tree with find_package(fusedattn)"
prefix=$PWD/build/ci-prefix
rm -rf "$prefix" build/ci-consumer build/ci-example
cmake --install build/ci-release --prefix "$prefix" >/dev/null
cp -r examples/01_naive_pipeline build/ci-example
cmake -S build/ci-example -B build/ci-consumer -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build build/ci-consumer -j"$jobs"
./build/ci-consumer/example_01_naive_pipeline
echo "run-tests: all passed"
