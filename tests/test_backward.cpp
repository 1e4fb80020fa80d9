// The backward pass (attend_backward): against the float64 closed form (itself checked by finite differences),
// every mask and tail, GQA / MQA, the four scalar types, bitwise determinism across thread counts, the NaN contract
// and hostile inputs.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "support/backward_check.hpp"
#include "support/check.hpp"
#include "support/data.hpp"
#include "support/oracle.hpp"
#include "support/oracle_backward.hpp"

namespace fa = fusedattn;
using namespace fusedattn::testing;

namespace {

/// Runs forward + backward on a fresh random case and checks dQ, dK, dV against the oracle.
template <class T, class Policy = fa::policy::cpu<>>
void check_backward(const fa::problem& p, layout l, const fa::any_mask& mask, const Policy& pol = Policy{2}) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  backward_case<T> c(p, l, rng);
  INFO(std::string(fa::scalar_name<T>()) << " " << describe(p) << " " << describe(mask) << " " << layout_name(l)
                                         << " seed=" << seed);
  c.forward(mask);
  const fa::status st = c.backward(pol, mask);
  INFO(st.what());
  REQUIRE(st.ok());
  check_gradients(c, mask, [](const auto&... a) { return plain_backward(a...); });
}

/// L = Σ O∘dO in double, O by the float64 forward oracle.
double loss(const fa::problem& p, const std::vector<double>& q, const std::vector<double>& k,
            const std::vector<double>& v, const std::vector<double>& d_o, const fa::band_mask& mask) {
  const reference r = reference_attention<double>(p, fa::bhsd<const double>(q.data(), p.q_dims()),
                                                  fa::bhsd<const double>(k.data(), p.kv_dims()),
                                                  fa::bhsd<const double>(v.data(), p.kv_dims()), mask);
  double sum = 0;
  for (std::size_t i = 0; i < r.o.size(); ++i) sum += r.o[i] * d_o[i];
  return sum;
}

}  // namespace

TEST_CASE("backward oracle: the closed form agrees with central finite differences of L = sum(O * dO)",
          "[backward]") {
  const std::vector<std::pair<fa::problem, fa::any_mask>> cases = {
      {{1, 2, 1, 9, 11, 5}, fa::dense{}},
      {{2, 2, 2, 12, 7, 4}, fa::causal{fa::align::bottom_right}},
      {{1, 3, 3, 10, 10, 6}, fa::window{3, 1, fa::align::top_left}},
  };
  for (const auto& [p0, mask] : cases) {
    fa::problem p = p0;
    p.scale = 0.7;
    const std::uint64_t seed = fresh_seed();
    std::mt19937_64 rng(seed);
    INFO(describe(p) << " " << describe(mask) << " seed=" << seed);
    std::uniform_real_distribution<double> u(-1, 1);
    auto random = [&](std::size_t n) {
      std::vector<double> x(n);
      for (double& e : x) e = u(rng);
      return x;
    };
    std::vector<double> q = random(static_cast<std::size_t>(fa::cost::q_elements(p))),
                        k = random(static_cast<std::size_t>(fa::cost::kv_elements(p))),
                        v = random(static_cast<std::size_t>(fa::cost::kv_elements(p))),
                        d_o = random(static_cast<std::size_t>(fa::cost::q_elements(p)));
    const fa::band_mask bound = bind_band(mask, p);
    const reference_grads g = reference_backward(
        p, fa::bhsd<const double>(q.data(), p.q_dims()), fa::bhsd<const double>(k.data(), p.kv_dims()),
        fa::bhsd<const double>(v.data(), p.kv_dims()), fa::bhsd<const double>(d_o.data(), p.o_dims()), bound);
    constexpr double h = 1e-5;
    const std::pair<std::vector<double>*, const std::vector<double>*> which[3] = {{&q, &g.dq}, {&k, &g.dk}, {&v, &g.dv}};
    const char* names[3] = {"dq", "dk", "dv"};
    for (int w = 0; w < 3; ++w) {
      std::vector<double>& x = *which[w].first;
      for (int spot = 0; spot < 12; ++spot) {
        const std::size_t at = static_cast<std::size_t>(rng() % x.size());
        const double keep = x[at];
        x[at] = keep + h;
        const double up = loss(p, q, k, v, d_o, bound);
        x[at] = keep - h;
        const double down = loss(p, q, k, v, d_o, bound);
        x[at] = keep;
        const double fd = (up - down) / (2 * h);
        INFO(names[w] << "[" << at << "] closed form " << (*which[w].second)[at] << " finite difference " << fd);
        CHECK(std::abs(fd - (*which[w].second)[at]) <= 1e-7 * std::max(1.0, std::abs(fd)));
      }
    }
  }
}

