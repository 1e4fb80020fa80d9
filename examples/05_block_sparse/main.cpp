// Example 05: block-sparse attention. The score matrix is cut into blocks of block_q × block_kv; a layout lists,
// per q-block row, the kv-blocks to compute (sorted, CSR). Here: a seeded random pattern that drops a fraction
// `sparsity` of the blocks of each row, plus a "frame" of always-active blocks — the first kv-block column
// (attention sinks) and the last one (recent tokens). The kernel visits only the listed blocks, so time falls with
// the active fraction. Each sparsity is checked against a float64 loop that knows only the per-element rule
// (key j is visible to query i iff block (i / block_q, j / block_kv) is listed). Exits non-zero on a mismatch.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <fusedattn/fusedattn.hpp>

namespace fa = fusedattn;

namespace {

template <class F>
double median_seconds(F&& f, int reps) {
  f();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// Max error of rows `rows` of head 0 against float64 attention restricted to the layout's blocks.
double sampled_error(const fa::problem& p, const fa::block_layout& layout, const std::vector<float>& q,
                     const std::vector<float>& k, const std::vector<float>& v, const std::vector<float>& o) {
  const fa::block_geometry& g = layout.geometry();
  const fa::index_t d = p.head_dim;
  double err = 0;
  for (fa::index_t i : {fa::index_t(0), p.seq_q / 3, p.seq_q - 1}) {
    // The kv-blocks listed for this row's q-block.
    const fa::index_t r = i / g.block_q;
    std::vector<bool> visible(static_cast<std::size_t>(p.seq_kv), false);
    for (fa::index_t t = layout.row_offsets()[r]; t < layout.row_offsets()[r + 1]; ++t)
      for (fa::index_t j = layout.cols()[t] * g.block_kv; j < std::min(p.seq_kv, (layout.cols()[t] + 1) * g.block_kv); ++j)
        visible[static_cast<std::size_t>(j)] = true;
    std::vector<double> w(static_cast<std::size_t>(p.seq_kv), 0.0);
    double m = -INFINITY, l = 0;
    for (fa::index_t j = 0; j < p.seq_kv; ++j) {
      if (!visible[static_cast<std::size_t>(j)]) continue;
      double dot = 0;
      for (fa::index_t c = 0; c < d; ++c) dot += double(q[static_cast<std::size_t>(i * d + c)]) * k[static_cast<std::size_t>(j * d + c)];
      w[static_cast<std::size_t>(j)] = dot * p.softmax_scale();
      m = std::max(m, w[static_cast<std::size_t>(j)]);
    }
    for (fa::index_t j = 0; j < p.seq_kv; ++j)
      if (visible[static_cast<std::size_t>(j)]) l += (w[static_cast<std::size_t>(j)] = std::exp(w[static_cast<std::size_t>(j)] - m));
    for (fa::index_t c = 0; c < d; ++c) {
      double ref = 0;
      for (fa::index_t j = 0; j < p.seq_kv; ++j)
        if (visible[static_cast<std::size_t>(j)]) ref += w[static_cast<std::size_t>(j)] / l * v[static_cast<std::size_t>(j * d + c)];
      err = std::max(err, std::abs(ref - o[static_cast<std::size_t>(i * d + c)]));
    }
  }
  return err;
}

}  // namespace

int main() {
  // One head of 2048 tokens, head_dim 64, 128 × 128 blocks: 16 × 16 blocks.
  const fa::problem p{1, 1, 1, 2048, 2048, 64};
  const fa::block_geometry g{p.seq_q, p.seq_kv, /*block_q*/ 128, /*block_kv*/ 128};
  const fa::block_frame frame{/*left_cols*/ 1, /*right_cols*/ 1};
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const std::size_t n = static_cast<std::size_t>(p.seq_q * p.head_dim);
  std::vector<float> q(n), k(n), v(n), o(n);
  for (auto* buf : {&q, &k, &v})
    for (float& x : *buf) x = u(rng);
  const auto qv = fa::bhsd<const float>(q.data(), p.q_dims()), kv = fa::bhsd<const float>(k.data(), p.kv_dims()),
             vv = fa::bhsd<const float>(v.data(), p.kv_dims());
  const fa::policy::cpu<> pol{1};

  fa::status st;
  const double t_dense = median_seconds([&] { st = fa::attend(pol, p, qv, kv, vv, fa::bhsd(o.data(), p.o_dims())); }, 5);
  if (!st) return std::fprintf(stderr, "fusedattn: %s\n", st.what()), 1;
  std::printf("dense flash, (1,1,2048,64) f32, 1 thread: %.2f ms\n", t_dense * 1e3);
  std::printf("%9s %14s %10s %10s %12s\n", "sparsity", "active blocks", "time ms", "speedup", "max error");

  bool ok = true;
  for (double sparsity : {0.0, 0.5, 0.75, 0.9}) {
    const fa::block_layout layout = fa::random_layout(g, sparsity, /*seed*/ 42, frame);
    if (sparsity == 0.0)
      std::printf("%9s plan: %s\n", "", fa::to_string(fa::plan(pol, p, qv, kv, vv, fa::bhsd(o.data(), p.o_dims()),
                                                                 fa::block_sparse{layout}))
                                          .c_str());
    const double t = median_seconds(
        [&] { st = fa::attend(pol, p, qv, kv, vv, fa::bhsd(o.data(), p.o_dims()), fa::block_sparse{layout}); }, 5);
    if (!st) return std::fprintf(stderr, "fusedattn: %s\n", st.what()), 1;
    const double err = sampled_error(p, layout, q, k, v, o);
    ok &= err < 1e-5;
    std::printf("%9.2f %8lld / %3lld %10.2f %9.2fx %12.2g\n", sparsity, (long long)layout.active_blocks(),
                (long long)(g.n_q_blocks() * g.n_kv_blocks()), t * 1e3, t_dense / t, err);
  }
  std::printf("%s\n", ok ? "OK" : "MISMATCH");
  return ok ? 0 : 1;
}
