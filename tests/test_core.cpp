// The core API: mask rules, problem helpers, and every invalid input rejected with a message that names the
// field, and with nothing written to O or lse.
#include <cmath>
#include <limits>

#include "support/check.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;

TEST_CASE("mask rules match their definitions", "[core][mask]") {
  const index_t sizes[][2] = {{7, 7}, {5, 9}, {9, 5}, {1, 6}};
  for (const auto& sz : sizes) {
    const problem p{1, 1, 1, sz[0], sz[1], 4};
    const index_t off = p.seq_kv - p.seq_q;
    const band_mask d = bind(dense{}, p), ctl = bind(causal{}, p), cbr = bind(causal{align::bottom_right}, p);
    const band_mask w = bind(window{2, 1}, p), wbr = bind(window{2, 1, align::bottom_right}, p);
    for (index_t i = 0; i < p.seq_q; ++i)
      for (index_t j = 0; j < p.seq_kv; ++j) {
        CAPTURE(sz[0], sz[1], i, j);
        CHECK(d.allowed(i, j));
        CHECK(ctl.allowed(i, j) == (j <= i));
        CHECK(cbr.allowed(i, j) == (j <= i + off));
        CHECK(w.allowed(i, j) == (j >= i - 2 && j <= i + 1));
        CHECK(wbr.allowed(i, j) == (j >= i + off - 2 && j <= i + off + 1));
      }
  }
}

TEST_CASE("band kv_range and is_partial agree with allowed()", "[core][mask]") {
  const problem p{1, 1, 1, 37, 53, 4};
  const band_mask masks[] = {bind(dense{}, p), bind(causal{}, p), bind(causal{align::bottom_right}, p),
                             bind(window{6, 2}, p), bind(window{0, 0, align::bottom_right}, p)};
  for (const auto& m : masks)
    for (index_t q0 = 0; q0 < p.seq_q; q0 += 8)
      for (index_t k0 = 0; k0 < p.seq_kv + 8; k0 += 8) {
        const index_t q1 = std::min(q0 + 8, p.seq_q), k1 = k0 + 8;
        bool any = false, all = true;
        for (index_t i = q0; i < q1; ++i)
          for (index_t j = k0; j < k1; ++j) {
            const bool a = m.allowed(i, j);
            any |= a;
            all &= a;
          }
        const kv_span r = m.kv_range(q0, q1);
        CAPTURE(m.lo, m.hi, q0, k0);
        if (any) CHECK((r.begin < k1 && k0 < r.end));  // a tile with allowed entries is visited
        CHECK(m.is_partial(q0, q1, k0, k1) == !all);
      }
}

TEST_CASE("problem helpers", "[core]") {
  problem p{2, 8, 2, 10, 20, 64};
  CHECK(p.softmax_scale() == Approx(0.125));
  CHECK(p.group_size() == 4);
  CHECK(p.kv_head(7) == 1);
  p.scale = 0.5;
  CHECK(p.softmax_scale() == 0.5);
}

namespace {
/// One valid call with buffers, which each test section breaks in one way.
struct bad_input_fixture {
  problem p{1, 2, 2, 5, 6, 8};
  std::mt19937_64 rng{fresh_seed()};
  attention_case<float> c{p, layout::bhsd, rng};
  std::vector<float> lse = std::vector<float>(static_cast<std::size_t>(p.lse_size()), 5.0f);
  std::vector<float> o_before = c.o.buf;
  std::vector<float> lse_before = lse;

  template <class Mask = dense>
  void expect_rejected(const problem& pr, tensor_ref<const float> q, tensor_ref<const float> k,
                       tensor_ref<const float> v, tensor_ref<float> o, const std::string& fragment,
                       const Mask& mask = {}, float* lse_ptr = nullptr) {
    const status st = attend(policy::cpu_naive{1}, pr, q, k, v, o, mask, lse_ptr ? lse_ptr : lse.data());
    INFO(st.what());
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find(fragment) != std::string::npos);
    CHECK(unchanged(c.o.buf, o_before));
    CHECK(unchanged(lse, lse_before));
  }
};
}  // namespace