TEST_CASE("backward matches the float64 oracle: f32, every mask and tail", "[backward]") {
  for (const fa::problem& p : tail_shapes())
    for (const fa::any_mask& m : all_masks()) check_backward<float>(p, layout::bhsd, m);
}

TEST_CASE("backward matches the float64 oracle: strided views, any scale, user tiles", "[backward]") {
  fa::problem p{2, 4, 2, 67, 93, 24};
  for (double scale : {0.05, 0.3, 2.0}) {
    p.scale = scale;
    for (layout l : {layout::bshd, layout::padded})
      for (const fa::any_mask& m : all_masks()) check_backward<float>(p, l, m);
  }
  fa::policy::cpu<> pol{3};
  pol.tiles = {13, 21, 0};
  for (const fa::any_mask& m : all_masks()) check_backward<float>({1, 3, 1, 50, 77, 40}, layout::padded, m, pol);
}

TEST_CASE("backward matches the float64 oracle: f64, f16, bf16 and the portable scalar path", "[backward]") {
  const std::vector<fa::problem> shapes = {{1, 2, 1, 33, 65, 64}, {2, 2, 2, 70, 70, 20}, {1, 1, 1, 1, 130, 128}};
  for (const fa::problem& p : shapes)
    for (const fa::any_mask& m : all_masks()) {
      check_backward<double>(p, layout::bhsd, m);
      check_backward<Eigen::half>(p, layout::bshd, m);
      check_backward<Eigen::bfloat16>(p, layout::padded, m);
      check_backward<float>(p, layout::bhsd, m, fa::policy::cpu_scalar{2});
    }
}

TEST_CASE("backward matches the float64 oracle: block-sparse layouts, per-head patterns, rules within",
          "[backward][block_sparse]") {
  const fa::problem p{2, 4, 2, 150, 170, 32};
  const std::vector<fa::block_geometry> geometries = {
      {p.seq_q, p.seq_kv, 32, 48, 1, 1}, {p.seq_q, p.seq_kv, 64, 16, 2, 4}, {p.seq_q, p.seq_kv, 7, 200, 1, 4}};
  for (const fa::block_geometry& g : geometries) {
    const fa::block_layout l = fa::random_layout(g, 0.5, fresh_seed(), {1, 0, 0, 1});
    check_backward<float>(p, layout::bhsd, fa::block_sparse{l});
    check_backward<float>(p, layout::padded, fa::block_sparse{l, fa::causal{fa::align::bottom_right}});
    check_backward<double>(p, layout::bhsd, fa::block_sparse{l, fa::window{20, 5}});
  }
}

