// Example 06: attention over Eigen::Maps of buffers you already have, without copies.
// A transformer layer keeps activations in its own buffers and views them as Eigen::Maps. Q = X·Wq, K = X·Wk,
// V = X·Wv are (seq × heads·d) row-major matrices: that is the B·S·H·D layout (batch 1), and fa::bshd() views the
// same memory. The output lands in another (seq × heads·d) matrix,
// ready for the output projection O·Wo. Checked against a float64 loop; exits non-zero on a mismatch.
#include <cmath>
#include <cstdio>
#include <vector>

#include <Eigen/Core>
#include <fusedattn/fusedattn.hpp>

namespace fa = fusedattn;
using row_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

int main() {
  const fa::index_t seq = 384, model = 512, heads = 8, d = model / heads;
  std::srand(6);
  const row_matrix x = row_matrix::Random(seq, model);
  const row_matrix wq = row_matrix::Random(model, model) / std::sqrt(float(model));
  const row_matrix wk = row_matrix::Random(model, model) / std::sqrt(float(model));
  const row_matrix wv = row_matrix::Random(model, model) / std::sqrt(float(model));
  // The layer's own activation buffers, seen by Eigen through Maps (seq × (heads · d), row-major).
  std::vector<float> q_buf(static_cast<std::size_t>(seq * model)), k_buf(q_buf.size()), v_buf(q_buf.size()),
      o_buf(q_buf.size());
  Eigen::Map<row_matrix> q(q_buf.data(), seq, model), k(k_buf.data(), seq, model), v(v_buf.data(), seq, model),
      o(o_buf.data(), seq, model);
  q.noalias() = x * wq;
  k.noalias() = x * wk;
  v.noalias() = x * wv;

  // The problem: one sequence, 8 heads of 64, causal. The views read the Eigen storage in place.
  const fa::problem p{1, heads, heads, seq, seq, d};
  std::printf("plan: %s\n", fa::to_string(fa::plan(fa::policy::cpu<>{}, p, fa::bshd<const float>(q.data(), p.q_dims()),
                                                    fa::bshd<const float>(k.data(), p.kv_dims()),
                                                    fa::bshd<const float>(v.data(), p.kv_dims()),
                                                    fa::bshd(o.data(), p.o_dims()), fa::causal{}))
                                     .c_str());
  const fa::status st = fa::attend(fa::policy::cpu<>{}, p, fa::bshd<const float>(q.data(), p.q_dims()),
                                   fa::bshd<const float>(k.data(), p.kv_dims()),
                                   fa::bshd<const float>(v.data(), p.kv_dims()), fa::bshd(o.data(), p.o_dims()),
                                   fa::causal{});
  if (!st) {
    std::fprintf(stderr, "fusedattn: %s\n", st.what());
    return 1;
  }

  // Float64 check, head by head, with Eigen blocks: head h occupies columns [h·d, (h+1)·d).
  double err = 0;
  for (fa::index_t h = 0; h < heads; ++h) {
    const Eigen::MatrixXd qh = q.middleCols(h * d, d).cast<double>();
    const Eigen::MatrixXd kh = k.middleCols(h * d, d).cast<double>();
    const Eigen::MatrixXd vh = v.middleCols(h * d, d).cast<double>();
    Eigen::MatrixXd s = qh * kh.transpose() / std::sqrt(double(d));
    for (fa::index_t i = 0; i < seq; ++i) {
      for (fa::index_t j = i + 1; j < seq; ++j) s(i, j) = -INFINITY;  // causal
      s.row(i) = (s.row(i).array() - s.row(i).maxCoeff()).exp().matrix();
      s.row(i) /= s.row(i).sum();
    }
    const Eigen::MatrixXd ref = s * vh;
    err = std::max(err, (ref - o.middleCols(h * d, d).cast<double>()).cwiseAbs().maxCoeff());
  }
  const row_matrix projected = o * wq.transpose();  // the next layer goes on with plain Eigen
  std::printf("attention over Eigen::Maps in B.S.H.D layout: (seq %lld, %lld heads x %lld), causal\n", (long long)seq,
              (long long)heads, (long long)d);
  std::printf("max error vs float64: %.2g; output projection norm %.3f\n", err, projected.norm());
  const bool ok = err < 1e-5;
  std::printf("%s\n", ok ? "OK" : "MISMATCH");
  return ok ? 0 : 1;
}
