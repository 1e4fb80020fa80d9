// merge_partials: two attend calls over disjoint key ranges, merged, against the float64 oracle over all keys; the
// −inf and NaN rules; in place; strided lse views; bad input refused with nothing written.
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include <fusedattn/dist/merge.hpp>

#include "dist_support.hpp"
#include "support/check.hpp"

namespace fa = fusedattn;
using namespace fusedattn::testing;
using fusedattn::index_t;
using fusedattn::scalar_name;

namespace {

constexpr float neg_inf = -std::numeric_limits<float>::infinity();

/// Keys [0, split) and [split, S) computed apart with lse, merged into an accumulator of type `Out`, checked against
/// the oracle over every key. Causal top-left over all keys is causal top-left on the first range and causal
/// bottom-right on the second (seq_kv − seq_q = −split: query i sees the second range's local keys j <= i − split),
/// so rows i < split see none of the second range: that part's lse is −inf and must contribute nothing.
template <class T, class Out>
void split_and_merge(const fa::problem& p, index_t split, bool causal) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  attention_case<T> c(p, layout::padded, rng);
  INFO(scalar_name<T>() << " -> " << scalar_name<Out>() << " " << describe(p) << " split " << split
                        << (causal ? " causal" : " dense") << " seed=" << seed);
  fa::problem pa = p, pb = p;
  pa.seq_kv = split;
  pb.seq_kv = p.seq_kv - split;
  const auto rows = [](const fa::tensor_ref<const T>& t, index_t r0, index_t n) {
    return fa::tensor_ref<const T>{t.data + r0 * t.stride.s, {t.dims.b, t.dims.h, n, t.dims.d}, t.stride};
  };
  std::vector<T> oa(static_cast<std::size_t>(p.batch * p.heads * p.seq_q * p.head_dim));
  std::vector<T> ob(oa.size());
  std::vector<float> la(static_cast<std::size_t>(p.lse_size())), lb(la.size());
  const fa::policy::cpu<> pol{2};
  fa::status st;
  if (causal) {
    st = fa::attend(pol, pa, c.q.cview(), rows(c.k.cview(), 0, split), rows(c.v.cview(), 0, split),
                    fa::bhsd(oa.data(), p.q_dims()), fa::causal{fa::align::top_left}, la.data());
    REQUIRE(st.ok());
    st = fa::attend(pol, pb, c.q.cview(), rows(c.k.cview(), split, pb.seq_kv), rows(c.v.cview(), split, pb.seq_kv),
                    fa::bhsd(ob.data(), p.q_dims()), fa::causal{fa::align::bottom_right}, lb.data());
  } else {
    st = fa::attend(pol, pa, c.q.cview(), rows(c.k.cview(), 0, split), rows(c.v.cview(), 0, split),
                    fa::bhsd(oa.data(), p.q_dims()), fa::dense{}, la.data());
    REQUIRE(st.ok());
    st = fa::attend(pol, pb, c.q.cview(), rows(c.k.cview(), split, pb.seq_kv), rows(c.v.cview(), split, pb.seq_kv),
                    fa::bhsd(ob.data(), p.q_dims()), fa::dense{}, lb.data());
  }
  REQUIRE(st.ok());
  operand<Out> merged(p.q_dims(), layout::padded);
  std::vector<float> lse(la.size(), 5.0f);
  st = fa::merge_partials(fa::bhsd<const T>(oa.data(), p.q_dims()), la.data(), fa::bhsd<const T>(ob.data(), p.q_dims()),
                          lb.data(), merged.view, lse.data(), 2);
  REQUIRE(st.ok());
  const fa::band_mask whole = causal ? fa::bind(fa::causal{}, p) : fa::bind(fa::dense{}, p);
  const expected e = expect(c, whole);
  const double allowance = merge_allowance<T>(2, max_abs_finite(e.ref.lse)) + 8.0 * epsilon<Out>();
  const double err = max_abs_error(merged.view, e.ref.o);
  INFO("max error " << err << " tolerance " << e.tolerance + allowance);
  CHECK(err <= e.tolerance + allowance);
  const double lse_err = max_lse_error(lse, e.ref.lse);
  INFO("lse error " << lse_err << " tolerance " << e.lse_tolerance + allowance);
  CHECK(lse_err <= e.lse_tolerance + allowance);
}

}  // namespace

