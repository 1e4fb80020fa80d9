// Example 11: one training step of a small causal GQA attention layer, in float32, with fusedattn doing the
// attention forward and backward:
//   forward   Q = X·Wq, K = X·Wk, V = X·Wv (seq × heads·head_dim: a B·S·H·D view, no copy), O = attention(Q, K, V),
//             Y = O·Wo, loss = ½ Σ (Y − target)² / seq
//   backward  dY = (Y − target) / seq, dWo = Oᵀ·dY, dO = dY·Woᵀ, (dQ, dK, dV) = attend_backward(...),
//             dWq = Xᵀ·dQ, dWk = Xᵀ·dK, dWv = Xᵀ·dV
//   update    W −= lr · dW (plain SGD), then the loss again: it must go down.
// The four weight gradients are checked against the same step in float64 with the attention written out as plain
// loops (forward and the closed-form backward). Exits non-zero on a mismatch.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <Eigen/Dense>
#include <fusedattn/fusedattn.hpp>

namespace fa = fusedattn;

namespace {

template <class S>
using matrix = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

constexpr fa::index_t seq = 192, model = 64, heads = 4, heads_kv = 2, head_dim = 16;

/// The layer's weights.
template <class S>
struct weights {
  matrix<S> wq, wk, wv, wo;  // model × heads·d, model × heads_kv·d (twice), heads·d × model
  template <class U>
  weights<U> cast() const {
    return {wq.template cast<U>(), wk.template cast<U>(), wv.template cast<U>(), wo.template cast<U>()};
  }
};

const fa::problem layer{1, heads, heads_kv, seq, seq, head_dim};

/// Float64 causal GQA attention forward and its closed-form backward, plain loops over [seq][heads·d] matrices.
void attention_f64(const matrix<double>& q, const matrix<double>& k, const matrix<double>& v, matrix<double>& o,
                   const matrix<double>* d_o, matrix<double>* dq, matrix<double>* dk, matrix<double>* dv) {
  const double scale = 1.0 / std::sqrt(double(head_dim));
  o = matrix<double>::Zero(seq, heads * head_dim);
  if (d_o) {
    *dq = matrix<double>::Zero(seq, heads * head_dim);
    *dk = matrix<double>::Zero(seq, heads_kv * head_dim);
    *dv = matrix<double>::Zero(seq, heads_kv * head_dim);
  }
  std::vector<double> p(seq);
  for (fa::index_t h = 0; h < heads; ++h) {
    const fa::index_t g = h / (heads / heads_kv), qc = h * head_dim, kc = g * head_dim;
    for (fa::index_t i = 0; i < seq; ++i) {
      double m = -INFINITY, l = 0;
      for (fa::index_t j = 0; j <= i; ++j) {
        p[j] = scale * q.row(i).segment(qc, head_dim).dot(k.row(j).segment(kc, head_dim));
        m = std::max(m, p[j]);
      }
      for (fa::index_t j = 0; j <= i; ++j) l += (p[j] = std::exp(p[j] - m));
      for (fa::index_t j = 0; j <= i; ++j) {
        p[j] /= l;
        o.row(i).segment(qc, head_dim) += p[j] * v.row(j).segment(kc, head_dim);
      }
      if (!d_o) continue;
      // dV_j += P_ij dO_i; dS_ij = P_ij (dO_i·V_j − dO_i·O_i); dQ_i += scale dS_ij K_j; dK_j += scale dS_ij Q_i.
      const double delta = d_o->row(i).segment(qc, head_dim).dot(o.row(i).segment(qc, head_dim));
      for (fa::index_t j = 0; j <= i; ++j) {
        dv->row(j).segment(kc, head_dim) += p[j] * d_o->row(i).segment(qc, head_dim);
        const double ds = p[j] * (d_o->row(i).segment(qc, head_dim).dot(v.row(j).segment(kc, head_dim)) - delta);
        dq->row(i).segment(qc, head_dim) += scale * ds * k.row(j).segment(kc, head_dim);
        dk->row(j).segment(kc, head_dim) += scale * ds * q.row(i).segment(qc, head_dim);
      }
    }
  }
}

/// The float32 step's pieces: forward through fusedattn (O and lse kept for the backward).
struct forward_f32 {
  matrix<float> q, k, v, o, y;
  std::vector<float> lse;
  float loss = 0;
};

forward_f32 forward(const weights<float>& w, const matrix<float>& x, const matrix<float>& target,
                    const fa::policy::cpu<>& pol, int& failures) {
  forward_f32 f{x * w.wq, x * w.wk, x * w.wv, matrix<float>(seq, heads * head_dim), {}, {}, 0};
  f.lse.resize(static_cast<std::size_t>(layer.lse_size()));
  const fa::status st = fa::attend(pol, layer, fa::bshd<const float>(f.q.data(), layer.q_dims()),
                                   fa::bshd<const float>(f.k.data(), layer.kv_dims()),
                                   fa::bshd<const float>(f.v.data(), layer.kv_dims()),
                                   fa::bshd(f.o.data(), layer.o_dims()), fa::causal{}, f.lse.data());
  if (!st) {
    std::fprintf(stderr, "attend: %s\n", st.what());
    ++failures;
  }
  f.y = f.o * w.wo;
  f.loss = 0.5f * (f.y - target).squaredNorm() / float(seq);
  return f;
}

/// Largest |a − b| over the largest |b|.
double relative_error(const matrix<float>& a, const matrix<double>& b) {
  return (a.cast<double>() - b).cwiseAbs().maxCoeff() / std::max(1e-300, b.cwiseAbs().maxCoeff());
}

}  // namespace

