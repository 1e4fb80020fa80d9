/// @file cpu_tile_sweep.cpp
/// fusedattn-tile-sweep: times CPU flash (f32, dense, policy::cpu<> with the build's arch) over shapes × thread
/// counts × tile-size overrides, for tuning the tile heuristic and comparing micro-kernel builds. Not a test.
///
///   fusedattn-tile-sweep [--shapes=B,H,S,D;...] [--threads=1,16] [--tiles=Q:KV,...] [--min-time=SECONDS]
///                        [--reps=N] [--clock=wall|cpu] [--peak] [--label=NAME] [--json=FILE]
///
/// --tiles: Q:KV pairs of policy.tiles.{q, kv}; 0 leaves a size to the heuristic (0:0 is the default policy).
/// Each row: one untimed call, then --reps batches of a call count calibrated to --min-time / --reps; the median
/// time per call is reported. --clock=cpu times process CPU time (for 1 thread on a shared machine; with more
/// threads it sums over them, so wall time is used for those rows). --peak measures the f32 FMA peak of the rows'
/// thread count (ceilings.hpp) right before and after each row and reports the row's rate as a share of the
/// larger of the two, so that a machine whose speed drifts is compared with itself.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include <fusedattn/fusedattn.hpp>

#include "ceilings.hpp"

namespace {

namespace fa = fusedattn;

struct sweep_shape {
  fa::index_t b, h, s, d;
};

struct options {
  std::vector<sweep_shape> shapes{{1, 8, 512, 64}, {1, 1, 4096, 64}, {1, 32, 1024, 128}, {1, 32, 512, 64}};
  std::vector<int> threads{1};
  std::vector<fa::tile_sizes> tiles{fa::tile_sizes{}};
  double min_time = 0.3;
  int reps = 5;
  bool cpu_clock = false;
  bool peak = false;
  std::string label = "flash";
  std::string json;
};

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : text) {
    if (ch == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

bool parse(int argc, char** argv, options& opt) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--peak") arg = "--peak=1";
    const auto eq = arg.find('=');
    if (eq == std::string::npos) return false;
    const std::string key = arg.substr(0, eq), val = arg.substr(eq + 1);
    if (key == "--shapes") {
      opt.shapes.clear();
      for (const auto& s : split(val, ';')) {
        const auto f = split(s, ',');
        if (f.size() != 4) return false;
        opt.shapes.push_back({std::atol(f[0].c_str()), std::atol(f[1].c_str()), std::atol(f[2].c_str()),
                              std::atol(f[3].c_str())});
      }
    } else if (key == "--threads") {
      opt.threads.clear();
      for (const auto& t : split(val, ',')) opt.threads.push_back(std::atoi(t.c_str()));
    } else if (key == "--tiles") {
      opt.tiles.clear();
      for (const auto& t : split(val, ',')) {
        const auto f = split(t, ':');
        if (f.size() != 2) return false;
        fa::tile_sizes ts;
        ts.q = std::atol(f[0].c_str());
        ts.kv = std::atol(f[1].c_str());
        opt.tiles.push_back(ts);
      }
    } else if (key == "--min-time") {
      opt.min_time = std::atof(val.c_str());
    } else if (key == "--reps") {
      opt.reps = std::max(1, std::atoi(val.c_str()));
    } else if (key == "--clock") {
      opt.cpu_clock = val == "cpu";
    } else if (key == "--peak") {
      opt.peak = val != "0";
    } else if (key == "--label") {
      opt.label = val;
    } else if (key == "--json") {
      opt.json = val;
    } else {
      return false;
    }
  }
  return true;
}

