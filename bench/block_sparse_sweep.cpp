// fusedattn-sparsity: block-sparse attention against dense flash over a sweep of sparsities × block shapes, like the
// reference kernel's benchmark. Prints a table and writes Google-Benchmark-style JSON rows (block_sparse/...) that
// bench/plot.py turns into sparsity.png. Every timing is the median of --reps interleaved runs (dense, sparse, ...).
//
//   fusedattn-sparsity [--h=1] [--b=1] [--s=4096] [--d=128] [--threads=1] [--reps=5] [--seed=1]
//                      [--blocks=128x128,128x512,...|all] [--sparsity=0,0.05,0.1,...] [--frame=L,R,T,B]
//                      [--check=1] [--clock=auto|cpu|wall] [--json=FILE]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <fusedattn/fusedattn.hpp>

namespace fa = fusedattn;

namespace {

struct options {
  fa::index_t h = 1, b = 1, s = 4096, d = 128;
  int threads = 1, reps = 5;
  std::uint64_t seed = 1;
  std::vector<std::pair<fa::index_t, fa::index_t>> blocks{{128, 128}, {128, 512}, {256, 256}, {512, 512}, {1024, 1024}};
  std::vector<double> sparsities{0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9};
  fa::block_frame frame{};
  bool check = true;
  std::string clock = "auto";  ///< cpu, wall, or auto: cpu time for 1 thread, wall time otherwise
  std::string json;
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

bool parse(int argc, char** argv, options& o) {
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    const auto eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) return false;
    const std::string key = arg.substr(2, eq - 2), val = arg.substr(eq + 1);
    if (key == "h") o.h = std::stoll(val);
    else if (key == "b") o.b = std::stoll(val);
    else if (key == "s") o.s = std::stoll(val);
    else if (key == "d") o.d = std::stoll(val);
    else if (key == "threads") o.threads = std::stoi(val);
    else if (key == "reps") o.reps = std::max(1, std::stoi(val));
    else if (key == "seed") o.seed = std::stoull(val);
    else if (key == "check") o.check = val != "0";
    else if (key == "json") o.json = val;
    else if (key == "clock" && (val == "cpu" || val == "wall" || val == "auto")) o.clock = val;
    else if (key == "sparsity") {
      o.sparsities.clear();
      for (const auto& x : split(val, ',')) o.sparsities.push_back(std::stod(x));
    } else if (key == "frame") {
      const auto f = split(val, ',');
      if (f.size() != 4) return false;
      o.frame = {std::stoll(f[0]), std::stoll(f[1]), std::stoll(f[2]), std::stoll(f[3])};
    } else if (key == "blocks") {
      o.blocks.clear();
      const fa::index_t sizes[] = {128, 256, 512, 1024};
      if (val == "all") {
        for (auto bq : sizes)
          for (auto bkv : sizes) o.blocks.emplace_back(bq, bkv);
      } else {
        for (const auto& x : split(val, ',')) {
          const auto xy = split(x, 'x');
          if (xy.size() != 2) return false;
          o.blocks.emplace_back(std::stoll(xy[0]), std::stoll(xy[1]));
        }
      }
    } else {
      return false;
    }
  }
  return true;
}

/// Process CPU seconds so far. On a shared machine a 1-thread run's CPU time leaves out the time other programs
/// held the core, which wall time does not.
double cpu_now() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

