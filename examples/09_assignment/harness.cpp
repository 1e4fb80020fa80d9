// Example 09: the assignment harness. It checks my_attention() (my_attention.cpp) and times it beside fusedattn's
// naive and flash kernels.
//
// Build a copy of this folder outside the fusedattn tree (README.md of this folder has the details):
//   fusedattn installed:   cmake -S . -B build -DCMAKE_PREFIX_PATH=<prefix>
//                          (install it once: cmake -S <fusedattn> -B <fusedattn>/build-install
//                           -DFUSEDATTN_BUILD_TESTS=OFF -DFUSEDATTN_BUILD_BENCH=OFF -DFUSEDATTN_BUILD_EXAMPLES=OFF
//                           -DFUSEDATTN_WITH_CUDA=OFF && cmake --install <fusedattn>/build-install --prefix <prefix>)
//   fusedattn sources:     cmake -S . -B build -DFUSEDATTN_SOURCE_DIR=<fusedattn>   (add_subdirectory)
//   then:                  cmake --build build -j && ./build/assignment
//   the report skeleton:   cmake --build build --target report     (build/report/report.md, roofline.png)
//
// What it does:
//   check: every configuration below against a float64 reference computed here, max |error| < 1e-3, with the
//          kernel run on 1 thread and on all of them: stress cases (logits x30 so that exp overflows without the
//          row max, sizes that are no tile's multiple, S_q != S_kv both ways, causal) and every size it times;
//          an element left unwritten, NaN or inf fails. fusedattn's flash kernel is checked on the same inputs.
//   time:  (batch, heads, S, dim) = (1, 8, S, 64), S = 128, 512, 1024, f32, dense: yours, fusedattn naive and
//          flash, on 1 thread and on all; ms, GFLOP/s (4·b·h·S²·d FLOPs), the slowdown against flash on as many
//          threads, and the threads a call really used (CPU time / wall time). Nothing is timed until every check
//          passes.
//   roofs: the machine's f32 FMA peak and triad bandwidth on 1 and on all threads (for the roofline).
//   JSON:  --json FILE writes the rows in fusedattn-bench's schema (bench/plot.py and bench/compare.py of the
//          fusedattn tree read it beside the library's bench), with the checks, the cost model and the memory table.
// Exit code: 0 when every check passes, 1 otherwise (2: bad arguments).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fusedattn/fusedattn.hpp>
#include <xsimd/xsimd.hpp>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include "my_attention.hpp"

namespace fa = fusedattn;

