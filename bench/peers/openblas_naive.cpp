// Peer "what a user would write with a BLAS": the naive three-pass attention on OpenBLAS's cblas_sgemm, one
// (batch, head) after the other, with OpenBLAS threads set to the row's thread count and the softmax a plain
// single-threaded row loop (vectorised exp through Eigen arrays). Rows peer_openblas_naive/...
#include "../peers.hpp"

#if FUSEDATTN_BENCH_WITH_OPENBLAS

#include <cblas.h>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace fusedattn::bench {
namespace {

/// Passes over S×S through memory: sgemm writes S·scale (1), mask + softmax reads and writes each row (2),
/// the second sgemm reads P (1).
constexpr int peer_score_passes = 4;
/// Largest |peer − float64 loop| accepted on the check before timing (f32, inputs in [-1, 1)).
constexpr float check_tolerance = 1e-4f;

/// O = softmax(scale · Q·Kᵀ + mask) · V per (batch, head), B·H·S·D contiguous, f32.
void openblas_naive(const problem& p, const band_mask& mask, const float* q, const float* k, const float* v, float* o,
                    std::vector<float>& s) {
  const index_t sq = p.seq_q, skv = p.seq_kv, d = p.head_dim;
  const float scale = static_cast<float>(p.softmax_scale());
  s.resize(static_cast<std::size_t>(sq * skv));
  for (index_t b = 0; b < p.batch; ++b)
    for (index_t h = 0; h < p.heads; ++h) {
      const float* qh = q + (b * p.heads + h) * sq * d;
      const float* kh = k + (b * p.heads_kv + p.kv_head(h)) * skv * d;
      const float* vh = v + (b * p.heads_kv + p.kv_head(h)) * skv * d;
      float* oh = o + (b * p.heads + h) * sq * d;
      // S = scale · Q·Kᵀ (s_q × s_kv).
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(sq), static_cast<int>(skv),
                  static_cast<int>(d), scale, qh, static_cast<int>(d), kh, static_cast<int>(d), 0.0f, s.data(),
                  static_cast<int>(skv));
      // P = softmax(S + mask) row by row over the keys the row may see: m = max, P = exp(S − m), P /= Σ P;
      // keys outside the row's band get P = 0 (a row with no key stays 0). Eigen arrays vectorise the exp.
      for (index_t i = 0; i < sq; ++i) {
        float* row = s.data() + i * skv;
        const kv_span keys = mask.row_range(i);
        std::fill(row, row + std::max<index_t>(keys.begin, 0), 0.0f);
        std::fill(row + std::max(keys.begin, std::min(keys.end, skv)), row + skv, 0.0f);
        if (keys.empty()) continue;
        Eigen::Map<Eigen::ArrayXf> x(row + keys.begin, keys.end - keys.begin);
        const float m = x.maxCoeff();
        x = (x - m).exp();
        x *= 1.0f / x.sum();
      }
      // O = P·V (s_q × d).
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(sq), static_cast<int>(d),
                  static_cast<int>(skv), 1.0f, s.data(), static_cast<int>(skv), vh, static_cast<int>(d), 0.0f, oh,
                  static_cast<int>(d));
    }
}

/// Sequence length of the correctness check run before a peer row is timed.
constexpr index_t check_seq = 256;

/// Runs the peer on one head of at most check_seq queries and keys (the row's mask kind and head_dim) and returns
/// its largest error against a float64 loop: O = softmax(scale · Q·Kᵀ + mask) · V.
float check_one_head(const row_spec& r) {
  const problem p{1, 1, 1, std::min(r.sh.s_q, check_seq), std::min(r.sh.s_kv, check_seq), r.sh.d};
  const band_mask mask = std::visit([&](const auto& m) { return bind(m, p); }, to_mask(r.mask));
  operands<float> x(p, 7);
  std::vector<float> s;
  openblas_naive(p, mask, x.q.data(), x.k.data(), x.v.data(), x.o.data(), s);
  const index_t d = p.head_dim;
  const double scale = p.softmax_scale();
  std::vector<double> w(static_cast<std::size_t>(p.seq_kv));
  double err = 0;
  for (index_t i = 0; i < p.seq_q; ++i) {
    double m = -std::numeric_limits<double>::infinity();
    for (index_t j = 0; j < p.seq_kv; ++j) {
      double dot = 0;
      for (index_t c = 0; c < d; ++c) dot += double(x.q[std::size_t(i * d + c)]) * double(x.k[std::size_t(j * d + c)]);
      w[std::size_t(j)] = mask.allowed(i, j) ? scale * dot : -std::numeric_limits<double>::infinity();
      m = std::max(m, w[std::size_t(j)]);
    }
    double l = 0;
    for (index_t j = 0; j < p.seq_kv; ++j) l += (w[std::size_t(j)] = std::isinf(m) ? 0.0 : std::exp(w[std::size_t(j)] - m));
    for (index_t c = 0; c < d; ++c) {
      double o = 0;
      for (index_t j = 0; j < p.seq_kv; ++j) o += w[std::size_t(j)] * double(x.v[std::size_t(j * d + c)]);
      const double ref = l > 0 ? o / l : 0.0;
      err = std::max(err, std::abs(ref - double(x.o[std::size_t(i * d + c)])));
    }
  }
  return static_cast<float>(err);
}

void openblas_row(benchmark::State& state, row_spec r) {
  openblas_set_num_threads(r.threads);
  const float err = check_one_head(r);
  if (!(err <= check_tolerance)) {
    state.SkipWithError(("peer_openblas_naive differs from a float64 loop by " + std::to_string(err)).c_str());
    return;
  }
  const problem p = r.sh.to_problem();
  const band_mask mask = std::visit([&](const auto& m) { return bind(m, p); }, to_mask(r.mask));
  operands<float> x(p);
  std::vector<float> s;
  openblas_naive(p, mask, x.q.data(), x.k.data(), x.v.data(), x.o.data(), s);  // untimed warm-up call
  for (auto _ : state) {
    openblas_naive(p, mask, x.q.data(), x.k.data(), x.v.data(), x.o.data(), s);
    benchmark::DoNotOptimize(x.o.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, p, r.threads, 1.0, cost::flops(p), cost::naive_bytes(p, sizeof(float), sizeof(float),
                                                                             peer_score_passes),
               cost::compulsory_bytes(p, sizeof(float)));
  state.SetLabel(row_label(r));
}

}  // namespace

std::string peer_info() {
  return std::string("peer_openblas_naive: cblas_sgemm + a plain mask/softmax loop, OpenBLAS core ") +
         openblas_get_corename() + " (" + openblas_get_config() + ")";
}

void register_peer_rows(const row_spec& r) {
  if (r.type != scalar::f32) return;
  benchmark::RegisterBenchmark(row_name("peer_openblas_naive", r).c_str(), openblas_row, r)
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
}

}  // namespace fusedattn::bench

#else

namespace fusedattn::bench {
void register_peer_rows(const row_spec&) {}
std::string peer_info() { return "no peer compiled in (OpenBLAS not found at configure time)"; }
}  // namespace fusedattn::bench

#endif