TEST_CASE("merge_partials: two key ranges merged equal one call over all keys", "[merge]") {
  const std::vector<std::pair<fa::problem, index_t>> cases = {
      {{1, 1, 1, 1, 2, 1}, 1},        {{2, 3, 3, 127, 127, 64}, 50}, {{1, 4, 2, 33, 200, 80}, 137},
      {{1, 2, 1, 300, 300, 3}, 129},  {{1, 1, 1, 7, 1000, 128}, 999}};
  for (const auto& [p, split] : cases)
    for (bool causal : {false, true}) {
      if (causal && p.seq_q != p.seq_kv) continue;
      split_and_merge<float, float>(p, split, causal);
      split_and_merge<double, double>(p, split, causal);
      split_and_merge<Eigen::bfloat16, float>(p, split, causal);
      split_and_merge<Eigen::half, Eigen::half>(p, split, causal);
    }
}

TEST_CASE("merge_partials: the -inf and NaN rules, element by element", "[merge]") {
  const fa::dims4 d{1, 1, 5, 3};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Rows: 0 both finite; 1 only a; 2 only b; 3 neither; 4 a NaN lse.
  std::vector<float> oa = {0.5f, -0.25f, 1.0f, 0.75f, 0.125f, -1.0f, nan, nan, nan, 0.3f, 0.2f, 0.1f, 1, 2, 3};
  std::vector<float> ob = {-0.5f, 0.25f, 0.0f, nan, nan, nan, 0.6f, -0.4f, 0.2f, 0.9f, 0.8f, 0.7f, 4, 5, 6};
  std::vector<float> la = {0.25f, 1.5f, neg_inf, neg_inf, nan};
  std::vector<float> lb = {-1.0f, neg_inf, 2.0f, neg_inf, 0.0f};
  std::vector<float> o(15, 9.0f), lse(5, 9.0f);
  REQUIRE(fa::merge_partials(fa::bhsd<const float>(oa.data(), d), la.data(), fa::bhsd<const float>(ob.data(), d),
                             lb.data(), fa::bhsd(o.data(), d), lse.data())
              .ok());
  const double l0 = std::log(std::exp(0.25) + std::exp(-1.0));
  CHECK(lse[0] == Approx(l0).epsilon(1e-6));
  for (int c = 0; c < 3; ++c)
    CHECK(o[static_cast<std::size_t>(c)] ==
          Approx(std::exp(0.25 - l0) * oa[static_cast<std::size_t>(c)] + std::exp(-1.0 - l0) * ob[static_cast<std::size_t>(c)])
              .margin(1e-6));
  // A part that saw no key contributes nothing, even where its O holds NaN; the other part comes through exactly.
  for (int c = 0; c < 3; ++c) CHECK(o[3 + static_cast<std::size_t>(c)] == oa[3 + static_cast<std::size_t>(c)]);
  CHECK(lse[1] == 1.5f);
  for (int c = 0; c < 3; ++c) CHECK(o[6 + static_cast<std::size_t>(c)] == ob[6 + static_cast<std::size_t>(c)]);
  CHECK(lse[2] == 2.0f);
  for (int c = 0; c < 3; ++c) CHECK(o[9 + static_cast<std::size_t>(c)] == 0.0f);
  CHECK(lse[3] == neg_inf);
  for (int c = 0; c < 3; ++c) CHECK(std::isnan(o[12 + static_cast<std::size_t>(c)]));
  CHECK(std::isnan(lse[4]));
  // A NaN inside a part with finite lse reaches exactly that element.
  oa[1] = nan;
  REQUIRE(fa::merge_partials(fa::bhsd<const float>(oa.data(), d), la.data(), fa::bhsd<const float>(ob.data(), d),
                             lb.data(), fa::bhsd(o.data(), d), lse.data())
              .ok());
  CHECK(std::isnan(o[1]));
  CHECK(!std::isnan(o[0]));
  CHECK(!std::isnan(o[2]));
}