namespace {

/// The assignment's tolerance: largest |error| accepted against the float64 reference.
constexpr double tolerance = 1e-3;
/// What the stress case multiplies Q by, and the offset added to every K element: the logits reach the hundreds
/// (a softmax that does not subtract the row max overflows or underflows), while the gaps between the logits of
/// one row stay moderate, so float32 is accurate enough.
constexpr float large_logit_q_factor = 30.0f;
constexpr float large_logit_k_offset = 4.0f;
/// The assignment's timed sequence lengths, with 8 heads of 64.
constexpr int timed_seqs[] = {128, 512, 1024};
constexpr int timed_heads = 8, timed_dim = 64;

enum class input_kind { uniform, large_logits };

struct check_case {
  std::string what;
  attention_problem p;
  input_kind kind;
};

struct options {
  std::string json_path;
  bool quick = false;       // fewer timing runs (CI)
  bool check_only = false;  // no timing, no roofs
  int threads = 0;          // "all threads"; 0 = the machine's
  int triad_mib = 64;       // each triad array
};

struct tensors {
  std::vector<float> q, k, v;
};

std::size_t q_size(const attention_problem& p) { return std::size_t(p.batch) * p.heads * p.seq_q * p.dim; }
std::size_t kv_size(const attention_problem& p) { return std::size_t(p.batch) * p.heads * p.seq_kv * p.dim; }

tensors make_inputs(const attention_problem& p, input_kind kind, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  tensors t{std::vector<float>(q_size(p)), std::vector<float>(kv_size(p)), std::vector<float>(kv_size(p))};
  const float qf = kind == input_kind::large_logits ? large_logit_q_factor : 1.0f;
  const float ko = kind == input_kind::large_logits ? large_logit_k_offset : 0.0f;
  for (float& x : t.q) x = qf * u(rng);
  for (float& x : t.k) x = ko + u(rng);
  for (float& x : t.v) x = u(rng);
  return t;
}

/// Top-left causal rule, as attention_problem documents it: query i sees keys 0..i.
bool allowed(const attention_problem& p, long i, long j) { return !p.causal || j <= i; }

/// The float64 reference: softmax(Q·Kᵀ/sqrt(dim) + mask)·V, every row. Also returns the largest |logit|.
std::vector<double> reference(const attention_problem& p, const tensors& t, double& max_abs_logit) {
  std::vector<double> o(q_size(p));
  const double scale = 1.0 / std::sqrt(double(p.dim));
  const long heads_total = long(p.batch) * p.heads;
  double biggest = 0;
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic) reduction(max : biggest)
#endif
  for (long bh = 0; bh < heads_total; ++bh) {
    std::vector<double> s(std::size_t(p.seq_kv)), acc(std::size_t(p.dim));
    for (long i = 0; i < p.seq_q; ++i) {
      const float* qi = &t.q[(std::size_t(bh) * p.seq_q + i) * p.dim];
      double m = -INFINITY;
      for (long j = 0; j < p.seq_kv; ++j) {
        if (!allowed(p, i, j)) continue;
        const float* kj = &t.k[(std::size_t(bh) * p.seq_kv + j) * p.dim];
        double dot = 0;
        for (int c = 0; c < p.dim; ++c) dot += double(qi[c]) * kj[c];
        s[j] = dot * scale;
        m = std::max(m, s[j]);
        biggest = std::max(biggest, std::abs(s[j]));
      }
      double l = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (long j = 0; j < p.seq_kv; ++j) {
        if (!allowed(p, i, j)) continue;
        const double e = std::exp(s[j] - m);
        l += e;
        const float* vj = &t.v[(std::size_t(bh) * p.seq_kv + j) * p.dim];
        for (int c = 0; c < p.dim; ++c) acc[c] += e * vj[c];
      }
      for (int c = 0; c < p.dim; ++c) o[(std::size_t(bh) * p.seq_q + i) * p.dim + c] = acc[c] / l;
    }
  }
  max_abs_logit = biggest;
  return o;
}

/// Largest |out - ref|; infinity when an element is NaN or inf (the harness fills `out` with NaN before a call,
/// so an element the kernel never wrote counts too).
double max_error(const std::vector<float>& out, const std::vector<double>& ref) {
  double err = 0;
  for (std::size_t i = 0; i < out.size(); ++i)
    err = std::max(err, std::isfinite(out[i]) ? std::abs(double(out[i]) - ref[i]) : INFINITY);
  return err;
}

fa::problem to_problem(const attention_problem& p) { return {p.batch, p.heads, p.heads, p.seq_q, p.seq_kv, p.dim}; }

/// fusedattn on contiguous [b][h][s][d] buffers, with the same top-left causal rule.
template <class Policy>
fa::status library_attention(const Policy& pol, const attention_problem& a, const tensors& t, std::vector<float>& o) {
  const fa::problem p = to_problem(a);
  const auto q = fa::bhsd(t.q.data(), p.q_dims()), k = fa::bhsd(t.k.data(), p.kv_dims()),
             v = fa::bhsd(t.v.data(), p.kv_dims());
  const auto out = fa::bhsd(o.data(), p.o_dims());
  if (a.causal) return fa::attend(pol, p, q, k, v, out, fa::causal{fa::align::top_left});
  return fa::attend(pol, p, q, k, v, out);
}

fa::policy::cpu<> flash_policy(int threads) {
  fa::policy::cpu<> pol;
  pol.threads = threads;
  return pol;
}

double process_cpu_seconds() { return double(std::clock()) / CLOCKS_PER_SEC; }

struct timing {
  double wall = 0;     // median seconds per call
  double cpu = 0;      // process CPU seconds per call (all threads), median
  int runs = 0;
  double threads_used() const { return wall > 0 ? cpu / wall : 0; }
};