TEST_CASE("backward: rows that see no key give dQ = 0 and add nothing", "[backward]") {
  // bottom_right causal with seq_q > seq_kv: the first seq_q − seq_kv rows see no key (lse = −inf).
  const fa::problem p{1, 2, 1, 40, 15, 16};
  std::mt19937_64 rng(fresh_seed());
  backward_case<float> c(p, layout::bhsd, rng);
  const fa::causal mask{fa::align::bottom_right};
  c.forward(mask);
  REQUIRE(c.backward(fa::policy::cpu<>{2}, mask).ok());
  for (fa::index_t h = 0; h < p.heads; ++h)
    for (fa::index_t i = 0; i < p.seq_q - p.seq_kv; ++i) {
      REQUIRE(c.lse[static_cast<std::size_t>(h * p.seq_q + i)] == -std::numeric_limits<float>::infinity());
      for (fa::index_t x = 0; x < p.head_dim; ++x) CHECK(c.dq.view.row(0, h, i)[x] == 0.0f);
    }
  // The same gradients when those rows' Q, dO and O hold garbage, NaN included.
  const std::vector<float> dk_before(c.dk.buf), dv_before(c.dv.buf), dq_before(c.dq.buf);
  for (fa::index_t h = 0; h < p.heads; ++h)
    for (fa::index_t x = 0; x < p.head_dim; ++x) {
      c.q.view.row(0, h, 3)[x] = std::numeric_limits<float>::quiet_NaN();
      c.d_o.view.row(0, h, 5)[x] = 1e30f;
      c.o.view.row(0, h, 7)[x] = std::numeric_limits<float>::quiet_NaN();
    }
  REQUIRE(c.backward(fa::policy::cpu<>{2}, mask).ok());
  CHECK(std::memcmp(c.dk.buf.data(), dk_before.data(), dk_before.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(c.dv.buf.data(), dv_before.data(), dv_before.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(c.dq.buf.data(), dq_before.data(), dq_before.size() * sizeof(float)) == 0);
}

TEST_CASE("backward: bitwise identical for any thread count", "[backward]") {
  const std::vector<std::pair<fa::problem, fa::any_mask>> cases = {
      {{1, 4, 2, 300, 517, 64}, fa::causal{fa::align::bottom_right}},
      {{2, 2, 1, 257, 700, 40}, fa::dense{}},
      {{1, 1, 1, 640, 640, 32}, fa::window{100, 0}},
  };
  for (const auto& [p, mask] : cases) {
    const std::uint64_t seed = fresh_seed();
    INFO(describe(p) << " " << describe(mask) << " seed=" << seed);
    std::vector<float> first[3];
    for (int threads : {1, 2, 3, 8}) {
      std::mt19937_64 rng(seed);
      backward_case<float> c(p, layout::bhsd, rng);
      c.forward(mask);
      REQUIRE(c.backward(fa::policy::cpu<>{threads}, mask).ok());
      if (threads == 1) {
        first[0] = c.dq.buf, first[1] = c.dk.buf, first[2] = c.dv.buf;
        continue;
      }
      INFO("threads " << threads);
      CHECK(std::memcmp(c.dq.buf.data(), first[0].data(), first[0].size() * sizeof(float)) == 0);
      CHECK(std::memcmp(c.dk.buf.data(), first[1].data(), first[1].size() * sizeof(float)) == 0);
      CHECK(std::memcmp(c.dv.buf.data(), first[2].data(), first[2].size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("backward: GQA equals the sum over repeated kv heads", "[backward]") {
  const fa::problem gqa{1, 6, 2, 45, 60, 24};
  const fa::problem mha{1, 6, 6, 45, 60, 24};
  const std::uint64_t seed = fresh_seed();
  INFO("seed=" << seed);
  std::mt19937_64 rng(seed);
  backward_case<double> a(gqa, layout::bhsd, rng), b(mha, layout::bhsd, rng);
  for (fa::index_t h = 0; h < mha.heads; ++h)
    for (fa::index_t j = 0; j < mha.seq_kv; ++j)
      for (fa::index_t x = 0; x < mha.head_dim; ++x) {
        b.k.view.row(0, h, j)[x] = a.k.view.row(0, gqa.kv_head(h), j)[x];
        b.v.view.row(0, h, j)[x] = a.v.view.row(0, gqa.kv_head(h), j)[x];
      }
  b.q.buf = a.q.buf;
  b.d_o.buf = a.d_o.buf;
  const fa::causal mask{};
  a.forward(mask);
  b.forward(mask);
  REQUIRE(a.backward(fa::policy::cpu<>{2}, mask).ok());
  REQUIRE(b.backward(fa::policy::cpu<>{2}, mask).ok());
  for (fa::index_t g = 0; g < gqa.heads_kv; ++g)
    for (fa::index_t j = 0; j < gqa.seq_kv; ++j)
      for (fa::index_t x = 0; x < gqa.head_dim; ++x) {
        double dk = 0, dv = 0;
        for (fa::index_t h = g * 3; h < g * 3 + 3; ++h) {
          dk += b.dk.view.row(0, h, j)[x];
          dv += b.dv.view.row(0, h, j)[x];
        }
        CHECK(a.dk.view.row(0, g, j)[x] == Approx(dk).margin(1e-12));
        CHECK(a.dv.view.row(0, g, j)[x] == Approx(dv).margin(1e-12));
      }
}

TEST_CASE("backward: a NaN input makes NaN exactly the gradients whose closed form reads it", "[backward]") {
  // O and lse come from the float64 forward here, so that the kernel and the oracle read the same values.
  const fa::problem p{1, 2, 1, 70, 90, 20};
  const fa::block_geometry geo{p.seq_q, p.seq_kv, 16, 32, 1, 1};
  const fa::block_layout layout_bs = fa::random_layout(geo, 0.5, 3, {1, 0, 0, 0});
  const std::vector<fa::any_mask> masks = {fa::dense{}, fa::causal{}, fa::window{6, 2, fa::align::bottom_right},
                                           fa::block_sparse{layout_bs}};
  const char* names[4] = {"q", "k", "v", "d_o"};
  for (const fa::any_mask& mask : masks)
    for (int which = 0; which < 4; ++which) {
      const std::uint64_t seed = fresh_seed();
      std::mt19937_64 rng(seed);
      backward_case<float> c(p, layout::bhsd, rng);
      operand<float>* target[4] = {&c.q, &c.k, &c.v, &c.d_o};
      const fa::dims4 dims = target[which]->view.dims;
      const fa::index_t h = static_cast<fa::index_t>(rng() % static_cast<std::uint64_t>(dims.h));
      const fa::index_t s = static_cast<fa::index_t>(rng() % static_cast<std::uint64_t>(dims.s));
      const fa::index_t x = static_cast<fa::index_t>(rng() % static_cast<std::uint64_t>(dims.d));
      target[which]->view.row(0, h, s)[x] = std::numeric_limits<float>::quiet_NaN();
      INFO(describe(mask) << " NaN in " << names[which] << "(0, " << h << ", " << s << ", " << x << ") seed=" << seed);
      std::visit(
          [&](const auto& m) {
            const auto bound = bind(m, p);
            const reference fwd = reference_attention<double>(p, c.q.cview(), c.k.cview(), c.v.cview(), bound);
            for (std::size_t i = 0; i < c.lse.size(); ++i) c.lse[i] = static_cast<float>(fwd.lse[i]);
            for (fa::index_t hh = 0; hh < p.heads; ++hh)
              for (fa::index_t i = 0; i < p.seq_q; ++i)
                for (fa::index_t y = 0; y < p.head_dim; ++y)
                  c.o.view.row(0, hh, i)[y] =
                      static_cast<float>(fwd.o[static_cast<std::size_t>((hh * p.seq_q + i) * p.head_dim + y)]);
            const fa::status st = c.backward(fa::policy::cpu<>{2}, m);
            REQUIRE(st.ok());
            const reference_grads ref =
                plain_backward(p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.cview(), c.d_o.cview(), c.lse.data(), bound);
            const std::pair<const fa::tensor_ref<float>*, const std::vector<double>*> grads[3] = {
                {&c.dq.view, &ref.dq}, {&c.dk.view, &ref.dk}, {&c.dv.view, &ref.dv}};
            const char* gname[3] = {"dq", "dk", "dv"};
            for (int gi = 0; gi < 3; ++gi) {
              const fa::tensor_ref<float>& got = *grads[gi].first;
              const std::vector<double>& want = *grads[gi].second;
              std::size_t nan_got = 0, nan_want = 0, mismatched = 0;
              double err = 0;
              for (fa::index_t hh = 0; hh < got.dims.h; ++hh)
                for (fa::index_t j = 0; j < got.dims.s; ++j)
                  for (fa::index_t y = 0; y < got.dims.d; ++y) {
                    const double a = got.row(0, hh, j)[y];
                    const double e = want[static_cast<std::size_t>((hh * got.dims.s + j) * got.dims.d + y)];
                    nan_got += std::isnan(a);
                    nan_want += std::isnan(e);
                    if (std::isnan(a) != std::isnan(e)) ++mismatched;
                    else if (!std::isnan(a)) err = std::max(err, std::abs(a - e));
                  }
              INFO(gname[gi] << ": NaN " << nan_got << " (oracle " << nan_want << "), mismatched " << mismatched
                             << ", error elsewhere " << err);
              CHECK(mismatched == 0);
              CHECK(err <= 1e-3);
            }
          },
          mask);
    }
}

TEST_CASE("backward: hostile inputs are rejected naming the field, nothing written", "[backward]") {
  const fa::problem p{1, 4, 2, 20, 30, 16};
  std::mt19937_64 rng(fresh_seed());
  backward_case<float> c(p, layout::bhsd, rng);
  c.forward(fa::dense{});
  const auto q = c.q.cview(), k = c.k.cview(), v = c.v.cview(), o = c.o.cview(), d_o = c.d_o.cview();
  const auto dq = c.dq.view, dk = c.dk.view, dv = c.dv.view;
  std::vector<float> other(c.dq.buf.size() * 4, 0.5f);
  const std::vector<float> dq0 = c.dq.buf, dk0 = c.dk.buf, dv0 = c.dv.buf;
  const fa::policy::cpu<> pol{2};
  const auto expect_rejected = [&](const fa::status& st, const std::string& field) {
    INFO(st.what());
    CHECK(st.code() == fa::errc::invalid_argument);
    CHECK(std::string(st.what()).find(field) != std::string::npos);
    CHECK(unchanged(c.dq.buf, dq0));
    CHECK(unchanged(c.dk.buf, dk0));
    CHECK(unchanged(c.dv.buf, dv0));
  };
  auto dims = [](fa::dims4 d, fa::index_t ds) { return fa::dims4{d.b, d.h, d.s + ds, d.d}; };
  // Mismatched shapes.
  expect_rejected(fa::attend_backward(pol, p, q, k, v, o, fa::bhsd<const float>(c.d_o.buf.data(), dims(p.o_dims(), -1)),
                                      c.lse.data(), dq, dk, dv),
                  "d_o.dims.s");
  expect_rejected(fa::attend_backward(pol, p, q, k, v, o, d_o, c.lse.data(), fa::bhsd(other.data(), dims(p.q_dims(), 1)),
                                      dk, dv),
                  "dq.dims.s");
  expect_rejected(fa::attend_backward(pol, p, q, k, v, o, d_o, c.lse.data(), dq,
                                      fa::bhsd(other.data(), fa::dims4{1, 4, 30, 16}), dv),
                  "dk.dims.h");
  expect_rejected(fa::attend_backward(pol, p, q, k, v, o, d_o, c.lse.data(), dq, dk,
                                      fa::bhsd(other.data(), fa::dims4{1, 2, 30, 8})),
                  "dv.dims.d");
  expect_rejected(fa::attend_backward(pol, p, q, k, v, fa::bhsd<const float>(nullptr, p.o_dims()), d_o, c.lse.data(),
                                      dq, dk, dv),
                  "o.data");
  // lse.
  expect_rejected(fa::attend_backward(pol, p, q, k, v, o, d_o, nullptr, dq, dk, dv), "lse");
  // Aliasing outputs with each other, with inputs, with lse; rows sharing memory.
  expect_rejected(fa::attend_backward(pol, p, q, k, v, o, d_o, c.lse.data(), dq, dk, dk), "dk overlaps dv");
  expect_rejected(fa::attend_backward(pol, p, q, k, v, o, d_o, c.lse.data(), fa::bhsd(c.dk.buf.data(), p.q_dims()),
                                      dk, dv),
                  "dq overlaps dk");
  expect_rejected(fa::attend_backward(pol, p, q, k, v, o, d_o, c.lse.data(), dq, dk,
                                      fa::bhsd(const_cast<float*>(c.v.buf.data()), p.kv_dims())),
                  "dv overlaps v");
  expect_rejected(fa::attend_backward(pol, p, q, k, v, o, d_o, c.lse.data(),
                                      fa::bhsd(const_cast<float*>(c.d_o.buf.data()), p.q_dims()), dk, dv),
                  "dq overlaps d_o");
  expect_rejected(fa::attend_backward(pol, p, q, k, v, o, d_o, c.lse.data(), dq,
                                      fa::bhsd(reinterpret_cast<float*>(c.lse.data()), fa::dims4{1, 2, 30, 16}), dv),
                  "dk overlaps lse");
  fa::tensor_ref<float> shared_rows = dq;
  shared_rows.stride.s = 0;
  expect_rejected(fa::attend_backward(pol, p, q, k, v, o, d_o, c.lse.data(), shared_rows, dk, dv), "dq: its strides");
  // Problem, mask and policy.
  fa::problem bad = p;
  bad.scale = -1.0;
  expect_rejected(fa::attend_backward(pol, bad, q, k, v, o, d_o, c.lse.data(), dq, dk, dv), "problem.scale");
  expect_rejected(fa::attend_backward(pol, p, q, k, v, o, d_o, c.lse.data(), dq, dk, dv, fa::window{-1, 0}),
                  "window.left");
  expect_rejected(fa::attend_backward(fa::policy::cpu<>{0}, p, q, k, v, o, d_o, c.lse.data(), dq, dk, dv),
                  "policy.threads");
  const fa::status naive = fa::attend_backward(fa::policy::cpu_naive{1}, p, q, k, v, o, d_o, c.lse.data(), dq, dk, dv);
  CHECK(naive.code() == fa::errc::unsupported);
  CHECK(unchanged(c.dq.buf, dq0));
}

#if !FUSEDATTN_TEST_SUBSET  // [heavy]: not compiled in CI's sanitizer stage
TEST_CASE("backward matches the float64 oracle: long sequences, head_dim 64 and 128", "[backward][heavy]") {
  check_backward<float>({1, 2, 1, 1100, 1300, 64}, layout::bhsd, fa::causal{fa::align::bottom_right});
  check_backward<float>({1, 2, 2, 777, 1025, 128}, layout::bshd, fa::dense{});
  check_backward<Eigen::bfloat16>({1, 2, 1, 1024, 1024, 128}, layout::bhsd, fa::causal{});
}
#endif
