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
  SECTION("negative sizes, head_dim 0, heads_kv 0 with heads") {
    for (int field = 0; field < 6; ++field) {
      problem bad = p;
      index_t* fields[] = {&bad.batch, &bad.heads, &bad.heads_kv, &bad.seq_q, &bad.seq_kv, &bad.head_dim};
      *fields[field] = field % 2 ? -1 : -3;
      const char* names[] = {"problem.batch is -3", "problem.heads is -1", "problem.heads_kv is -3",
                             "problem.seq_q is -1", "problem.seq_kv is -3", "problem.head_dim is -1"};
      f.expect_rejected(bad, q, k, v, o, std::string(names[field]) + "; it must be >= 0");
    }
    problem bad = p;
    bad.head_dim = 0;
    f.expect_rejected(bad, q, k, v, o, "problem.head_dim is 0; it must be positive");
    bad = p;
    bad.heads_kv = 0;
    f.expect_rejected(bad, q, k, v, o, "problem.heads_kv is 0; it must be positive when problem.heads (2) is");
  }
  SECTION("a scale printed exactly") {
    problem bad = p;
    bad.scale = -1e-300;
    f.expect_rejected(bad, q, k, v, o, "problem.scale is -1e-300; it must be finite and positive");
    bad.scale = -0.1;
    f.expect_rejected(bad, q, k, v, o, "problem.scale is -0.1;");
    bad.scale = -(1.0 / 3.0);
    f.expect_rejected(bad, q, k, v, o, "problem.scale is -0.3333333333333333;");
  }
  SECTION("sequences beyond 2^48") {
    // Stride-0 views: no memory of that size exists; the lengths alone are refused.
    problem bad = p;
    bad.seq_kv = (index_t(1) << 48) + 1;
    const auto kb = strided<const float>(k.data, bad.kv_dims(), {0, 0, 0, 1});
    f.expect_rejected(bad, q, kb, kb, o, "problem.seq_kv is 281474976710657; the longest supported is 2^48");
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

TEST_CASE("view makers and spans saturate instead of overflowing", "[core][validate]") {
  const index_t big = index_t(1) << 40;
  std::vector<float> buf(4, 1.0f);
  const tensor_ref<float> t = bhsd(buf.data(), dims4{2, big, big, 512});
  CHECK(t.stride.b == INT64_MAX);
  CHECK(t.stride.h == big * 512);
  CHECK(t.stride.s == 512);
  const tensor_ref<float> u = bshd(buf.data(), dims4{2, big, big, 512});
  CHECK(u.stride.b == INT64_MAX);
  CHECK(u.stride.s == big * 512);
  CHECK(u.stride.h == 512);
  CHECK(span_elements(t) == INT64_MAX);
  // A view whose own strides overflow is refused by the operand check, naming it.
  const problem p{2, 3, 3, 4, 4, 8};
  auto qb = bhsd<const float>(buf.data(), p.q_dims());
  qb.stride.h = INT64_MAX;
  std::vector<float> in(2 * 3 * 4 * 8, 0.5f), out(in.size());
  const status st = validate(p, qb, bhsd<const float>(in.data(), p.kv_dims()), bhsd<const float>(in.data(), p.kv_dims()),
                             bhsd(out.data(), p.o_dims()), dense{}, nullptr);
  INFO(st.what());
  CHECK(st.message().find("q: the extents and strides address beyond 2^63 elements") != std::string::npos);
}

TEST_CASE("the overlap check of O is exact: interleaved rows are accepted, shared ones refused", "[core][validate]") {
  // head_dim 2; head 0 at rows 0, 4, 8 and head 1 at rows 6, 10, 14: no element in common.
  const problem p{1, 2, 2, 3, 5, 2};
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  std::vector<float> arena(32, -7.0f);
  const tensor_ref<float> interleaved = strided(arena.data(), p.o_dims(), {0, 6, 4, 1});
  for (int pol_index = 0; pol_index < 2; ++pol_index) {
    const status st = pol_index == 0 ? attend(policy::cpu_naive{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), interleaved)
                                     : attend(policy::cpu<>{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), interleaved);
    INFO(st.what());
    REQUIRE(st.ok());
    REQUIRE(attend(policy::cpu_naive{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view).ok());
    for (index_t h = 0; h < 2; ++h)
      for (index_t i = 0; i < 3; ++i)
        for (index_t d = 0; d < 2; ++d)
          CHECK(interleaved.row(0, h, i)[d] == Approx(c.o.view.row(0, h, i)[d]).margin(1e-6));
  }
  // Head 1 at rows 5, 9, 13: row 5 holds elements 5 and 6, row 4 holds 4 and 5.
  bad_input_fixture f;
  const problem fp = f.p;  // (1, 2, 2, 5, 6, 8)
  auto shared = f.c.o.view;
  shared.stride = {0, 36, 8, 1};  // head 1's row 0 at 36: inside head 0's row 4 (32..39)
  f.expect_rejected(fp, f.c.q.cview(), f.c.k.cview(), f.c.v.cview(), shared, "o: its strides make distinct rows share memory");
  auto apart = f.c.o.view;
  apart.stride = {0, 12, 24, 1};  // rows of 8 at 0, 24, 48, ... and 12, 36, 60, ...: interleaved, 12 apart
  std::vector<float> big_o(200, 0.0f);
  apart.data = big_o.data();
  CHECK(validate(fp, f.c.q.cview(), f.c.k.cview(), f.c.v.cview(), apart, dense{}, nullptr).ok());
  // Irregular strides over too many rows to search exactly are refused with that reason.
  const problem huge{3000, 3000, 3000, 3000, 1, 1};
  std::vector<float> one(4, 1.0f), outs(16, 0.0f);
  const auto in_q = strided<const float>(one.data(), huge.q_dims(), {0, 0, 0, 1});
  const auto in_kv = strided<const float>(one.data(), huge.kv_dims(), {0, 0, 0, 1});
  const auto o_irregular = strided(outs.data(), huge.o_dims(), {1, 1, 1, 1});
  const status st = validate(huge, in_q, in_kv, in_kv, o_irregular, dense{}, nullptr);
  INFO(st.what());
  CHECK(st.code() == errc::invalid_argument);
  CHECK(st.message().find("too many to prove exactly") != std::string::npos);
}

TEST_CASE("block sizes near INT64_MAX: one block, full attention, no read out of bounds", "[core][block_sparse]") {
  const problem p{1, 2, 1, 9, 13, 8};
  for (const block_geometry& g : {block_geometry{9, 13, INT64_MAX, 4, 1, 1}, block_geometry{9, 13, 3, INT64_MAX, 1, 1},
                                  block_geometry{9, 13, INT64_MAX, INT64_MAX, 1, 1},
                                  block_geometry{9, 13, INT64_MAX - 5, INT64_MAX - 7, 1, 1}}) {
    CAPTURE(g.block_q, g.block_kv);
    const block_layout l = dense_layout(g);
    CHECK(g.n_q_blocks() >= 1);
    CHECK(g.n_kv_blocks() >= 1);
    REQUIRE(l.active_blocks() == g.n_q_blocks() * g.n_kv_blocks());
    check_against_oracle<float>(policy::cpu_naive{1}, p, layout::bhsd, any_mask{block_sparse{l}});
    check_against_oracle<float>(policy::cpu<>{2}, p, layout::bshd, any_mask{block_sparse{l, causal{}}});
    check_against_oracle<float>(policy::cpu_scalar{1}, p, layout::padded, any_mask{block_sparse{l}});
  }
  // Pattern counts whose product overflows are refused, naming the fields.
  block_layout_view v = dense_layout(block_geometry{9, 13, 4, 4, 1, 1}).view();
  v.geometry.batch = INT64_MAX;
  v.geometry.heads = 2;
  const status st = detail::check_layout(v);
  INFO(st.what());
  CHECK(st.message().find("block_sparse.layout.batch x heads x q-block rows") != std::string::npos);
}

TEST_CASE("layout_from_block_mask with a mask of the wrong size says so", "[core][block_sparse]") {
  const problem p{1, 1, 1, 9, 13, 8};
  const block_geometry g{9, 13, 4, 4, 1, 1};  // 3 x 4 blocks
  const block_layout bad = layout_from_block_mask(g, std::vector<bool>(11, true));
  CHECK(bad.build_error() == "layout_from_block_mask: the block mask has 11 entries but 1 pattern(s) x 3 q-block "
                             "rows x 4 kv-block columns need 12");
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  const status st = attend(policy::cpu_naive{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, block_sparse{bad});
  INFO(st.what());
  CHECK(st.code() == errc::invalid_argument);
  CHECK(st.message().find("block_sparse.layout: layout_from_block_mask: the block mask has 11 entries") !=
        std::string::npos);
  const block_layout good = layout_from_block_mask(g, std::vector<bool>(12, true));
  CHECK(good.build_error().empty());
  CHECK(attend(policy::cpu_naive{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, block_sparse{good}).ok());
}