/// Median wall and process-CPU time of `f` after one untimed warm-up call: at least `min_runs` runs and at least
/// `min_seconds` in all.
timing time_calls(const std::function<void()>& f, int min_runs, double min_seconds) {
  f();
  std::vector<double> wall, cpu;
  double total = 0;
  while (int(wall.size()) < min_runs || total < min_seconds) {
    const double c0 = process_cpu_seconds();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const double w = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    cpu.push_back(process_cpu_seconds() - c0);
    wall.push_back(w);
    total += w;
  }
  std::sort(wall.begin(), wall.end());
  std::sort(cpu.begin(), cpu.end());
  return {wall[wall.size() / 2], cpu[cpu.size() / 2], int(wall.size())};
}

// ---- the machine's roofs ----------------------------------------------------------------------------------

struct roof {
  int threads;
  double peak_flops;  // f32 FMA peak, FLOP/s
  double bandwidth;   // triad, B/s
};

/// f32 FMA peak on `threads` threads: each runs 16 independent vector FMA chains that never touch memory.
double fma_peak(int threads) {
  using batch = xsimd::batch<float>;
  constexpr int chains = 16;
  constexpr long iters = 4'000'000;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    float sink = 0;
    int ran = 1;
    const auto t0 = std::chrono::steady_clock::now();
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) reduction(+ : sink)
#endif
    {
#if defined(_OPENMP)
#pragma omp single
      ran = omp_get_num_threads();
#endif
      batch acc[chains];
      for (int c = 0; c < chains; ++c) acc[c] = batch(1.0f + 0.001f * float(c));
      const batch a(0.999999f), b(1e-7f);
      for (long i = 0; i < iters; ++i)
        for (int c = 0; c < chains; ++c) acc[c] = xsimd::fma(acc[c], a, b);
      for (int c = 0; c < chains; ++c) sink += xsimd::hadd(acc[c]);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * batch::size * chains * double(iters) * ran / s);
    if (sink == 42.0f) std::printf(" ");  // keeps the loop alive
  }
  return best;
}

/// Triad a = b + s·c on `threads` threads over three arrays of `mib` MiB: 12 bytes per element.
double triad_bandwidth(int threads, int mib) {
  const long n = long(mib) * 1024 * 1024 / long(sizeof(float));
  std::vector<float> a(std::size_t(n), 0.f), b(std::size_t(n), 1.f), c(std::size_t(n), 2.f);
  float* pa = a.data();
  const float* pb = b.data();
  const float* pc = c.data();
  double best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
    for (long i = 0; i < n; ++i) pa[i] = pb[i] + 0.5f * pc[i];
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 12.0 * double(n) / s);
  }
  if (a[std::size_t(n / 2)] != 2.0f) std::printf("triad: wrong result\n");
  return best;
}

// ---- JSON in fusedattn-bench's schema -------------------------------------------------------------------------

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    if (static_cast<unsigned char>(ch) >= 0x20) out += ch;
  }
  return out + "\"";
}

std::string num(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

/// One timed row: the bench's name, label and counters (bytes: the kernel's modelled traffic; for your kernel,
/// whose schedule the harness cannot know, the compulsory bytes).
struct row {
  std::string kernel;
  attention_problem p;
  int threads;
  timing t;
  double flop, bytes, bytes_min;
  std::string name() const {
    return kernel + "/f32/" + (p.causal ? "causal" : "dense") + "/b" + std::to_string(p.batch) + "_h" +
           std::to_string(p.heads) + "_s" + std::to_string(p.seq_q) + "_d" + std::to_string(p.dim) +
           "/threads:" + std::to_string(threads);
  }
};

struct check_result {
  std::string what;
  attention_problem p;
  double max_abs_logit, err_1, err_all, err_flash;
  bool ok;
};

struct model_row {
  int seq;
  double flop, bytes_min, bytes_naive, bytes_flash;
  int flash_q_tile;
};

struct memory_entry {
  int seq;
  double naive_per_head, naive_total, flash_tiles, flash_scratch;
  int tile_q, tile_kv;
};

std::string today_utc() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return buf;
}

