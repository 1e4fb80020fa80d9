// The ceilings, roofline and memory tables of fusedattn-bench.
#include "report.hpp"

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>
#include <set>
#include <tuple>

#include "rows.hpp"

namespace fusedattn::bench {
namespace {

using run = benchmark::BenchmarkReporter::Run;

constexpr double giga = 1e9;
/// Repetitions of each ceiling measurement; the best counts (other processes only ever slow a repetition down).
constexpr int ceiling_repeats = 10;
constexpr double mega = 1e6;
constexpr double kib = 1024.0;
constexpr double mib = 1024.0 * 1024.0;

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

/// "64 KiB", "0.5 MiB", "128 MiB", "3.2 GiB".
std::string size_text(double bytes) {
  if (bytes < mib) return fmt("%.4g KiB", bytes / kib);
  if (bytes < mib * kib) return fmt("%.4g MiB", bytes / mib);
  return fmt("%.4g GiB", bytes / (mib * kib));
}

double counter(const run& r, const char* name) {
  const auto it = r.counters.find(name);
  return it == r.counters.end() ? 0.0 : it->second.value;
}

/// Seconds per iteration of a run (iteration or aggregate).
double seconds(const run& r) { return r.GetAdjustedRealTime() / benchmark::GetTimeUnitMultiplier(r.time_unit); }

/// One row's result: its median run when repetitions were aggregated, else its median iteration run.
struct row_result {
  std::string name;
  const run* r = nullptr;
  double time = 0;
  double cpu_time = 0;
  bool error = false;
  std::string error_message;
};

std::vector<row_result> rows_of(const std::vector<run>& runs) {
  std::vector<std::string> order;
  std::set<std::string> seen;
  std::map<std::string, std::vector<const run*>> iterations;
  std::map<std::string, const run*> medians;
  std::map<std::string, std::string> errors;
  for (const run& r : runs) {
    std::string key = r.run_name.str();
    const std::string real_time_suffix = "/real_time";  // every row runs on real time; the suffix says nothing
    if (key.size() > real_time_suffix.size() &&
        key.compare(key.size() - real_time_suffix.size(), real_time_suffix.size(), real_time_suffix) == 0)
      key.resize(key.size() - real_time_suffix.size());
    if (seen.insert(key).second) order.push_back(key);
    if (r.error_occurred)
      errors[key] = r.error_message;
    else if (r.run_type == run::RT_Aggregate && r.aggregate_name == "median")
      medians[key] = &r;
    else if (r.run_type == run::RT_Iteration)
      iterations[key].push_back(&r);
  }
  std::vector<row_result> out;
  for (const std::string& key : order) {
    row_result rr;
    rr.name = key;
    if (errors.count(key)) {
      rr.error = true;
      rr.error_message = errors[key];
    } else if (medians.count(key)) {
      rr.r = medians[key];
    } else if (iterations.count(key)) {
      auto v = iterations[key];
      std::sort(v.begin(), v.end(), [](const run* a, const run* b) { return seconds(*a) < seconds(*b); });
      rr.r = v[v.size() / 2];
    } else {
      continue;
    }
    if (rr.r) {
      rr.time = seconds(*rr.r);
      rr.cpu_time = rr.r->GetAdjustedCPUTime() / benchmark::GetTimeUnitMultiplier(rr.r->time_unit);
    }
    out.push_back(rr);
  }
  return out;
}

}  // namespace

bool collecting_reporter::ReportContext(const Context& context) {
  const bool ok = display_->ReportContext(context);
  std::cerr << "(A \"Library was built as DEBUG\" warning above is Debian's libbenchmark, compiled without NDEBUG: "
               "it concerns Google Benchmark's own bookkeeping; the kernels timed here are this build's, -O3.)\n";
  return ok;
}

void collecting_reporter::ReportRuns(const std::vector<Run>& runs) {
  display_->ReportRuns(runs);
  runs_.insert(runs_.end(), runs.begin(), runs.end());
}

const ceiling* ceilings::find(int threads) const {
  for (const ceiling& c : by_threads)
    if (c.threads == threads) return &c;
  return nullptr;
}

ceilings measure_ceilings(const std::vector<int>& thread_counts, std::size_t triad_array_bytes) {
  ceilings c;
  c.fma = fma_info();
  c.triad_array_bytes = triad_array_bytes;
  c.llc_bytes = reported_llc_bytes();
  for (int t : std::set<int>(thread_counts.begin(), thread_counts.end())) {
    ceiling one{t, measure_peak_flops(t, ceiling_repeats), measure_bf16_peak_flops(t, ceiling_repeats),
                measure_bandwidth(t, triad_array_bytes, ceiling_repeats)};
    c.by_threads.push_back(one);
    const std::string suffix = "_threads_" + std::to_string(t);
    benchmark::AddCustomContext("fusedattn_peak_flops" + suffix, fmt("%.6g", one.peak_flops));
    if (one.bf16_peak_flops > 0)
      benchmark::AddCustomContext("fusedattn_bf16_peak_flops" + suffix, fmt("%.6g", one.bf16_peak_flops));
    benchmark::AddCustomContext("fusedattn_bandwidth" + suffix, fmt("%.6g", one.bandwidth));
  }
  benchmark::AddCustomContext("fusedattn_fma_loop", c.fma.arch + ", " + std::to_string(c.fma.lanes) + " lanes, " +
                                                        std::to_string(c.fma.accumulators) + " chains");
  benchmark::AddCustomContext("fusedattn_triad_array_bytes", std::to_string(triad_array_bytes));
  return c;
}

void print_ceilings(std::ostream& os, const ceilings& c) {
  os << "Ceilings (best of " << ceiling_repeats << "):\n";
  os << "  f32 FMA peak: register-resident FMA loop, " << c.fma.arch << ", " << c.fma.lanes << " lanes x "
     << c.fma.accumulators << " independent chains per thread, each thread on its CPU-time clock\n";
  os << "  bandwidth: triad a = b + s*c over 3 arrays of " << size_text(static_cast<double>(c.triad_array_bytes))
     << " (OS-reported last-level cache " << size_text(static_cast<double>(c.llc_bytes))
     << "), 3 arrays counted (STREAM convention), wall time\n";
  const bool bf16 = !c.by_threads.empty() && c.by_threads.front().bf16_peak_flops > 0;
  if (bf16) os << "  bf16 dot-product peak: vdpbf16ps loop, 16 lanes x 24 independent chains per thread\n";
  for (const ceiling& x : c.by_threads) {
    os << "  threads " << x.threads << ": peak " << fmt("%.1f", x.peak_flops / giga) << " GFLOP/s, bandwidth "
       << fmt("%.1f", x.bandwidth / giga) << " GB/s, ridge point " << fmt("%.1f", x.peak_flops / x.bandwidth)
       << " FLOP/B";
    if (x.bf16_peak_flops > 0) os << "; bf16 peak " << fmt("%.1f", x.bf16_peak_flops / giga) << " GFLOP/s";
    os << "\n";
  }
  os << std::flush;
}

void print_roofline(std::ostream& os, const std::vector<run>& runs, const ceilings& c) {
  const std::vector<row_result> rows = rows_of(runs);
  if (rows.empty()) return;
  std::size_t w = 4;
  for (const row_result& r : rows) w = std::max(w, r.name.size());
  char line[512];
  os << "\nRoofline (AI = FLOP per byte; 'min' = compulsory bytes Q,K,V,O once; 'model' = the kernel's modelled "
        "traffic,\n  a model of DRAM traffic without caches, not a measurement (profiler counters measure it: "
        "docs/teaching.md);\n  rates on real time (cpu_us: the main thread's CPU time, the kernel's own work for "
        "1-thread rows on a busy machine);\n  roof = min(peak, AI_model x bandwidth) for the row's threads, peak the "
        "bf16 dot-product peak for rows\n  on the bf16 kernels (vdpbf16ps, AMX); % = achieved / roof)\n";
  std::snprintf(line, sizeof line, "%-*s %10s %10s %8s %9s %9s %7s %8s %9s %8s %9s %6s  %s\n", static_cast<int>(w),
                "row", "time_us", "cpu_us", "GFLOP", "MB_min", "MB_model", "AI_min", "AI_model", "GFLOP/s", "GB/s",
                "roof_GF/s", "%roof", "bound");
  os << line;
  for (const row_result& r : rows) {
    if (r.error) {
      os << r.name << "  error: " << r.error_message << "\n";
      continue;
    }
    const double flop = counter(*r.r, "flop"), bytes = counter(*r.r, "bytes"), bytes_min = counter(*r.r, "bytes_min");
    const int threads = static_cast<int>(counter(*r.r, "threads"));
    const double ai = cost::intensity(flop, bytes), ai_min = cost::intensity(flop, bytes_min);
    const double gflops = flop / r.time / giga, gbs = bytes / r.time / giga;
    const ceiling* ce = c.find(threads);
    std::string roof = "-", frac = "-", bound = "-";
    if (ce && flop > 0) {
      // A row on the bf16 dot-product kernels against the bf16 peak (where measured), every other against the FMA's.
      const double peak =
          counter(*r.r, "bf16_dot") > 0 && ce->bf16_peak_flops > 0 ? ce->bf16_peak_flops : ce->peak_flops;
      const double att = cost::attainable(ai, peak, ce->bandwidth);
      roof = fmt("%.1f", att / giga);
      frac = fmt("%.1f", 100.0 * gflops * giga / att);
      bound = ai * ce->bandwidth < peak ? "memory" : "compute";
    }
    std::snprintf(line, sizeof line, "%-*s %10.1f %10.1f %8.3f %9.2f %9.2f %7.1f %8.2f %9.2f %8.2f %9s %6s  %s\n",
                  static_cast<int>(w), r.name.c_str(), r.time * mega, r.cpu_time * mega, flop / giga, bytes_min / mega, bytes / mega,
                  ai_min, ai, gflops, gbs, roof.c_str(), frac.c_str(), bound.c_str());
    os << line;
  }
  os << std::flush;
}

void print_memory_table(std::ostream& os, const std::vector<run>& runs) {
  // Distinct shapes of the rows run (the accumulation type is f32 for both f32 and f16 rows), then the
  // assignment's table (8 heads, D = 64, S = 128 … 2048).
  using key = std::tuple<index_t, index_t, index_t, index_t, index_t, index_t>;
  std::vector<key> shapes;
  std::set<key> seen;
  auto add = [&](key k) {
    if (seen.insert(k).second) shapes.push_back(k);
  };
  for (const row_result& r : rows_of(runs))
    if (!r.error)
      add({static_cast<index_t>(counter(*r.r, "b")), static_cast<index_t>(counter(*r.r, "h")),
           static_cast<index_t>(counter(*r.r, "h_kv")), static_cast<index_t>(counter(*r.r, "s_q")),
           static_cast<index_t>(counter(*r.r, "s_kv")), static_cast<index_t>(counter(*r.r, "d"))});
  for (index_t s : {128, 512, 1024, 2048}) add({1, 8, 8, s, s, 64});
  std::sort(shapes.begin(), shapes.end(), [](const key& a, const key& b) {
    return std::make_tuple(std::get<1>(a), std::get<5>(a), std::get<3>(a)) <
           std::make_tuple(std::get<1>(b), std::get<5>(b), std::get<3>(b));
  });
  char line[256];
  os << "\nMemory (f32 accumulation). naive: the S x S scores a batched three-pass pipeline materialises, per head and\n"
        "  in all; flash tiles: the model's live tiles of one thread (Q, O accumulator, K, V, scores, max and sum) at\n"
        "  the flash kernel's tile sizes; flash scratch: what the flash kernel allocates for one thread (its tiles\n"
        "  plus a packed K/V copy of one kv head, flash_scratch_bytes); ratio = naive in all / flash scratch\n";
  std::snprintf(line, sizeof line, "%-30s %12s %12s %8s %13s %14s %9s\n", "shape", "naive/head", "naive all",
                "tiles", "flash tiles", "flash scratch", "ratio");
  os << line;
  for (const key& k : shapes) {
    const problem p{std::get<0>(k), std::get<1>(k), std::get<2>(k), std::get<3>(k), std::get<4>(k), std::get<5>(k)};
    const tile_sizes t = cpu::choose_tiles({}, p.head_dim, p.seq_q, p.seq_kv);
    const cost::memory_row m = cost::memory(p, sizeof(float), {t.q, t.kv});
    const double scratch = static_cast<double>(kernels::flash_scratch_bytes<float>(p, bind(dense{}, p), {}, 1));
    const std::string name = "S = " + std::to_string(p.seq_q) +
                             (p.seq_kv != p.seq_q ? "x" + std::to_string(p.seq_kv) : std::string()) + ", " +
                             std::to_string(p.batch * p.heads) +
                             (p.batch * p.heads == 1 ? " head, D = " : " heads, D = ") + std::to_string(p.head_dim);
    const std::string tiles = std::to_string(t.q) + "x" + std::to_string(t.kv);
    const double ratio = m.naive_total / scratch;
    std::snprintf(line, sizeof line, "%-30s %12s %12s %8s %13s %14s %8sx\n", name.c_str(),
                  size_text(m.naive_per_head).c_str(), size_text(m.naive_total).c_str(), tiles.c_str(),
                  size_text(m.flash_total).c_str(), size_text(scratch).c_str(),
                  fmt(ratio < 10 ? "%.1f" : "%.0f", ratio).c_str());
    os << line;
  }
  os << std::flush;
}

}  // namespace fusedattn::bench
