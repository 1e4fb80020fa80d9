// fusedattn-bench: one Google Benchmark row per (kernel, scalar type, mask, shape, threads), framed by the
// measured roofs of this machine, a roofline line per row and the memory table. Kernels: naive
// (policy::cpu_naive), flash (policy::cpu<> on the compiler's best xsimd arch), and the peers (peers.hpp).
//
//   fusedattn-bench [--quick | --full] [--no-ceilings] [--triad_mib=N] [--os-memory] [Google Benchmark flags]
//
//   --quick         the default set (README command 1, a few minutes on 2 cores)
//   --full          every kernel x {f32, f16} x {dense, causal} x {1, all threads} on all shapes
//   --no-ceilings   skip measuring the roofs (the roofline table then shows no roof)
//   --triad_mib=N   size of each of the triad's three arrays in MiB (default 256)
//   --os-memory     let freed memory go back to the OS (glibc's default): see keep_freed_memory()
// Google Benchmark's flags work as usual (--benchmark_filter, --benchmark_format=json, --benchmark_out=FILE, ...).
// The ceilings and tables go to stdout with the console format, to stderr otherwise (stdout then holds the JSON).
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <benchmark/benchmark.h>

#include <fusedattn/fusedattn.hpp>

#include "peers.hpp"
#include "report.hpp"
#include "rows.hpp"

namespace fa = fusedattn;
namespace fb = fusedattn::bench;

namespace fusedattn::bench {
/// The decode rows over a long KV cache, contiguous and paged (rows_decode.cpp).
void register_decode_rows(const plan& pl);
/// The score modifiers' rows beside the plain flash rows (rows_modifiers.cpp).
void register_modifier_rows(const plan& pl);
}  // namespace fusedattn::bench

namespace {

/// Minimum seconds per row when the user gives no --benchmark_min_time: short enough for the quick set to finish
/// in a few minutes on 2 cores, long enough for the small shapes to run thousands of iterations.
constexpr const char* quick_min_time = "--benchmark_min_time=0.1";
constexpr const char* full_min_time = "--benchmark_min_time=0.5";
/// Each triad array, in MiB: far beyond a core's L3 slice (32 MiB on Zen 4/5), above most whole-socket L3s.
constexpr std::size_t default_triad_mib = 256;

struct options {
  bool full = false;
  bool ceilings = true;
  bool keep_memory = true;
  std::size_t triad_mib = default_triad_mib;
  bool console = true;        ///< the display format is the console table
  bool list_only = false;     ///< --benchmark_list_tests
  bool has_min_time = false;  ///< the user chose --benchmark_min_time
};

bool starts_with(const char* s, const char* prefix) { return std::strncmp(s, prefix, std::strlen(prefix)) == 0; }

/// Takes our own flags out of argv and notes the Google Benchmark flags that change what we print.
options parse(int& argc, char** argv) {
  options o;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (std::strcmp(a, "--full") == 0) {
      o.full = true;
    } else if (std::strcmp(a, "--quick") == 0) {
      o.full = false;
    } else if (std::strcmp(a, "--os-memory") == 0) {
      o.keep_memory = false;
    } else if (std::strcmp(a, "--no-ceilings") == 0) {
      o.ceilings = false;
    } else if (starts_with(a, "--triad_mib=")) {
      o.triad_mib = std::strtoull(a + std::strlen("--triad_mib="), nullptr, 10);
    } else {
      if (starts_with(a, "--benchmark_format=")) o.console = std::strcmp(a, "--benchmark_format=console") == 0;
      if (starts_with(a, "--benchmark_list_tests")) o.list_only = std::strcmp(a, "--benchmark_list_tests=false") != 0;
      if (starts_with(a, "--benchmark_min_time")) o.has_min_time = true;
      argv[out++] = argv[i];
    }
  }
  argc = out;
  return o;
}

/// Keeps freed heap memory in the process (glibc: no mmap for large blocks, no trimming), so that a kernel that
/// allocates scratch per call (the naive S×S matrix) touches fresh pages only on its first call. Where the first
/// touch of a page is expensive (about 30 µs per 4 KiB page in the sandboxed VM this bench was written on, i.e.
/// 0.5 s for a 64 MiB S×S matrix) the rows would otherwise time the page faults, not the kernel.
/// Returns whether the setting took.
bool keep_freed_memory() {
#if defined(__GLIBC__)
  constexpr int never_trim = 0x7fffffff;
  return mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, never_trim) == 1;
#else
  return false;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  options opt = parse(argc, argv);
  if (opt.triad_mib == 0) {
    std::cerr << "fusedattn-bench: --triad_mib must be a positive number of MiB\n";
    return 2;
  }
  // argv with our default min time added when the user gave none.
  std::vector<char*> args(argv, argv + argc);
  std::string min_time = opt.full ? full_min_time : quick_min_time;
  if (!opt.has_min_time) args.insert(args.begin() + 1, min_time.data());
  int n_args = static_cast<int>(args.size());
  args.push_back(nullptr);
  benchmark::Initialize(&n_args, args.data());
  if (benchmark::ReportUnrecognizedArguments(n_args, args.data())) return 1;

  const int max_threads = fa::default_threads();
  const fb::plan pl{opt.full, max_threads};
  for (const fb::row_spec& r : fb::kernel_rows(pl)) {
    fb::register_naive_row(r);
    fb::register_flash_row(r);
    fb::register_peer_rows(r);
  }
  fb::register_bf16_flash_rows(pl);
  fb::register_modifier_rows(pl);
  fb::register_backward_rows(pl);
  fb::register_decode_rows(pl);
  benchmark::AddCustomContext("fusedattn_peers", fb::peer_info());

  std::ostream& tables = opt.console ? std::cout : std::cerr;
  fb::ceilings roofs;
  if (opt.ceilings && !opt.list_only) {
    std::vector<int> counts{1};
    if (max_threads > 1) counts.push_back(max_threads);
    roofs = fb::measure_ceilings(counts, opt.triad_mib << 20);
    fb::print_ceilings(tables, roofs);
    tables << "Peers: " << fb::peer_info() << "\n" << std::flush;
  }
  // After the triad, whose arrays go back to the OS.
  if (opt.keep_memory && !opt.list_only) {
    const bool kept = keep_freed_memory();
    benchmark::AddCustomContext("fusedattn_heap", kept ? "freed memory kept in the process" : "allocator default");
    if (kept) tables << "Heap: freed memory stays in the process (--os-memory: allocator default)\n" << std::flush;
  }

  // The display reporter --benchmark_format asks for (owned by the library), wrapped to keep the runs.
  fb::collecting_reporter collector(benchmark::CreateDefaultDisplayReporter());
  benchmark::RunSpecifiedBenchmarks(&collector);
  if (!opt.list_only) {
    fb::print_roofline(tables, collector.runs(), roofs);
    fb::print_memory_table(tables, collector.runs());
  }
  benchmark::Shutdown();
  return 0;
}