int main() {
  std::mt19937 rng(11);
  std::normal_distribution<double> n01(0.0, 1.0);
  const auto random = [&](fa::index_t r, fa::index_t c, double sd) {
    matrix<double> m(r, c);
    for (fa::index_t i = 0; i < m.size(); ++i) m.data()[i] = sd * n01(rng);
    return m;
  };
  // Xavier-like initial weights: unit-variance inputs give unit-variance projections.
  const double in_sd = 1.0 / std::sqrt(double(model)), out_sd = 1.0 / std::sqrt(double(heads * head_dim));
  const weights<double> w64{random(model, heads * head_dim, in_sd), random(model, heads_kv * head_dim, in_sd),
                            random(model, heads_kv * head_dim, in_sd), random(heads * head_dim, model, out_sd)};
  const matrix<double> x64 = random(seq, model, 1.0), target64 = random(seq, model, 1.0);
  weights<float> w = w64.cast<float>();
  const matrix<float> x = x64.cast<float>(), target = target64.cast<float>();
  const fa::policy::cpu<> pol;
  int failures = 0;

  // Float32 forward and backward, fusedattn doing the attention.
  const auto t0 = std::chrono::steady_clock::now();
  const forward_f32 f = forward(w, x, target, pol, failures);
  const matrix<float> dy = (f.y - target) / float(seq);
  const matrix<float> dwo = f.o.transpose() * dy;
  const matrix<float> d_o = dy * w.wo.transpose();
  matrix<float> dq(seq, heads * head_dim), dk(seq, heads_kv * head_dim), dv(seq, heads_kv * head_dim);
  const fa::status st = fa::attend_backward(
      pol, layer, fa::bshd<const float>(f.q.data(), layer.q_dims()), fa::bshd<const float>(f.k.data(), layer.kv_dims()),
      fa::bshd<const float>(f.v.data(), layer.kv_dims()), fa::bshd<const float>(f.o.data(), layer.o_dims()),
      fa::bshd<const float>(d_o.data(), layer.o_dims()), f.lse.data(), fa::bshd(dq.data(), layer.q_dims()),
      fa::bshd(dk.data(), layer.kv_dims()), fa::bshd(dv.data(), layer.kv_dims()), fa::causal{});
  if (!st) {
    std::fprintf(stderr, "attend_backward: %s\n", st.what());
    return 1;
  }
  const weights<float> grad{x.transpose() * dq, x.transpose() * dk, x.transpose() * dv, dwo};
  const double step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  // The same step in float64, attention as plain loops.
  const matrix<double> q64 = x64 * w64.wq, k64 = x64 * w64.wk, v64 = x64 * w64.wv;
  matrix<double> o64, dq64, dk64, dv64;
  attention_f64(q64, k64, v64, o64, nullptr, nullptr, nullptr, nullptr);
  const matrix<double> y64 = o64 * w64.wo, dy64 = (y64 - target64) / double(seq);
  const matrix<double> d_o64 = dy64 * w64.wo.transpose();
  attention_f64(q64, k64, v64, o64, &d_o64, &dq64, &dk64, &dv64);
  const double loss64 = 0.5 * (y64 - target64).squaredNorm() / double(seq);
  const weights<double> grad64{x64.transpose() * dq64, x64.transpose() * dk64, x64.transpose() * dv64,
                               o64.transpose() * dy64};

  std::printf("layer: seq %ld, model %ld, heads %ld (kv heads %ld), head_dim %ld, causal; one step %.2f ms\n",
              long(seq), long(model), long(heads), long(heads_kv), long(head_dim), step_ms);
  std::printf("loss: float32 %.6f, float64 %.6f\n", f.loss, loss64);
  // Float32 against float64: the gradients pass through two float32 GEMMs around the attention, so a few units of
  // float32 roundoff times the reduction lengths (seq, model) is what to expect.
  constexpr double tolerance = 1e-4;
  const std::pair<const char*, double> checks[4] = {{"dWq", relative_error(grad.wq, grad64.wq)},
                                                    {"dWk", relative_error(grad.wk, grad64.wk)},
                                                    {"dWv", relative_error(grad.wv, grad64.wv)},
                                                    {"dWo", relative_error(grad.wo, grad64.wo)}};
  for (const auto& [name, err] : checks) {
    const bool ok = err <= tolerance;
    failures += !ok;
    std::printf("%s: relative error against float64 %.2e (tolerance %.0e) %s\n", name, err, tolerance,
                ok ? "ok" : "MISMATCH");
  }

  // SGD update, then the loss again.
  constexpr float lr = 0.05f;
  w.wq -= lr * grad.wq;
  w.wk -= lr * grad.wk;
  w.wv -= lr * grad.wv;
  w.wo -= lr * grad.wo;
  const float after = forward(w, x, target, pol, failures).loss;
  const bool down = after < f.loss;
  failures += !down;
  std::printf("loss after one SGD step (lr %.2f): %.6f (%s)\n", lr, after, down ? "down" : "NOT DOWN");
  std::printf(failures ? "FAILED\n" : "ok\n");
  return failures ? 1 : 0;
}
