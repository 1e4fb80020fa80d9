// policy::ascend from a program built against the installed package: each mask against policy::cpu_naive on the
// same random inputs (the stand-in toolkit's libascendcl computes the attention on host memory). Exits 1 on a
// mismatch.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <variant>
#include <vector>

#include <fusedattn/fusedattn.hpp>

namespace fa = fusedattn;

int main() {
  const fa::problem p{2, 4, 2, 37, 53, 32};
  std::mt19937 rng(2026);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> q(static_cast<std::size_t>(2 * 4 * 37 * 32)), k(static_cast<std::size_t>(2 * 2 * 53 * 32)),
      v(k.size());
  for (auto* b : {&q, &k, &v})
    for (float& x : *b) x = u(rng);
  const auto qv = fa::bhsd<const float>(q.data(), p.q_dims());
  const auto kv = fa::bhsd<const float>(k.data(), p.kv_dims());
  const auto vv = fa::bhsd<const float>(v.data(), p.kv_dims());
  const std::vector<fa::any_mask> masks = {fa::dense{}, fa::causal{fa::align::top_left},
                                           fa::causal{fa::align::bottom_right}, fa::window{6, 2, fa::align::top_left}};
  int failures = 0;
  for (const fa::any_mask& mask : masks) {
    std::vector<float> o(q.size()), o_ref(q.size()), lse(static_cast<std::size_t>(p.lse_size())), lse_ref(lse.size());
    const fa::status st = fa::attend(fa::policy::ascend{}, p, qv, kv, vv, fa::bhsd(o.data(), p.o_dims()), mask,
                                     lse.data());
    const fa::status ref = fa::attend(fa::policy::cpu_naive{1}, p, qv, kv, vv, fa::bhsd(o_ref.data(), p.o_dims()),
                                      mask, lse_ref.data());
    double err = 0;
    for (std::size_t i = 0; i < o.size(); ++i) err = std::max(err, double(std::abs(o[i] - o_ref[i])));
    for (std::size_t i = 0; i < lse.size(); ++i) err = std::max(err, double(std::abs(lse[i] - lse_ref[i])));
    const bool ok = st.ok() && ref.ok() && err <= 1e-4;
    std::printf("%-10s %s, max |difference| to cpu_naive %.2e: %s\n",
                std::visit([](const auto& m) { return fa::mask_name(m); }, mask), st.what(), err, ok ? "ok" : "FAIL");
    failures += ok ? 0 : 1;
  }
  return failures == 0 ? 0 : 1;
}