bool write_json(const std::string& path, const options& opt, int all_threads, const std::vector<check_result>& checks,
                const std::vector<row>& rows, const std::vector<roof>& roofs, const std::vector<model_row>& model,
                const std::vector<memory_entry>& memory) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return false;
  char host[256] = "?";
#if defined(__unix__) || defined(__APPLE__)
  if (gethostname(host, sizeof host - 1) != 0) std::snprintf(host, sizeof host, "?");
#endif
  std::fprintf(f, "{\n  \"context\": {\n    \"date\": %s,\n    \"host_name\": %s,\n", json_string(today_utc()).c_str(),
               json_string(host).c_str());
  std::fprintf(f, "    \"executable\": \"assignment\",\n    \"num_cpus\": %d,\n", all_threads);
  std::fprintf(f, "    \"library_build_type\": \"release\",\n    \"fusedattn_assignment_quick\": %s",
               opt.quick ? "\"1\"" : "\"0\"");
  for (const roof& r : roofs)
    std::fprintf(f,
                 ",\n    \"fusedattn_peak_flops_threads_%d\": \"%s\",\n"
                 "    \"fusedattn_bandwidth_threads_%d\": \"%s\"",
                 r.threads, num(r.peak_flops).c_str(), r.threads, num(r.bandwidth).c_str());
  std::fprintf(f, "\n  },\n  \"benchmarks\": [");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const row& r = rows[i];
    const std::string name = r.name();
    std::fprintf(f, "%s\n    {\"name\": %s, \"run_name\": %s, \"run_type\": \"iteration\", \"family_index\": %zu, "
                 "\"per_family_instance_index\": 0, \"repetitions\": 1, \"repetition_index\": 0, "
                 "\"iterations\": %d, \"real_time\": %s, \"cpu_time\": %s, \"time_unit\": \"us\", "
                 "\"b\": %d, \"h\": %d, \"h_kv\": %d, \"s_q\": %d, \"s_kv\": %d, \"d\": %d, \"threads\": %d, "
                 "\"density\": 1, \"flop\": %s, \"bytes\": %s, \"bytes_min\": %s, \"FLOP/s\": %s, \"B/s\": %s, "
                 "\"threads_used\": %s, \"label\": \"f32 %s\"}",
                 i ? "," : "", json_string(name).c_str(), json_string(name).c_str(), i, r.t.runs,
                 num(r.t.wall * 1e6).c_str(), num(r.t.cpu * 1e6).c_str(), r.p.batch, r.p.heads, r.p.heads, r.p.seq_q,
                 r.p.seq_kv, r.p.dim, r.threads, num(r.flop).c_str(), num(r.bytes).c_str(), num(r.bytes_min).c_str(),
                 num(r.flop / r.t.wall).c_str(), num(r.bytes / r.t.wall).c_str(), num(r.t.threads_used()).c_str(),
                 r.p.causal ? "causal" : "dense");
  }
  std::fprintf(f, "\n  ],\n  \"assignment\": {\n    \"tolerance\": %s,\n    \"all_threads\": %d,\n    \"checks\": [",
               num(tolerance).c_str(), all_threads);
  for (std::size_t i = 0; i < checks.size(); ++i) {
    const check_result& c = checks[i];
    std::fprintf(f, "%s\n      {\"what\": %s, \"b\": %d, \"h\": %d, \"s_q\": %d, \"s_kv\": %d, \"d\": %d, "
                 "\"causal\": %s, \"max_abs_logit\": %s, \"err_1_thread\": %s, \"err_all_threads\": %s, "
                 "\"err_fusedattn_flash\": %s, \"pass\": %s}",
                 i ? "," : "", json_string(c.what).c_str(), c.p.batch, c.p.heads, c.p.seq_q, c.p.seq_kv, c.p.dim,
                 c.p.causal ? "true" : "false", num(c.max_abs_logit).c_str(), num(c.err_1).c_str(),
                 num(c.err_all).c_str(), num(c.err_flash).c_str(), c.ok ? "true" : "false");
  }
  std::fprintf(f, "\n    ],\n    \"model\": [");
  for (std::size_t i = 0; i < model.size(); ++i) {
    const model_row& m = model[i];
    std::fprintf(f, "%s\n      {\"b\": 1, \"h\": %d, \"s\": %d, \"d\": %d, \"flop\": %s, \"bytes_min\": %s, "
                 "\"bytes_naive\": %s, \"bytes_flash\": %s, \"flash_q_tile\": %d}",
                 i ? "," : "", timed_heads, m.seq, timed_dim, num(m.flop).c_str(), num(m.bytes_min).c_str(),
                 num(m.bytes_naive).c_str(), num(m.bytes_flash).c_str(), m.flash_q_tile);
  }
  std::fprintf(f, "\n    ],\n    \"memory\": [");
  for (std::size_t i = 0; i < memory.size(); ++i) {
    const memory_entry& m = memory[i];
    std::fprintf(f, "%s\n      {\"h\": %d, \"s\": %d, \"d\": %d, \"naive_per_head\": %s, \"naive_total\": %s, "
                 "\"flash_tiles\": %s, \"flash_scratch\": %s, \"tile_q\": %d, \"tile_kv\": %d}",
                 i ? "," : "", timed_heads, m.seq, timed_dim, num(m.naive_per_head).c_str(),
                 num(m.naive_total).c_str(), num(m.flash_tiles).c_str(), num(m.flash_scratch).c_str(), m.tile_q,
                 m.tile_kv);
  }
  std::fprintf(f, "\n    ]\n  }\n}\n");
  return std::fclose(f) == 0;
}

