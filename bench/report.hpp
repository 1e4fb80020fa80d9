/// @file report.hpp
/// What fusedattn-bench prints around Google Benchmark's own output: the measured ceilings, the roofline table
/// (one line per row) and the memory table. A reporter that forwards to the display reporter collects the runs.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include <fusedattn/fusedattn.hpp>

#include "ceilings.hpp"

namespace fusedattn::bench {

/// Forwards everything to the display reporter chosen by --benchmark_format and keeps a copy of every run.
class collecting_reporter : public benchmark::BenchmarkReporter {
 public:
  explicit collecting_reporter(benchmark::BenchmarkReporter* display) : display_(display) {}
  /// Forwards the context, then says what Google Benchmark's "Library was built as DEBUG" warning means here.
  bool ReportContext(const Context& context) override;
  void ReportRuns(const std::vector<Run>& runs) override;
  void Finalize() override { display_->Finalize(); }
  const std::vector<Run>& runs() const { return runs_; }

 private:
  benchmark::BenchmarkReporter* display_;
  std::vector<Run> runs_;
};

/// The measured roofs per thread count, and how they were measured.
struct ceilings {
  std::vector<ceiling> by_threads;
  fma_loop_info fma;
  std::size_t triad_array_bytes = 0;
  std::size_t llc_bytes = 0;
  /// The roofs of `threads`, or nullptr when not measured.
  const ceiling* find(int threads) const;
};

/// Measures the roofs for each thread count (FMA loop and triad) and records them in the JSON context.
ceilings measure_ceilings(const std::vector<int>& thread_counts, std::size_t triad_array_bytes);

/// Prints the ceilings.
void print_ceilings(std::ostream& os, const ceilings& c);

/// Prints one roofline line per row: FLOPs, compulsory and modelled bytes, both intensities, achieved GFLOP/s and
/// GB/s, the attainable min(peak, AI × bandwidth) with the modelled AI, the fraction reached and the bound.
/// Rows repeated with --benchmark_repetitions use their median.
void print_roofline(std::ostream& os, const std::vector<benchmark::BenchmarkReporter::Run>& runs, const ceilings& c);

/// Prints the memory table for the shapes of the rows run plus the assignment's (S = 128 … 2048, 8 heads, D = 64):
/// naive S×S bytes per head and for every head, against the flash working set of one thread (the tile model at
/// the flash kernel's tile sizes, and the scratch the kernel really allocates), and the ratio.
void print_memory_table(std::ostream& os, const std::vector<benchmark::BenchmarkReporter::Run>& runs);

}  // namespace fusedattn::bench