/// Seconds of one call of `f`: CPU time (`cpu`) or wall time.
template <class F>
double seconds(F&& f, bool cpu) {
  if (cpu) {
    const double t0 = cpu_now();
    f();
    return cpu_now() - t0;
  }
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Stops the program with the library's reason when a call fails.
void must(const fa::status& st) {
  if (st) return;
  std::fprintf(stderr, "fusedattn-sparsity: %s\n", st.what());
  std::exit(1);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct json_row {
  std::string name;
  double us;
  std::vector<std::pair<std::string, double>> counters;
};

void write_json(const std::string& path, const options& o, const std::vector<json_row>& rows) {
  std::ofstream out(path);
  char host[256] = "?", date[32] = "?";
  gethostname(host, sizeof host - 1);
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%S+00:00", std::gmtime(&now));
  out << "{\n  \"context\": {\"executable\": \"fusedattn-sparsity\", \"host_name\": \"" << host
      << "\", \"date\": \"" << date << "\", \"num_cpus\": " << std::thread::hardware_concurrency()
      << ", \"threads\": " << o.threads
      << ", \"reps\": " << o.reps
      << ", \"clock\": \"" << o.clock << "\"},\n  \"benchmarks\": [\n";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const json_row& r = rows[i];
    out << "    {\"name\": \"" << r.name << "\", \"run_name\": \"" << r.name
        << "\", \"run_type\": \"iteration\", \"iterations\": " << o.reps << ", \"real_time\": " << r.us
        << ", \"cpu_time\": " << r.us << ", \"time_unit\": \"us\", \"label\": \"f32 block_sparse\"";
    for (const auto& c : r.counters) out << ", \"" << c.first << "\": " << c.second;
    out << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
  }
  out << "  ]\n}\n";
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  if (!parse(argc, argv, o)) {
    std::fprintf(stderr,
                 "usage: fusedattn-sparsity [--h=N] [--b=N] [--s=N] [--d=N] [--threads=N] [--reps=N] [--seed=N]\n"
                 "       [--blocks=QxKV,...|all] [--sparsity=x,...] [--frame=L,R,T,B] [--check=0|1]\n"
                 "       [--clock=auto|cpu|wall] [--json=FILE]\n");
    return 2;
  }
  const fa::problem p{o.b, o.h, o.h, o.s, o.s, o.d};
  const bool cpu_clock = o.clock == "cpu" || (o.clock == "auto" && o.threads == 1);
  const fa::policy::cpu<> flash{o.threads};
  std::mt19937 rng(static_cast<unsigned>(o.seed));
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> q(static_cast<std::size_t>(p.batch * p.heads * p.seq_q * p.head_dim)), k(q.size()), v(q.size());
  for (auto* buf : {&q, &k, &v})
    for (auto& x : *buf) x = u(rng);
  std::vector<float> o_dense(q.size()), o_sparse(q.size()), o_check(q.size());
  const auto qv = fa::bhsd<const float>(q.data(), p.q_dims());
  const auto kv = fa::bhsd<const float>(k.data(), p.kv_dims());
  const auto vv = fa::bhsd<const float>(v.data(), p.kv_dims());
  const bool framed = o.frame.left_cols || o.frame.right_cols || o.frame.top_rows || o.frame.bottom_rows;
  const std::string frame_text = framed ? std::to_string(o.frame.left_cols) + "," + std::to_string(o.frame.right_cols) +
                                              "," + std::to_string(o.frame.top_rows) + "," +
                                              std::to_string(o.frame.bottom_rows)
                                        : "-";

  std::printf("fusedattn-sparsity: f32, %d thread(s), %s time, median of %d interleaved runs; 'equal' = max |O - "
              "naive(same mask)| <= 1e-5 (and bitwise == flash at density 1); ideal = 1 / density; empty = a layout with no "
              "block\n",
              o.threads, cpu_clock ? "CPU" : "wall", o.reps);
  std::printf("%-10s %3s %2s %6s %4s %-9s %8s %8s %6s %12s %12s %8s %8s %9s\n", "block", "H", "B", "S", "D", "frame",
              "sparsity", "density", "equal", "flash_us", "sparse_us", "speedup", "ideal", "empty_us");
  std::vector<json_row> rows;
  int failures = 0;
  for (const auto& bs : o.blocks) {
    const fa::block_geometry g{p.seq_q, p.seq_kv, bs.first, bs.second};
    // The floor: a call whose layout lists no block (validation, plan, scratch, O = 0 and lse = -inf).
    const fa::block_layout empty = fa::random_layout(g, 1.0, o.seed);
    const auto run_empty = [&] {
      must(fa::attend(flash, p, qv, kv, vv, fa::bhsd(o_sparse.data(), p.o_dims()), fa::block_sparse{empty}));
    };
    run_empty();
    std::vector<double> t_empty;
    for (int r = 0; r < o.reps; ++r) t_empty.push_back(seconds(run_empty, cpu_clock));
    const double empty_us = 1e6 * median(t_empty);
    const std::size_t first_row = rows.size();
    for (const double sparsity : o.sparsities) {
      const fa::block_layout layout = fa::random_layout(g, sparsity, o.seed, o.frame);
      const fa::block_sparse mask{layout};
      const auto run_dense = [&] {
        must(fa::attend(flash, p, qv, kv, vv, fa::bhsd(o_dense.data(), p.o_dims())));
      };
      const auto run_sparse = [&] {
        must(fa::attend(flash, p, qv, kv, vv, fa::bhsd(o_sparse.data(), p.o_dims()), mask));
      };
      run_dense();
      run_sparse();
      std::vector<double> t_dense, t_sparse;
      for (int r = 0; r < o.reps; ++r) {  // the order alternates so neither kernel always runs on a warm cache
        if (r % 2 == 0) t_dense.push_back(seconds(run_dense, cpu_clock));
        t_sparse.push_back(seconds(run_sparse, cpu_clock));
        if (r % 2 == 1) t_dense.push_back(seconds(run_dense, cpu_clock));
      }
      const double dense_us = 1e6 * median(t_dense), sparse_us = 1e6 * median(t_sparse);
      bool equal = true;
      if (o.check) {
        must(fa::attend(fa::policy::cpu_naive{o.threads}, p, qv, kv, vv, fa::bhsd(o_check.data(), p.o_dims()), mask));
        double err = 0;
        for (std::size_t i = 0; i < o_check.size(); ++i) err = std::max(err, double(std::abs(o_check[i] - o_sparse[i])));
        equal = err <= 1e-5;
      }
      if (layout.density() == 1.0) equal = equal && o_dense == o_sparse;
      failures += equal ? 0 : 1;
      const double density = layout.density();
      std::printf("%4lldx%-5lld %3lld %2lld %6lld %4lld %-9s %8.2f %8.3f %6s %12.0f %12.0f %8.2f %8.2f %9.0f\n",
                  static_cast<long long>(bs.first), static_cast<long long>(bs.second), static_cast<long long>(p.heads),
                  static_cast<long long>(p.batch), static_cast<long long>(p.seq_q), static_cast<long long>(p.head_dim),
                  frame_text.c_str(), sparsity, density, o.check ? (equal ? "yes" : "NO") : "-", dense_us, sparse_us,
                  dense_us / sparse_us, density > 0 ? 1.0 / density : 0.0, empty_us);
      std::fflush(stdout);
      char name[160];
      std::snprintf(name, sizeof name, "block_sparse/%lldx%lld/b%lld_h%lld_s%lld_d%lld/sparsity:%.2f%s/threads:%d",
                    static_cast<long long>(bs.first), static_cast<long long>(bs.second),
                    static_cast<long long>(p.batch), static_cast<long long>(p.heads), static_cast<long long>(p.seq_q),
                    static_cast<long long>(p.head_dim), sparsity, framed ? "/frame" : "", o.threads);
      // A layout with no block left (block_kv too large for this sparsity) times only the fixed cost: its
      // "speedup" means nothing, so it stays out of the JSON rows that plot.py draws.
      if (density == 0.0) continue;
      rows.push_back({name, sparse_us,
                      {{"b", double(p.batch)}, {"h", double(p.heads)}, {"h_kv", double(p.heads_kv)},
                       {"s_q", double(p.seq_q)}, {"s_kv", double(p.seq_kv)}, {"s", double(p.seq_q)},
                       {"d", double(p.head_dim)}, {"threads", double(o.threads)}, {"sparsity", sparsity},
                       {"density", density}, {"block_q", double(bs.first)}, {"block_kv", double(bs.second)},
                       {"frame", framed ? 1.0 : 0.0}, {"equal", equal ? 1.0 : 0.0}, {"dense_us", dense_us},
                       {"us", sparse_us}, {"speedup", dense_us / sparse_us}, {"empty_us", empty_us},
                       {"flop", 4.0 * double(p.batch * p.heads) * double(p.seq_q) * double(p.seq_kv) *
                                    double(p.head_dim) * density}}});
    }
    // The cost model of the target: sparse_us = fixed + slope · density · flash_us, by least squares over this
    // block shape's rows (fixed: what does not shrink with the density, e.g. packing K/V once per head).
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    const double n = static_cast<double>(rows.size() - first_row);
    const auto counter = [](const json_row& r, const char* key) {
      for (const auto& c : r.counters)
        if (c.first == key) return c.second;
      return 0.0;
    };
    bool distinct = false;  // the fit needs at least two different densities
    for (std::size_t i = first_row; i < rows.size(); ++i) {
      const double x = counter(rows[i], "density") * counter(rows[i], "dense_us"), y = rows[i].us;
      sx += x, sy += y, sxx += x * x, sxy += x * y;
      distinct = distinct || counter(rows[i], "density") != counter(rows[first_row], "density");
    }
    if (distinct && n * sxx - sx * sx > 0) {
      const double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx), fixed = (sy - slope * sx) / n;
      int within = 0;
      for (std::size_t i = first_row; i < rows.size(); ++i) {
        const double x = counter(rows[i], "density") * counter(rows[i], "dense_us");
        within += rows[i].us <= 1.1 * x + std::max(fixed, 0.0) ? 1 : 0;
        rows[i].counters.push_back({"fit_fixed_us", fixed});
        rows[i].counters.push_back({"fit_slope", slope});
      }
      std::printf("  fit %lldx%lld: sparse_us = %.0f + %.3f * density * flash_us; rows <= 1.1 * density * flash + %.0f: "
                  "%d of %d\n",
                  static_cast<long long>(bs.first), static_cast<long long>(bs.second), fixed, slope,
                  std::max(fixed, 0.0), within, static_cast<int>(n));
    }
  }
  if (!o.json.empty()) write_json(o.json, o, rows);
  if (failures) std::fprintf(stderr, "fusedattn-sparsity: %d row(s) with outputs not equal\n", failures);
  return failures ? 1 : 0;
}