TEST_CASE("merge_partials: in place into o_a, and lse as a strided slice of a longer buffer", "[merge]") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed=" << seed);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), ul(-3.0f, 3.0f);
  const fa::dims4 d{2, 3, 11, 5};
  const index_t total_rows = 17, first = 4;  // lse rows [4, 15) of a [b][h][17] buffer
  std::vector<float> oa(static_cast<std::size_t>(d.b * d.h * d.s * d.d)), ob(oa.size());
  for (auto& x : oa) x = u(rng);
  for (auto& x : ob) x = u(rng);
  std::vector<float> la(static_cast<std::size_t>(d.b * d.h * total_rows)), lb(static_cast<std::size_t>(d.b * d.h * d.s));
  for (auto& x : la) x = ul(rng);
  for (auto& x : lb) x = ul(rng);
  const std::vector<float> oa0 = oa, la0 = la;
  const fa::lse_ref<float> la_rows{la.data() + first, d.b, d.h, d.s, d.h * total_rows, total_rows};
  const auto a = fa::bhsd(oa.data(), d);
  REQUIRE(fa::merge_partials(a, fa::lse_ref<const float>(la_rows), fa::bhsd<const float>(ob.data(), d),
                             fa::lse_bhs<const float>(lb.data(), d), a, la_rows)
              .ok());
  for (index_t bh = 0; bh < d.b * d.h; ++bh)
    for (index_t i = 0; i < total_rows; ++i) {
      const std::size_t li = static_cast<std::size_t>(bh * total_rows + i);
      if (i < first || i >= first + d.s) {
        CHECK(la[li] == la0[li]);  // outside the slice: untouched
        continue;
      }
      const double x = la0[li], y = lb[static_cast<std::size_t>(bh * d.s + i - first)];
      const double l = std::log(std::exp(x) + std::exp(y));
      CHECK(la[li] == Approx(l).epsilon(1e-6));
      for (index_t c = 0; c < d.d; ++c) {
        const std::size_t oi = static_cast<std::size_t>((bh * d.s + i - first) * d.d + c);
        CHECK(oa[oi] == Approx(std::exp(x - l) * oa0[oi] + std::exp(y - l) * ob[oi]).margin(1e-6));
      }
    }
}

TEST_CASE("merge_partials: bad input is refused with the field named and nothing written", "[merge]") {
  const fa::dims4 d{1, 2, 4, 3};
  std::vector<float> oa(24, 0.5f), ob(24, -0.5f), la(8, 0.0f), lb(8, 1.0f), o(24, 7.0f), lse(8, 7.0f);
  const std::vector<float> o0 = o, lse0 = lse;
  const auto ca = fa::bhsd<const float>(oa.data(), d), cb = fa::bhsd<const float>(ob.data(), d);
  auto out = fa::bhsd(o.data(), d);
  auto expect_refused = [&](const fa::status& st, const char* word) {
    INFO(st.what());
    CHECK(st.code() == fa::errc::invalid_argument);
    CHECK(st.message().find(word) != std::string::npos);
    CHECK(unchanged(o, o0));
    CHECK(unchanged(lse, lse0));
  };
  expect_refused(fa::merge_partials(ca, la.data(), cb, lb.data(), out, lse.data(), 0), "threads");
  expect_refused(fa::merge_partials(ca, nullptr, cb, lb.data(), out, lse.data()), "lse_a.data");
  expect_refused(fa::merge_partials(fa::bhsd<const float>(nullptr, d), la.data(), cb, lb.data(), out, lse.data()),
                 "o_a.data");
  expect_refused(fa::merge_partials(ca, la.data(), fa::bhsd<const float>(ob.data(), {1, 2, 3, 3}), lb.data(), out,
                                    lse.data()),
                 "o_b.dims.s");
  auto bad_stride = out;
  bad_stride.stride.d = 2;
  expect_refused(fa::merge_partials(ca, la.data(), cb, lb.data(), bad_stride, lse.data()), "o.stride.d");
  const fa::lse_ref<const float> short_lse{la.data(), 1, 2, 3, 6, 3};
  expect_refused(fa::merge_partials(ca, short_lse, cb, fa::lse_bhs<const float>(lb.data(), d), out,
                                    fa::lse_bhs(lse.data(), d)),
                 "lse_a extents");
}