bool parse(int argc, char** argv, options& opt) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      if (a.rfind(flag, 0) != 0) return nullptr;
      if (a.size() > std::strlen(flag) && a[std::strlen(flag)] == '=') return argv[i] + std::strlen(flag) + 1;
      if (a.size() == std::strlen(flag) && i + 1 < argc) return argv[++i];
      return nullptr;
    };
    if (a == "--quick") {
      opt.quick = true;
    } else if (a == "--check-only") {
      opt.check_only = true;
    } else if (const char* v = value("--json")) {
      opt.json_path = v;
    } else if (const char* v2 = value("--threads")) {
      opt.threads = std::atoi(v2);
      if (opt.threads < 1) return false;
    } else if (const char* v3 = value("--triad-mib")) {
      opt.triad_mib = std::atoi(v3);
      if (opt.triad_mib < 1) return false;
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  options opt;
  if (!parse(argc, argv, opt)) {
    std::fprintf(stderr,
                 "usage: %s [--json FILE] [--quick] [--check-only] [--threads N] [--triad-mib N]\n"
                 "  --json FILE   also write the checks, timings and roofs as JSON (fusedattn-bench's schema)\n"
                 "  --quick       fewer timing runs      --check-only  checks only, no timing\n"
                 "  --threads N   what 'all threads' means (default: the machine's)\n",
                 argv[0]);
    return 2;
  }
  const int all_threads = opt.threads > 0 ? opt.threads : std::max(1, fa::default_threads());
  std::vector<int> thread_counts{1};
  if (all_threads > 1) thread_counts.push_back(all_threads);
  std::mt19937 rng(20260529);

  // ---- correctness -------------------------------------------------------------------------------------------
  std::vector<check_case> cases = {
      {"one query row", {1, 2, 1, 37, 16, false, 1}, input_kind::uniform},
      {"sizes no tile's multiple", {2, 3, 77, 77, 40, false, 1}, input_kind::uniform},
      {"S_q < S_kv", {1, 4, 100, 777, 64, false, 1}, input_kind::uniform},
      {"S_q > S_kv", {1, 2, 333, 100, 64, false, 1}, input_kind::uniform},
      {"causal", {1, 2, 257, 257, 64, true, 1}, input_kind::uniform},
      {"causal, S_q < S_kv", {1, 2, 200, 700, 48, true, 1}, input_kind::uniform},
      {"causal, S_q > S_kv", {1, 2, 300, 130, 64, true, 1}, input_kind::uniform},
      {"logits x30", {1, 4, 300, 300, 64, false, 1}, input_kind::large_logits},
      {"logits x30, causal", {1, 2, 129, 1000, 64, true, 1}, input_kind::large_logits},
  };
  for (int s : timed_seqs)
    cases.push_back({"timed size", {1, timed_heads, s, s, timed_dim, false, 1}, input_kind::uniform});

  std::printf("== correctness: my_attention against a float64 reference, max |error| < %g, on 1 and %d threads\n",
              tolerance, all_threads);
  std::printf("  %-26s %-20s %6s %9s %11s %11s %11s\n", "case", "(b,h,S_q,S_kv,d)", "causal", "|logit|<=",
              "err 1 thr", "err all", "fusedattn");
  std::vector<check_result> checks;
  bool all_ok = true, harness_ok = true;
  for (const check_case& c : cases) {
    const tensors t = make_inputs(c.p, c.kind, rng);
    check_result r{c.what, c.p, 0, 0, 0, 0, false};
    const std::vector<double> ref = reference(c.p, t, r.max_abs_logit);
    std::vector<float> out(q_size(c.p));
    for (int n : thread_counts) {
      std::fill(out.begin(), out.end(), std::numeric_limits<float>::quiet_NaN());
      attention_problem p = c.p;
      p.threads = n;
      my_attention(t.q.data(), t.k.data(), t.v.data(), out.data(), p);
      (n == 1 ? r.err_1 : r.err_all) = max_error(out, ref);
    }
    if (thread_counts.size() == 1) r.err_all = r.err_1;
    std::fill(out.begin(), out.end(), std::numeric_limits<float>::quiet_NaN());
    if (const fa::status st = library_attention(flash_policy(all_threads), c.p, t, out); !st) {
      std::fprintf(stderr, "fusedattn: %s\n", st.what());
      return 1;
    }
    r.err_flash = max_error(out, ref);
    r.ok = r.err_1 < tolerance && r.err_all < tolerance;
    all_ok &= r.ok;
    harness_ok &= r.err_flash < tolerance;
    char shape[64];
    std::snprintf(shape, sizeof shape, "(%d,%d,%d,%d,%d)", c.p.batch, c.p.heads, c.p.seq_q, c.p.seq_kv, c.p.dim);
    std::printf("  %-26s %-20s %6s %9.0f %11.3g %11.3g %11.3g  %s\n", c.what.c_str(), shape, c.p.causal ? "yes" : "no",
                r.max_abs_logit, r.err_1, r.err_all, r.err_flash, r.ok ? "PASS" : "FAIL");
    checks.push_back(r);
  }
  if (!harness_ok) {
    std::printf("HARNESS ERROR: fusedattn's own flash kernel misses the float64 reference; the checks above are "
                "not trustworthy\n");
    return 1;
  }

  // ---- the cost model and the memory table (no timing needed) -------------------------------------------------
  std::vector<model_row> model;
  std::vector<memory_entry> memory;
  for (int s : {128, 512, 1024, 2048}) {
    const fa::problem p{1, timed_heads, timed_heads, s, s, timed_dim};
    const auto tiles = fa::cpu::choose_tiles({}, p.head_dim, p.seq_q, p.seq_kv);
    const auto dense = fa::bind(fa::dense{}, p);
    if (s <= 1024)
      model.push_back({s, fa::cost::flops(p), fa::cost::compulsory_bytes(p, sizeof(float)),
                       fa::cost::naive_bytes(p, sizeof(float), sizeof(float)),
                       fa::cost::flash_bytes(p, dense, sizeof(float), tiles.q), int(tiles.q)});
    const fa::cost::memory_row m = fa::cost::memory(p, sizeof(float), {tiles.q, tiles.kv});
    memory.push_back({s, m.naive_per_head, m.naive_total, m.flash_total,
                      double(fa::kernels::flash_scratch_bytes<float>(p, dense, {}, 1)), int(tiles.q), int(tiles.kv)});
  }

  std::vector<row> rows;
  std::vector<roof> roofs;
  if (!all_ok) {
    std::printf("FAILED: my_attention() does not match the reference yet (see my_attention.cpp); nothing timed\n");
  } else if (!opt.check_only) {
    // ---- speed ------------------------------------------------------------------------------------------------
    const int min_runs = opt.quick ? 1 : 5;
    const double min_seconds = opt.quick ? 0.0 : 0.5;
    std::printf("\n== speed: (1, %d, S, %d) f32 dense; median wall time of >= %d runs after a warm-up; 'used' = CPU "
                "time / wall time, the threads a call really kept busy\n",
                timed_heads, timed_dim, min_runs);
    std::printf("  %5s  %-10s %7s %10s %10s %6s %9s\n", "S", "kernel", "threads", "ms", "GFLOP/s", "used",
                "vs flash");
    bool naive_oversubscribed = false;
    for (int s : timed_seqs) {
      const attention_problem base{1, timed_heads, s, s, timed_dim, false, 1};
      const fa::problem fp = to_problem(base);
      const tensors t = make_inputs(base, input_kind::uniform, rng);
      std::vector<float> o(q_size(base));
      const double flop = fa::cost::flops(fp), bytes_min = fa::cost::compulsory_bytes(fp, sizeof(float));
      const model_row& m = *std::find_if(model.begin(), model.end(), [&](const model_row& x) { return x.seq == s; });
      for (int n : thread_counts) {
        attention_problem p = base;
        p.threads = n;
        const timing flash = time_calls([&] { (void)library_attention(flash_policy(n), base, t, o); }, min_runs,
                                        min_seconds);
        const timing naive = time_calls([&] { (void)library_attention(fa::policy::cpu_naive{n}, base, t, o); },
                                        min_runs, min_seconds);
        const timing mine =
            time_calls([&] { my_attention(t.q.data(), t.k.data(), t.v.data(), o.data(), p); }, min_runs, min_seconds);
        rows.push_back({"student", base, n, mine, flop, bytes_min, bytes_min});
        rows.push_back({"naive", base, n, naive, flop, m.bytes_naive, bytes_min});
        rows.push_back({"flash", base, n, flash, flop, m.bytes_flash, bytes_min});
        for (const auto& [name, tm] : {std::pair<const char*, timing>{"yours", mine}, {"naive", naive},
                                       {"flash", flash}})
          std::printf("  %5d  %-10s %7d %10.3f %10.2f %6.2f %8.2fx\n", s, name, n, tm.wall * 1e3,
                      flop / tm.wall * 1e-9, tm.threads_used(), tm.wall / flash.wall);
        // A 1-thread call that keeps more than one CPU busy is not a 1-thread figure.
        if (n == 1 && naive.threads_used() > 1.5) naive_oversubscribed = true;
      }
    }
    if (naive_oversubscribed)
      std::printf("WARNING: fusedattn's naive kernel asked for 1 thread kept more than one CPU busy (Eigen's own GEMM "
                  "threads inside it): its 1-thread row is not a 1-thread figure\n");

    // ---- the machine's roofs ----------------------------------------------------------------------------------
    std::printf("\n== roofs of this machine (f32 FMA loop; triad over 3 x %d MiB)\n", opt.triad_mib);
    for (int n : thread_counts) {
      roofs.push_back({n, fma_peak(n), triad_bandwidth(n, opt.triad_mib)});
      std::printf("  %d thread%s: peak %.1f GFLOP/s, bandwidth %.1f GB/s, ridge point %.1f FLOP/B\n", n,
                  n == 1 ? "" : "s", roofs.back().peak_flops * 1e-9, roofs.back().bandwidth * 1e-9,
                  roofs.back().peak_flops / roofs.back().bandwidth);
    }
  }

  if (!opt.json_path.empty()) {
    if (!write_json(opt.json_path, opt, all_threads, checks, rows, roofs, model, memory)) {
      std::fprintf(stderr, "cannot write %s\n", opt.json_path.c_str());
      return 1;
    }
    std::printf("wrote %s\n", opt.json_path.c_str());
  }
  std::printf(all_ok ? "PASSED\n" : "FAILED\n");
  return all_ok ? 0 : 1;
}
