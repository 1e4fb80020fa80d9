// Row names, labels, counters and the default row sets of fusedattn-bench.
#include "rows.hpp"

#include <algorithm>
#include <cmath>

namespace fusedattn::bench {

std::string shape_name(const shape& sh) {
  std::string n = "b" + std::to_string(sh.b) + "_h" + std::to_string(sh.h);
  if (sh.h_kv != sh.h) n += "_hkv" + std::to_string(sh.h_kv);
  if (sh.s_q == sh.s_kv)
    n += "_s" + std::to_string(sh.s_q);
  else
    n += "_sq" + std::to_string(sh.s_q) + "_skv" + std::to_string(sh.s_kv);
  return n + "_d" + std::to_string(sh.d);
}

const char* scalar_label(scalar s) { return s == scalar::f32 ? "f32" : s == scalar::f16 ? "f16" : "bf16"; }
const char* mask_label(mask_kind m) { return m == mask_kind::dense ? "dense" : "causal"; }
const char* score_mod_label(score_mod m) {
  return m == score_mod::softcap ? "softcap" : m == score_mod::alibi ? "alibi" : m == score_mod::sinks ? "sinks" : "";
}

band_choice to_mask(mask_kind m) {
  if (m == mask_kind::causal) return causal{align::top_left};
  return dense{};
}

namespace {
/// "dense", or "dense+softcap" with a modifier.
std::string mask_and_mod(const row_spec& r) {
  std::string m = mask_label(r.mask);
  if (r.mod != score_mod::none) m += std::string("+") + score_mod_label(r.mod);
  return m;
}
}  // namespace

std::string row_name(const std::string& kernel, const row_spec& r) {
  return kernel + "/" + scalar_label(r.type) + "/" + mask_and_mod(r) + "/" + shape_name(r.sh) + "/threads:" +
         std::to_string(r.threads);
}

std::string row_label(const row_spec& r) { return std::string(scalar_label(r.type)) + " " + mask_and_mod(r); }

row_modifier::row_modifier(score_mod mod, index_t heads)
    : mod_(mod), slopes_(static_cast<std::size_t>(heads)), logits_(static_cast<std::size_t>(heads), 1.0f) {
  for (index_t h = 0; h < heads; ++h)
    slopes_[static_cast<std::size_t>(h)] = std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(heads));
}

std::vector<shape> leaderboard_shapes() {
  return {square(1, 1, 128, 64),  square(1, 1, 512, 64),  square(1, 1, 1024, 64),   square(1, 1, 2048, 64),
          square(1, 1, 4096, 64), square(1, 8, 512, 64),  square(1, 12, 512, 64),   square(1, 32, 512, 64),
          square(1, 32, 1024, 128), square(1, 32, 2048, 128)};
}

std::vector<shape> assignment_shapes() { return {square(1, 8, 128, 64), square(1, 8, 512, 64), square(1, 8, 1024, 64)}; }

namespace {
/// 1 and all threads (once when the machine has one core).
std::vector<int> one_and_all(int max_threads) {
  return max_threads > 1 ? std::vector<int>{1, max_threads} : std::vector<int>{1};
}

bool same_row(const row_spec& a, const row_spec& b) {
  return a.sh.b == b.sh.b && a.sh.h == b.sh.h && a.sh.h_kv == b.sh.h_kv && a.sh.s_q == b.sh.s_q &&
         a.sh.s_kv == b.sh.s_kv && a.sh.d == b.sh.d && a.type == b.type && a.mask == b.mask && a.threads == b.threads &&
         a.mod == b.mod;
}
}  // namespace

std::vector<row_spec> kernel_rows(const plan& pl) {
  std::vector<row_spec> rows;
  const std::vector<int> both = one_and_all(pl.max_threads);
  for (const shape& sh : leaderboard_shapes()) {
    if (pl.full) {
      for (scalar t : {scalar::f32, scalar::f16})
        for (mask_kind m : {mask_kind::dense, mask_kind::causal})
          for (int th : both) rows.push_back({sh, t, m, th});
    } else {
      for (int th : both) rows.push_back({sh, scalar::f32, mask_kind::dense, th});
      rows.push_back({sh, scalar::f16, mask_kind::dense, pl.max_threads});
    }
  }
  for (const shape& sh : assignment_shapes()) {
    const std::vector<scalar> types =
        pl.full ? std::vector<scalar>{scalar::f32, scalar::f16} : std::vector<scalar>{scalar::f32};
    const std::vector<int> threads = pl.full ? both : std::vector<int>{1};
    for (scalar t : types)
      for (mask_kind m : {mask_kind::dense, mask_kind::causal})
        for (int th : threads) rows.push_back({sh, t, m, th});
  }
  // (1, 8, 512, 64) is both a leaderboard and an assignment shape: keep its first row.
  std::vector<row_spec> unique;
  for (const row_spec& r : rows)
    if (std::none_of(unique.begin(), unique.end(), [&](const row_spec& u) { return same_row(u, r); }))
      unique.push_back(r);
  return unique;
}

void set_counters(benchmark::State& state, const problem& p, int threads, double density, double flop, double bytes,
                  double bytes_min) {
  auto& c = state.counters;
  c["b"] = static_cast<double>(p.batch);
  c["h"] = static_cast<double>(p.heads);
  c["h_kv"] = static_cast<double>(p.heads_kv);
  c["s_q"] = static_cast<double>(p.seq_q);
  c["s_kv"] = static_cast<double>(p.seq_kv);
  c["d"] = static_cast<double>(p.head_dim);
  c["threads"] = static_cast<double>(threads);
  c["density"] = density;
  c["flop"] = flop;
  c["bytes"] = bytes;
  c["bytes_min"] = bytes_min;
  c["FLOP/s"] = benchmark::Counter(flop, benchmark::Counter::kIsIterationInvariantRate);
  c["B/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
}

void fill_uniform(float* x, std::size_t n, std::uint64_t seed) {
  // splitmix64: fast, and good enough for bench inputs; the top 24 bits give a float in [0, 1).
  std::uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  constexpr float inv_2_24 = 1.0f / 16777216.0f;
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    x[i] = 2.0f * static_cast<float>(z >> 40) * inv_2_24 - 1.0f;
  }
}

}  // namespace fusedattn::bench