TEST_CASE("invalid inputs are rejected with a reason and nothing written", "[core][validate]") {
  bad_input_fixture f;
  auto q = f.c.q.cview(), k = f.c.k.cview(), v = f.c.v.cview();
  auto o = f.c.o.view;
  const problem p = f.p;

  SECTION("null pointers") {
    auto qn = q;
    qn.data = nullptr;
    f.expect_rejected(p, qn, k, v, o, "q.data is null");
    auto on = o;
    on.data = nullptr;
    f.expect_rejected(p, q, k, v, on, "o.data is null");
  }
  SECTION("non-positive sizes") {
    for (int field = 0; field < 6; ++field) {
      problem bad = p;
      index_t* fields[] = {&bad.batch, &bad.heads, &bad.heads_kv, &bad.seq_q, &bad.seq_kv, &bad.head_dim};
      *fields[field] = field % 2 ? 0 : -3;
      const char* names[] = {"problem.batch", "problem.heads", "problem.heads_kv",
                             "problem.seq_q", "problem.seq_kv", "problem.head_dim"};
      f.expect_rejected(bad, q, k, v, o, names[field]);
    }
  }
  SECTION("heads not a multiple of heads_kv") {
    problem bad = p;
    bad.heads_kv = 3;
    f.expect_rejected(bad, q, k, v, o, "not a multiple of problem.heads_kv (3)");
  }
  SECTION("shape mismatch between q, k, v, o and the problem") {
    auto kb = k;
    kb.dims.s = 7;
    f.expect_rejected(p, q, kb, v, o, "k.dims.s is 7");
    auto vb = v;
    vb.dims.d = 4;
    f.expect_rejected(p, q, k, vb, o, "v.dims.d is 4");
    auto ob = o;
    ob.dims.h = 1;
    f.expect_rejected(p, q, k, v, ob, "o.dims.h is 1");
  }
  SECTION("non-unit head_dim stride") {
    auto qb = q;
    qb.stride.d = 2;
    f.expect_rejected(p, qb, k, v, o, "q.stride.d is 2");
  }
  SECTION("negative stride") {
    auto kb = k;
    kb.stride.s = -8;
    f.expect_rejected(p, q, kb, v, o, "k.stride.s is -8");
  }
  SECTION("head_dim above the maximum") {
    problem bad = p;
    bad.head_dim = max_head_dim + 1;
    f.expect_rejected(bad, q, k, v, o, "problem.head_dim is " + std::to_string(max_head_dim + 1));
  }
  SECTION("scale not finite or not positive") {
    for (double s : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
      problem bad = p;
      bad.scale = s;
      f.expect_rejected(bad, q, k, v, o, "problem.scale");
    }
  }
  SECTION("negative window") {
    f.expect_rejected(p, q, k, v, o, "window.left is -1", window{-1, 2});
    f.expect_rejected(p, q, k, v, o, "window.right is -2", window{1, -2});
  }
  SECTION("output aliasing an input") {
    auto q_as_o = o;
    q_as_o.data = const_cast<float*>(q.data);
    f.expect_rejected(p, q, k, v, q_as_o, "o overlaps q");
  }
  SECTION("output rows overlapping each other") {
    auto ob = o;
    ob.stride.s = 4;  // rows of 8 elements, 4 apart
    f.expect_rejected(p, q, k, v, ob, "share memory");
  }
  SECTION("lse overlapping the output") {
    f.expect_rejected(p, q, k, v, o, "lse overlaps o", dense{}, o.data);
  }
  SECTION("sizes whose element count overflows") {
    problem bad = p;
    bad.seq_q = index_t(1) << 40;
    bad.batch = index_t(1) << 20;
    f.expect_rejected(bad, q, k, v, o, "overflows");
  }
}

TEST_CASE("policy errors", "[core][validate]") {
  bad_input_fixture f;
  const status st = attend(policy::cpu_naive{0}, f.p, f.c.q.cview(), f.c.k.cview(), f.c.v.cview(), f.c.o.view);
  CHECK(st.code() == errc::invalid_argument);
  CHECK(st.message().find("policy.threads is 0") != std::string::npos);
  CHECK(unchanged(f.c.o.buf, f.o_before));
#if !FUSEDATTN_WITH_CUDA
  const status cu = attend(policy::cuda{}, f.p, f.c.q.cview(), f.c.k.cview(), f.c.v.cview(), f.c.o.view);
  CHECK(cu.code() == errc::unsupported);
  CHECK(cu.message().find("without CUDA") != std::string::npos);
#endif
}

TEST_CASE("a fully masked row gives O = 0 and lse = -inf", "[core][mask]") {
  // bottom-right causal with seq_q > seq_kv: the first seq_q - seq_kv rows see no key.
  const problem p{1, 1, 1, 6, 2, 4};
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  std::vector<float> lse(6);
  REQUIRE(attend(policy::cpu_naive{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view,
                 causal{align::bottom_right}, lse.data())
              .ok());
  for (index_t i = 0; i < 4; ++i) {
    CHECK(lse[static_cast<std::size_t>(i)] == -std::numeric_limits<float>::infinity());
    for (index_t d = 0; d < 4; ++d) CHECK(c.o.view.row(0, 0, i)[d] == 0.0f);
  }
  for (index_t i = 4; i < 6; ++i) CHECK(std::isfinite(lse[static_cast<std::size_t>(i)]));
}

TEST_CASE("lse of Q = K = V = 0 is log(number of keys)", "[core]") {
  const problem p{1, 1, 1, 3, 10, 4};
  std::vector<float> z(40, 0.0f), o(12, 1.0f), lse(3);
  REQUIRE(attend(policy::cpu_naive{1}, p, bhsd<const float>(z.data(), p.q_dims()), bhsd<const float>(z.data(), p.kv_dims()),
                 bhsd<const float>(z.data(), p.kv_dims()), bhsd(o.data(), p.o_dims()), window{2, 0}, lse.data())
              .ok());
  CHECK(lse[0] == Approx(std::log(1.0)).margin(1e-7));
  CHECK(lse[1] == Approx(std::log(2.0)));
  CHECK(lse[2] == Approx(std::log(3.0)));
}