/// Seconds on the chosen clock.
double now(bool cpu_clock) {
  if (cpu_clock) {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  options opt;
  if (!parse(argc, argv, opt)) {
    std::fprintf(stderr, "usage: fusedattn-tile-sweep [--shapes=B,H,S,D;...] [--threads=1,16] [--tiles=Q:KV,...] "
                         "[--min-time=S] [--reps=N] [--clock=wall|cpu] [--peak] [--label=NAME] [--json=FILE]\n");
    return 2;
  }
  std::string rows;
  for (const auto& sh : opt.shapes) {
    const fa::problem p{sh.b, sh.h, sh.h, sh.s, sh.s, sh.d};
    const auto n = static_cast<std::size_t>(sh.b * sh.h * sh.s * sh.d);
    std::mt19937 gen(1);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    std::vector<float> q(n), k(n), v(n), o(n);
    for (auto* x : {&q, &k, &v})
      for (auto& e : *x) e = uni(gen);
    const auto tq = fa::bhsd<const float>(q.data(), p.q_dims()), tk = fa::bhsd<const float>(k.data(), p.kv_dims()),
               tv = fa::bhsd<const float>(v.data(), p.kv_dims());
    const auto to = fa::bhsd(o.data(), p.o_dims());
    const double flop = 4.0 * double(sh.b * sh.h) * double(sh.s) * double(sh.s) * double(sh.d);
    for (int threads : opt.threads) {
      for (const auto& tiles : opt.tiles) {
        fa::policy::cpu<> pol;
        pol.threads = threads;
        pol.tiles = tiles;
        const auto call = [&] { return fa::attend(pol, p, tq, tk, tv, to, fa::dense{}); };
        if (const fa::status st = call(); !st) {
          std::fprintf(stderr, "skip: %s\n", st.what());
          continue;
        }
        const bool cpu_clock = opt.cpu_clock && threads == 1;
        const double peak_before = opt.peak ? fusedattn::bench::measure_peak_flops(threads, 3) : 0.0;
        double t0 = now(cpu_clock);
        static_cast<void>(call());  // checked above
        const double once = std::max(now(cpu_clock) - t0, 1e-7);
        const long calls = std::max(1L, static_cast<long>(opt.min_time / opt.reps / once));
        std::vector<double> per_call;
        for (int r = 0; r < opt.reps; ++r) {
          t0 = now(cpu_clock);
          for (long c = 0; c < calls; ++c) static_cast<void>(call());
          per_call.push_back((now(cpu_clock) - t0) / double(calls));
        }
        std::sort(per_call.begin(), per_call.end());
        const double sec = per_call[per_call.size() / 2];
        const double peak =
            opt.peak ? std::max(peak_before, fusedattn::bench::measure_peak_flops(threads, 3)) * 1e-9 : 0.0;
        const fa::tile_sizes chosen = fa::cpu::choose_tiles(tiles, sh.d, sh.s, sh.s);
        char line[512];
        std::snprintf(line, sizeof line,
                      "{\"label\": \"%s\", \"b\": %ld, \"h\": %ld, \"s\": %ld, \"d\": %ld, \"threads\": %d, "
                      "\"tile_q\": %ld, \"tile_kv\": %ld, \"us\": %.1f, \"gflops\": %.2f, \"peak_gflops\": %.1f}",
                      opt.label.c_str(), static_cast<long>(sh.b), static_cast<long>(sh.h), static_cast<long>(sh.s),
                      static_cast<long>(sh.d), threads, static_cast<long>(chosen.q), static_cast<long>(chosen.kv),
                      sec * 1e6, flop / sec * 1e-9, peak);
        std::printf("%-10s (%ld,%ld,%ld,%ld) t%-3d tiles %4ld:%-4ld %10.1f us %8.1f GFLOP/s", opt.label.c_str(),
                    static_cast<long>(sh.b), static_cast<long>(sh.h), static_cast<long>(sh.s),
                    static_cast<long>(sh.d), threads, static_cast<long>(chosen.q), static_cast<long>(chosen.kv),
                    sec * 1e6, flop / sec * 1e-9);
        if (opt.peak) std::printf("  %5.1f %% of %.1f", 100.0 * flop / sec * 1e-9 / peak, peak);
        std::printf("\n");
        std::fflush(stdout);
        rows += (rows.empty() ? "  " : ",\n  ") + std::string(line);
      }
    }
  }
  if (!opt.json.empty()) {
    if (FILE* f = std::fopen(opt.json.c_str(), "w")) {
      std::fprintf(f, "[\n%s\n]\n", rows.c_str());
      std::fclose(f);
    }
  }
  return 0;
}
