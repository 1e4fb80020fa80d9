// Example 04: a KV-cache decode loop. Generation produces one token at a time: its query row attends to every
// key/value written so far. The cache is allocated once for `capacity` tokens, laid out [heads_kv][capacity][d];
// each step views its first t+1 rows with explicit strides (no copy) and calls attend() with seq_q = 1.
// With one query row the CPU kernel splits the keys across threads and merges the partial softmaxes.
// The last step is checked against a float64 loop; exits non-zero on a mismatch.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <fusedattn/fusedattn.hpp>

namespace fa = fusedattn;

int main() {
  const fa::index_t heads = 8, heads_kv = 2, d = 128, capacity = 2048, steps = 1024;
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> u(-1.f, 1.f);

  // The cache: [heads_kv][capacity][d], filled as tokens arrive.
  std::vector<float> k_cache(static_cast<std::size_t>(heads_kv * capacity * d));
  std::vector<float> v_cache(k_cache.size());
  std::vector<float> q(static_cast<std::size_t>(heads * d)), o(q.size());
  const fa::strides4 cache_strides{heads_kv * capacity * d, capacity * d, d, 1};

  double seconds = 0, flop = 0;
  for (fa::index_t t = 0; t < steps; ++t) {
    // A new token: its key and value rows go into the cache, its query is attended now.
    for (fa::index_t g = 0; g < heads_kv; ++g)
      for (fa::index_t c = 0; c < d; ++c) {
        k_cache[static_cast<std::size_t>((g * capacity + t) * d + c)] = u(rng);
        v_cache[static_cast<std::size_t>((g * capacity + t) * d + c)] = u(rng);
      }
    for (float& x : q) x = u(rng);

    const fa::problem p{1, heads, heads_kv, /*seq_q*/ 1, /*seq_kv*/ t + 1, d};
    if (t + 1 == steps)  // the last step: which kernel, and its scratch (the decode split's partial rows included)
      std::printf("plan of the last step: %s\n",
                  fa::to_string(fa::plan(fa::policy::cpu<>{}, p, fa::bhsd(q.data(), p.q_dims()),
                                         fa::strided<const float>(k_cache.data(), p.kv_dims(), cache_strides),
                                         fa::strided<const float>(v_cache.data(), p.kv_dims(), cache_strides),
                                         fa::bhsd(o.data(), p.o_dims())))
                      .c_str());
    const auto t0 = std::chrono::steady_clock::now();
    const fa::status st =
        fa::attend(fa::policy::cpu<>{}, p, fa::bhsd(q.data(), p.q_dims()),
                   fa::strided<const float>(k_cache.data(), p.kv_dims(), cache_strides),
                   fa::strided<const float>(v_cache.data(), p.kv_dims(), cache_strides), fa::bhsd(o.data(), p.o_dims()));
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    flop += 4.0 * double(heads) * double(t + 1) * double(d);
    if (!st) {
      std::fprintf(stderr, "fusedattn: %s\n", st.what());
      return 1;
    }
  }

  // Check the last step in float64: the query row of each head against all `steps` cached tokens.
  double err = 0;
  for (fa::index_t h = 0; h < heads; ++h) {
    const fa::index_t g = h / (heads / heads_kv);
    std::vector<double> w(static_cast<std::size_t>(steps));
    double m = -INFINITY, l = 0;
    for (fa::index_t j = 0; j < steps; ++j) {
      double dot = 0;
      for (fa::index_t c = 0; c < d; ++c) dot += double(q[static_cast<std::size_t>(h * d + c)]) * k_cache[static_cast<std::size_t>((g * capacity + j) * d + c)];
      w[static_cast<std::size_t>(j)] = dot / std::sqrt(double(d));
      m = std::max(m, w[static_cast<std::size_t>(j)]);
    }
    for (double& x : w) l += (x = std::exp(x - m));
    for (fa::index_t c = 0; c < d; ++c) {
      double ref = 0;
      for (fa::index_t j = 0; j < steps; ++j) ref += w[static_cast<std::size_t>(j)] / l * v_cache[static_cast<std::size_t>((g * capacity + j) * d + c)];
      err = std::max(err, std::abs(ref - o[static_cast<std::size_t>(h * d + c)]));
    }
  }
  std::printf("decoded %lld tokens (8 q heads, 2 kv heads, d 128): %.1f tokens/s of attention, %.2f GFLOP/s\n",
              (long long)steps, double(steps) / seconds, flop / seconds * 1e-9);
  std::printf("last step vs float64: max error %.2g\n", err);
  const bool ok = err < 1e-5;
  std::printf("%s\n", ok ? "OK" : "MISMATCH");
  return ok ? 0 : 1;
}
