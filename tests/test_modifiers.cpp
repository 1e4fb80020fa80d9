// Score modifiers (softcap, ALiBi, attention sinks) on every CPU kernel (flash tile loop, decode kernel, naive
// pipeline, serving entry points) against the float64 oracle, each alone and all three together, with every mask;
// their bad values refused with nothing written; the NaN contract with modifiers on.
#include <cstring>

#include "support/check.hpp"
#include "support/oracle_backward.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;

namespace {

/// Which modifiers a case turns on, and their values (fresh random per case).
struct mod_set {
  bool cap = false;
  bool alibi = false;
  align alibi_align = align::top_left;
  bool sink = false;
  std::string name() const {
    std::string n;
    if (cap) n += "softcap ";
    if (alibi) n += alibi_align == align::top_left ? "alibi " : "alibi_br ";
    if (sink) n += "sinks";
    return n;
  }
};

/// Every single modifier and all three together.
std::vector<mod_set> all_mod_sets() {
  return {{true, false, align::top_left, false},  {false, true, align::top_left, false},
          {false, true, align::bottom_right, false}, {false, false, align::top_left, true},
          {true, true, align::bottom_right, true},   {true, true, align::top_left, true}};
}

/// The per-head values of one case: ALiBi slopes in [0.01, 0.3], sink logits in [−2, 3], a cap in [0.5, 3].
struct mod_values {
  std::vector<float> slopes, logits;
  float cap = 0;
  mod_values(index_t heads, std::mt19937_64& rng) {
    std::uniform_real_distribution<float> slope(0.01f, 0.3f), logit(-2.0f, 3.0f), cap_u(0.5f, 3.0f);
    for (index_t h = 0; h < heads; ++h) {
      slopes.push_back(slope(rng));
      logits.push_back(logit(rng));
    }
    cap = cap_u(rng);
  }
};

template <class Mask>
modified<Mask> with_mods(const Mask& mask, const mod_set& ms, const mod_values& mv) {
  modified<Mask> r{mask, {}};
  if (ms.cap) r = r | softcap{mv.cap};
  if (ms.alibi) r = r | alibi{mv.slopes.data(), ms.alibi_align};
  if (ms.sink) r = r | sinks{mv.logits.data()};
  return r;
}

/// Runs `pol` with the modifiers on a fresh case (Q and K in [−2, 2] so that softcap bites) and checks O and lse
/// against the float64 oracle.
template <class T, class Policy>
void check_modified(const Policy& pol, const problem& p, layout l, const any_mask& mask, const mod_set& ms) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  attention_case<T> c(p, l, rng);
  c.q.fill(rng, -2.0, 2.0);
  c.k.fill(rng, -2.0, 2.0);
  const mod_values mv(p.heads, rng);
  INFO(scalar_name<T>() << " " << describe(p) << " " << describe(mask) << " " << ms.name() << " cap " << mv.cap
                        << " " << layout_name(l) << " seed=" << seed);
  const modified<any_mask> mm = with_mods(mask, ms, mv);
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()), 123.0f);
  const status st = attend(pol, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mm, lse.data());
  INFO(st.what());
  REQUIRE(st.ok());
  expected e = std::visit(
      [&](const auto& m) { return expect(c, bind(modified<std::decay_t<decltype(m)>>{m, mm.mods}, p)); }, mask);
  // ALiBi makes logits as large as slope·(seq_q + seq_kv); exp of a logit t carries |t|·ε of relative rounding,
  // which the plain same-precision implementation (the oracle's own arithmetic in double) does not show.
  if (ms.alibi) {
    const double big = *std::max_element(mv.slopes.begin(), mv.slopes.end()) * double(p.seq_q + p.seq_kv);
    e.tolerance = std::max(e.tolerance, 8.0 * big * epsilon<T>());
  }
  check_outputs(c, e, lse);
}

/// Shapes with tails, GQA / MQA, seq_q ≠ seq_kv both ways (rows without keys under bottom-right causal).
std::vector<problem> mod_shapes() {
  return {{1, 1, 1, 1, 1, 1},    {1, 1, 1, 7, 7, 3},     {2, 3, 3, 127, 127, 64}, {1, 4, 2, 130, 129, 80},
          {1, 2, 2, 7, 300, 128}, {1, 1, 1, 300, 7, 32}, {1, 4, 1, 33, 65, 64}};
}

template <class F>
void for_each_cpu_policy(F&& f) {
  f(policy::cpu<>{1});
  f(policy::cpu<scalar_arch>{1});
  f(policy::cpu_naive{1});
}

}  // namespace

#if !FUSEDATTN_TEST_SUBSET  // [heavy]: not compiled in CI's sanitizer stage
TEMPLATE_TEST_CASE("modifiers: flash, scalar and naive match the float64 oracle, every mask", "[modifiers][heavy]",
                   float, double) {
  for (const mod_set& ms : all_mod_sets())
    for (const problem& p : mod_shapes())
      for (const any_mask& mask : all_masks())
        for_each_cpu_policy([&](const auto& pol) { check_modified<TestType>(pol, p, layout::bhsd, mask, ms); });
}
#endif

TEST_CASE("modifiers: half types and strided layouts", "[modifiers]") {
  const problem p{2, 4, 2, 70, 90, 64};
  for (const mod_set& ms : all_mod_sets())
    for (const layout l : {layout::bshd, layout::padded}) {
      check_modified<Eigen::half>(policy::cpu<>{2}, p, l, causal{align::bottom_right}, ms);
      check_modified<Eigen::bfloat16>(policy::cpu<>{2}, p, l, window{20, 5}, ms);
    }
}

TEST_CASE("modifiers: block-sparse layouts, per-head patterns", "[modifiers]") {
  const problem p{1, 2, 1, 300, 260, 32};
  const block_geometry g{p.seq_q, p.seq_kv, 64, 48, 1, 2};
  const block_layout layout_ = random_layout(g, 0.5, fresh_seed(), {1, 0, 0, 0});
  for (const mod_set& ms : all_mod_sets())
    for (const any_mask& mask : {any_mask{block_sparse{layout_}}, any_mask{block_sparse{layout_, causal{}}}})
      for_each_cpu_policy([&](const auto& pol) { check_modified<float>(pol, p, layout::bhsd, mask, ms); });
}

TEST_CASE("modifiers: the decode kernel and the tile loop's key split", "[modifiers]") {
  // Decode-shaped (one query row, GQA groups of 4: the decode kernel, its keys split in chunks) and the tile loop
  // with an explicit key split (the merge of chunk parts, where the sink joins once).
  const problem decode{2, 8, 2, 1, 5000, 64};
  const problem spec{1, 4, 1, 3, 700, 32};
  for (const mod_set& ms : all_mod_sets()) {
    check_modified<float>(policy::cpu<>{2}, decode, layout::bhsd, causal{align::bottom_right}, ms);
    check_modified<float>(policy::cpu<>{2}, spec, layout::bhsd, window{300, 0, align::bottom_right}, ms);
    check_modified<float>(policy::cpu<>{2, {8, 64, 4}}, spec, layout::bhsd, dense{}, ms);
    check_modified<float>(policy::cpu<>{2, {8, 64, 4}}, spec, layout::bhsd, causal{align::bottom_right}, ms);
  }
}

TEST_CASE("modifiers: the thread count never changes a bit", "[modifiers]") {
  const problem p{2, 4, 2, 150, 170, 48};
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  const mod_values mv(p.heads, rng);
  const auto mask = with_mods(causal{align::bottom_right}, {true, true, align::bottom_right, true}, mv);
  std::vector<float> lse1(static_cast<std::size_t>(p.lse_size())), lse2(lse1.size());
  REQUIRE(attend(policy::cpu<>{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse1.data()).ok());
  const std::vector<float> o1 = c.o.buf;
  REQUIRE(attend(policy::cpu<>{2}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse2.data()).ok());
  CHECK(std::memcmp(o1.data(), c.o.buf.data(), o1.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(lse1.data(), lse2.data(), lse1.size() * sizeof(float)) == 0);
}

TEST_CASE("modifiers: sinks give lse = sink and O = 0 for rows without keys, and for seq_kv = 0", "[modifiers]") {
  std::mt19937_64 rng(fresh_seed());
  for (const index_t seq_kv : {index_t(0), index_t(5)}) {
    const problem p{1, 3, 1, 9, seq_kv, 16};  // bottom-right causal: rows 0-3 see no key when seq_kv = 5
    attention_case<float> c(p, layout::bhsd, rng);
    const mod_values mv(p.heads, rng);
    const auto mask = causal{align::bottom_right} | sinks{mv.logits.data()};
    const auto run_all = [&](const auto& pol) {
      c.o.fill(rng, 7.0, 9.0);
      std::vector<float> lse(static_cast<std::size_t>(p.lse_size()), 123.0f);
      REQUIRE(attend(pol, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse.data()).ok());
      for (index_t h = 0; h < p.heads; ++h)
        for (index_t i = 0; i < p.seq_q - seq_kv; ++i) {
          CAPTURE(seq_kv, h, i);
          CHECK(lse[static_cast<std::size_t>(h * p.seq_q + i)] ==
                Approx(mv.logits[static_cast<std::size_t>(h)]).margin(1e-6));
          for (index_t x = 0; x < p.head_dim; ++x) CHECK(c.o.view.row(0, h, i)[x] == 0.0f);
        }
    };
    run_all(policy::cpu<>{1});
    run_all(policy::cpu_naive{1});
  }
}

TEST_CASE("modifiers: a sink logit far above every score leaves O near 0, far below changes nothing", "[modifiers]") {
  const problem p{1, 2, 2, 20, 30, 16};
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  std::vector<float> plain_lse(static_cast<std::size_t>(p.lse_size())), lse(plain_lse.size());
  REQUIRE(attend(policy::cpu<>{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, dense{}, plain_lse.data()).ok());
  const std::vector<float> plain_o = c.o.buf;
  const std::vector<float> low{-200.0f, -200.0f}, high{60.0f, 60.0f};
  REQUIRE(attend(policy::cpu<>{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, dense{} | sinks{low.data()},
                 lse.data()).ok());
  for (std::size_t x = 0; x < plain_o.size(); ++x) CHECK(c.o.buf[x] == Approx(plain_o[x]).margin(1e-6));
  for (std::size_t x = 0; x < lse.size(); ++x) CHECK(lse[x] == Approx(plain_lse[x]).margin(1e-5));
  REQUIRE(attend(policy::cpu<>{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, dense{} | sinks{high.data()},
                 lse.data()).ok());
  for (const float x : c.o.buf) CHECK(std::abs(x) < 1e-20f);
  for (const float x : lse) CHECK(x == Approx(60.0f).margin(1e-5));
}

TEST_CASE("modifiers: bad values are refused naming the field, nothing written", "[modifiers]") {
  const problem p{1, 2, 1, 9, 11, 8};
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  const std::vector<float> before = c.o.buf;
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()), 5.0f);
  const std::vector<float> lse_before = lse;
  const auto refused = [&](const auto& pol, const auto& mask, const char* field) {
    const status st = attend(pol, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse.data());
    INFO(st.what());
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find(field) != std::string::npos);
    CHECK(plan(pol, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse.data()).st.code() ==
          errc::invalid_argument);
    CHECK(c.o.buf == before);
    CHECK(lse == lse_before);
  };
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const auto each = [&](const auto& pol) {
    for (const float cap : {0.0f, -1.0f, nan, inf, 1e-40f}) {
      CAPTURE(cap);
      refused(pol, causal{} | softcap{cap}, "softcap.cap");
      refused(pol, any_mask{window{3, 1}} | softcap{cap}, "softcap.cap");
    }
    refused(pol, dense{} | alibi{nullptr}, "alibi.slopes");
    refused(pol, dense{} | sinks{nullptr}, "sinks.logits");
    refused(pol, dense{} | softcap{30.f} | sinks{nullptr}, "sinks.logits");
  };
  each(policy::cpu<>{1});
  each(policy::cpu_naive{1});
}

TEST_CASE("modifiers: the NaN contract holds with every modifier on", "[modifiers]") {
  // A NaN in Q row r reaches only row r's O and lse; a NaN in the K row of a key a row cannot see never reaches it;
  // an infinite V row reaches only the rows that see its key.
  const problem p{1, 2, 1, 40, 40, 16};
  std::mt19937_64 rng(fresh_seed());
  const mod_values mv(p.heads, rng);
  for (const bool naive : {false, true}) {
    attention_case<float> c(p, layout::bhsd, rng);
    const index_t nan_q = 7, nan_k = 30;
    c.q.view.row(0, 1, nan_q)[3] = std::numeric_limits<float>::quiet_NaN();
    c.k.view.row(0, 0, nan_k)[2] = std::numeric_limits<float>::quiet_NaN();
    const auto mask = with_mods(causal{}, {true, true, align::top_left, true}, mv);
    std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
    const status st = naive ? attend(policy::cpu_naive{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask,
                                     lse.data())
                            : attend(policy::cpu<>{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask,
                                     lse.data());
    REQUIRE(st.ok());
    for (index_t h = 0; h < p.heads; ++h)
      for (index_t i = 0; i < p.seq_q; ++i) {
        const bool should_nan = (h == 1 && i == nan_q) || i >= nan_k;
        CAPTURE(naive, h, i);
        CHECK(std::isnan(lse[static_cast<std::size_t>(h * p.seq_q + i)]) == should_nan);
        bool any_nan = false;
        for (index_t x = 0; x < p.head_dim; ++x) any_nan |= std::isnan(c.o.view.row(0, h, i)[x]);
        CHECK(any_nan == should_nan);
      }
  }
}

namespace {

/// Checks rows [0, n) of one sequence's O (bhsd, heads × n × d at `o`) and lse (heads rows of stride `lse_stride`
/// from `lse`) against the float64 oracle of that sequence alone, and against a contiguous attend call with the same
/// policy bitwise.
template <class Policy, class Mask>
void check_sequence(const Policy& pol, const problem& ps, const std::vector<float>& q, const std::vector<float>& k,
                    const std::vector<float>& v, const float* o, const float* lse, index_t lse_stride,
                    const Mask& mask) {
  const tensor_ref<const float> qv = bhsd<const float>(q.data(), ps.q_dims()), kv = bhsd<const float>(k.data(), ps.kv_dims()),
                                vv = bhsd<const float>(v.data(), ps.kv_dims());
  std::vector<float> o1(q.size(), 5.0f), l1(static_cast<std::size_t>(ps.lse_size()));
  REQUIRE(attend(pol, ps, qv, kv, vv, bhsd(o1.data(), ps.o_dims()), mask, l1.data()).ok());
  CHECK(std::memcmp(o1.data(), o, o1.size() * sizeof(float)) == 0);
  for (index_t h = 0; h < ps.heads; ++h)
    for (index_t i = 0; i < ps.seq_q; ++i)
      CHECK(lse[h * lse_stride + i] == l1[static_cast<std::size_t>(h * ps.seq_q + i)]);
  const band_mask bound = bind(mask, ps);
  const reference ref = reference_attention<double>(ps, qv, kv, vv, bound);
  double err = 0;
  for (std::size_t x = 0; x < ref.o.size(); ++x) err = std::max(err, std::abs(double(o[x]) - ref.o[x]));
  INFO("error " << err);
  CHECK(err <= 2e-5);
  for (index_t h = 0; h < ps.heads; ++h)
    for (index_t i = 0; i < ps.seq_q; ++i) {
      const double r = ref.lse[static_cast<std::size_t>(h * ps.seq_q + i)];
      const float got = lse[h * lse_stride + i];
      if (std::isinf(r)) CHECK(got == r);
      else CHECK(std::abs(got - r) <= 1e-4 * std::max(1.0, std::abs(r)));
    }
}

std::vector<float> random_values(index_t n, std::mt19937_64& rng, double lo = -1.0, double hi = 1.0) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<float> x(static_cast<std::size_t>(n));
  for (auto& e : x) e = static_cast<float>(u(rng));
  return x;
}

}  // namespace

TEST_CASE("modifiers: attend_paged (decode kernel and tile loop) matches the oracle per sequence", "[modifiers]") {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const std::vector<std::int32_t> lens = {77, 0, 300, 1500, 5};
  const index_t page = 16, heads = 8, heads_kv = 2, d = 40;
  index_t longest = 0;
  for (auto x : lens) longest = std::max<index_t>(longest, x);
  const index_t blocks = (longest + page - 1) / page, batch = static_cast<index_t>(lens.size());
  const index_t pages = batch * blocks;
  // Page ids in reverse order, so that a sequence's pages are not adjacent in the pool (hnd layout).
  std::vector<std::int32_t> table(static_cast<std::size_t>(pages));
  for (index_t x = 0; x < pages; ++x) table[static_cast<std::size_t>(x)] = static_cast<std::int32_t>(pages - 1 - x);
  std::vector<float> k_pool(static_cast<std::size_t>(pages * page * heads_kv * d)), v_pool(k_pool.size());
  std::vector<std::vector<float>> ks, vs;
  for (index_t b = 0; b < batch; ++b) {
    const index_t len = lens[static_cast<std::size_t>(b)];
    ks.push_back(random_values(heads_kv * len * d, rng, -2.0, 2.0));
    vs.push_back(random_values(heads_kv * len * d, rng));
    for (index_t h = 0; h < heads_kv; ++h)
      for (index_t j = 0; j < len; ++j)
        for (index_t c = 0; c < d; ++c) {
          const index_t at =
              ((table[static_cast<std::size_t>(b * blocks + j / page)] * heads_kv + h) * page + j % page) * d + c;
          const auto from = static_cast<std::size_t>((h * len + j) * d + c);
          k_pool[static_cast<std::size_t>(at)] = ks.back()[from];
          v_pool[static_cast<std::size_t>(at)] = vs.back()[from];
        }
  }
  const mod_values mv(heads, rng);
  for (const index_t seq_q : {index_t(1), index_t(3), index_t(20)})
    for (const mod_set& ms : all_mod_sets()) {
      CAPTURE(seq_q, ms.name());
      const problem p{batch, heads, heads_kv, seq_q, longest, d};
      const std::vector<float> q = random_values(p.batch * p.heads * seq_q * d, rng, -2.0, 2.0);
      std::vector<float> o(q.size(), 7.0f), lse(static_cast<std::size_t>(p.lse_size()), 123.0f);
      const auto mask = with_mods(causal{align::bottom_right}, ms, mv);
      const auto cache = paged<const float>(k_pool.data(), v_pool.data(), pages, page, heads_kv, d, page_layout::hnd,
                                            table.data(), blocks, lens.data());
      const status st =
          attend_paged(policy::cpu<>{2}, p, bhsd<const float>(q.data(), p.q_dims()), cache, bhsd(o.data(), p.o_dims()),
                       mask, lse.data());
      INFO(st.what());
      REQUIRE(st.ok());
      const index_t rows = heads * seq_q * d;
      for (index_t b = 0; b < batch; ++b) {
        const index_t len = lens[static_cast<std::size_t>(b)];
        CAPTURE(b, len);
        if (len == 0) {
          for (index_t h = 0; h < heads; ++h)
            for (index_t i = 0; i < seq_q; ++i)
              CHECK(lse[static_cast<std::size_t>((b * heads + h) * seq_q + i)] ==
                    (ms.sink ? Approx(mv.logits[static_cast<std::size_t>(h)]).margin(1e-6)
                             : Approx(-std::numeric_limits<float>::infinity())));
          continue;
        }
        problem ps = p;
        ps.batch = 1;
        ps.seq_kv = len;
        const std::vector<float> qb(q.begin() + b * rows, q.begin() + (b + 1) * rows);
        check_sequence(policy::cpu<>{1}, ps, qb, ks[static_cast<std::size_t>(b)], vs[static_cast<std::size_t>(b)], o.data() + b * rows,
                       lse.data() + b * heads * seq_q, seq_q, mask);
      }
    }
}

TEST_CASE("modifiers: attend_ragged (decode and prefill paths, flash and naive) matches the oracle per sequence",
          "[modifiers]") {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const index_t heads = 4, heads_kv = 2, d = 24;
  const std::vector<std::int32_t> kv_lens = {50, 0, 333, 9};
  const mod_values mv(heads, rng);
  for (const bool decode : {true, false})
    for (const mod_set& ms : all_mod_sets()) {
      const std::vector<std::int32_t> q_lens = decode ? std::vector<std::int32_t>{1, 1, 1, 1}
                                                      : std::vector<std::int32_t>{20, 3, 70, 9};
      std::vector<std::int32_t> cu_q{0}, cu_kv{0};
      for (std::size_t b = 0; b < kv_lens.size(); ++b) {
        cu_q.push_back(cu_q.back() + q_lens[b]);
        cu_kv.push_back(cu_kv.back() + kv_lens[b]);
      }
      const problem p{1, heads, heads_kv, cu_q.back(), cu_kv.back(), d};
      // [token][head][d] buffers.
      const std::vector<float> q = random_values(p.seq_q * heads * d, rng, -2.0, 2.0),
                               k = random_values(p.seq_kv * heads_kv * d, rng, -2.0, 2.0),
                               v = random_values(p.seq_kv * heads_kv * d, rng);
      const auto mask = with_mods(causal{align::bottom_right}, ms, mv);
      const auto run_policy = [&](const auto& pol) {
        CAPTURE(decode, ms.name());
        std::vector<float> o(q.size(), 7.0f), lse(static_cast<std::size_t>(heads * p.seq_q), 123.0f);
        const status st = attend_ragged(pol, p, ragged_batch{4, cu_q.data(), cu_kv.data()},
                                        bshd<const float>(q.data(), p.q_dims()), bshd<const float>(k.data(), p.kv_dims()),
                                        bshd<const float>(v.data(), p.kv_dims()), bshd(o.data(), p.o_dims()), mask,
                                        lse.data());
        INFO(st.what());
        REQUIRE(st.ok());
        for (std::size_t b = 0; b < kv_lens.size(); ++b) {
          const index_t nq = q_lens[b], nk = kv_lens[b];
          CAPTURE(b);
          problem ps{1, heads, heads_kv, nq, nk, d};
          // The sequence's rows in bhsd order, for the per-sequence call and the oracle.
          std::vector<float> qs(static_cast<std::size_t>(heads * nq * d)), os(qs.size()),
              ksq(static_cast<std::size_t>(heads_kv * nk * d)), vsq(ksq.size());
          for (index_t h = 0; h < heads; ++h)
            for (index_t i = 0; i < nq; ++i)
              for (index_t c = 0; c < d; ++c) {
                const auto from = static_cast<std::size_t>(((cu_q[b] + i) * heads + h) * d + c);
                qs[static_cast<std::size_t>((h * nq + i) * d + c)] = q[from];
                os[static_cast<std::size_t>((h * nq + i) * d + c)] = o[from];
              }
          for (index_t h = 0; h < heads_kv; ++h)
            for (index_t j = 0; j < nk; ++j)
              for (index_t c = 0; c < d; ++c) {
                const auto from = static_cast<std::size_t>(((cu_kv[b] + j) * heads_kv + h) * d + c);
                ksq[static_cast<std::size_t>((h * nk + j) * d + c)] = k[from];
                vsq[static_cast<std::size_t>((h * nk + j) * d + c)] = v[from];
              }
          if (nk == 0) {
            for (index_t h = 0; h < heads; ++h)
              for (index_t i = 0; i < nq; ++i)
                CHECK(lse[static_cast<std::size_t>(h * p.seq_q + cu_q[b] + i)] ==
                      (ms.sink ? Approx(mv.logits[static_cast<std::size_t>(h)]).margin(1e-6)
                             : Approx(-std::numeric_limits<float>::infinity())));
            continue;
          }
          check_sequence(pol, ps, qs, ksq, vsq, os.data(), lse.data() + cu_q[b], p.seq_q, mask);
        }
      };
      run_policy(policy::cpu<>{2});
      if (!decode) run_policy(policy::cpu_naive{1});
    }
}

namespace {

double max_magnitude(const std::vector<double>& x) {
  double m = 0;
  for (double e : x) m = std::max(m, std::abs(e));
  return m;
}

/// Error <= 2 × the plain same-precision implementation's error against the float64 oracle, plus a floor of a few
/// units of roundoff relative to the gradient's size (`extra` widens it where logits are large: ALiBi).
template <class G>
void check_grad(const char* name, const G& got, const std::vector<double>& oracle, const std::vector<double>& plain,
                double eps, double extra = 1.0) {
  double plain_err = 0, err = 0;
  for (std::size_t i = 0; i < oracle.size(); ++i) {
    plain_err = std::max(plain_err, std::abs(plain[i] - oracle[i]));
    const double x = got(i);
    err = std::max(err, std::isnan(x) ? std::numeric_limits<double>::infinity() : std::abs(x - oracle[i]));
  }
  const double tol = 2.0 * plain_err + 8.0 * extra * eps * std::max(1.0, max_magnitude(oracle));
  INFO(name << ": error " << err << " plain error " << plain_err << " tolerance " << tol);
  CHECK(err <= tol);
}

/// The gradient of a view as a flat [b][h][s][d] accessor.
template <class T>
auto flat(const tensor_ref<T>& t) {
  return [t](std::size_t x) {
    const index_t d = t.dims.d, s = t.dims.s, h = t.dims.h;
    const index_t i = static_cast<index_t>(x);
    return static_cast<double>(t.row(i / d / s / h, i / d / s % h, i / d % s)[i % d]);
  };
}

/// Forward then backward with the modifiers on a fresh case; dQ, dK, dV and d sink against the float64 closed form.
template <class T>
void check_backward_mods(const problem& p, const any_mask& mask, const mod_set& ms, int threads = 2) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  attention_case<T> c(p, layout::bhsd, rng);
  c.q.fill(rng, -2.0, 2.0);
  c.k.fill(rng, -2.0, 2.0);
  operand<T> d_o(p.o_dims(), layout::bhsd), dq(p.q_dims(), layout::bhsd), dk(p.kv_dims(), layout::bhsd),
      dv(p.kv_dims(), layout::bhsd);
  d_o.fill(rng);
  const mod_values mv(p.heads, rng);
  std::vector<float> dsink(static_cast<std::size_t>(p.heads), 99.0f);
  modified<any_mask> mm = with_mods(mask, ms, mv);
  if (ms.sink) mm = mm | sinks{mv.logits.data(), dsink.data()};
  INFO(scalar_name<T>() << " " << describe(p) << " " << describe(mask) << " " << ms.name() << " cap " << mv.cap
                        << " seed=" << seed);
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
  REQUIRE(attend(policy::cpu<>{threads}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mm, lse.data()).ok());
  const status st = attend_backward(policy::cpu<>{threads}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.cview(),
                                    d_o.cview(), lse.data(), dq.view, dk.view, dv.view, mm);
  INFO(st.what());
  REQUIRE(st.ok());
  std::visit(
      [&](const auto& m) {
        const auto bound = bind(modified<std::decay_t<decltype(m)>>{m, mm.mods}, p);
        const reference_grads ref = reference_backward(p, c.q.cview(), c.k.cview(), c.v.cview(), d_o.cview(), bound);
        const reference_grads plain = plain_backward(p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.cview(),
                                                     d_o.cview(), lse.data(), bound);
        const double extra =
            ms.alibi ? std::max(1.0, *std::max_element(mv.slopes.begin(), mv.slopes.end()) * double(p.seq_q + p.seq_kv))
                     : 1.0;
        check_grad("dq", flat(dq.view), ref.dq, plain.dq, epsilon<T>(), extra);
        check_grad("dk", flat(dk.view), ref.dk, plain.dk, epsilon<T>(), extra);
        check_grad("dv", flat(dv.view), ref.dv, plain.dv, epsilon<T>(), extra);
        if (ms.sink) {
          // d sink is a float: the floor is float's roundoff over the rows summed.
          check_grad("dsink", [&](std::size_t h) { return double(dsink[h]); }, ref.dsink, plain.dsink,
                     std::max(epsilon<T>(), epsilon<float>()), extra * double(p.batch * p.seq_q));
        } else {
          CHECK(dsink == std::vector<float>(static_cast<std::size_t>(p.heads), 99.0f));
        }
      },
      mask);
}

/// L = Σ O∘dO in double by the float64 forward oracle, for the finite-difference check.
double loss(const problem& p, const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
            const std::vector<double>& d_o, const band_mask& mask) {
  const reference r = reference_attention<double>(p, bhsd<const double>(q.data(), p.q_dims()),
                                                  bhsd<const double>(k.data(), p.kv_dims()),
                                                  bhsd<const double>(v.data(), p.kv_dims()), mask);
  double sum = 0;
  for (std::size_t i = 0; i < r.o.size(); ++i) sum += r.o[i] * d_o[i];
  return sum;
}

}  // namespace

TEST_CASE("modifiers: the float64 closed-form gradient agrees with finite differences", "[modifiers][backward]") {
  const problem p{2, 2, 1, 6, 9, 5};
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1.5, 1.5);
  const auto random = [&](index_t n) {
    std::vector<double> x(static_cast<std::size_t>(n));
    for (auto& e : x) e = u(rng);
    return x;
  };
  std::vector<double> q = random(p.batch * p.heads * p.seq_q * p.head_dim), k = random(p.batch * p.heads_kv * p.seq_kv * p.head_dim),
                      v = random(p.batch * p.heads_kv * p.seq_kv * p.head_dim), d_o = random(p.batch * p.heads * p.seq_q * p.head_dim);
  mod_values mv(p.heads, rng);
  mv.cap = 0.7f;  // softcap that bites: scaled scores reach ~2
  const auto check_mask = [&](const auto& mask, const mod_set& ms) {
      CAPTURE(ms.name(), mask_name(mask));
      // L with other sink logits (m2 holds them while the bound mask points into it).
      const auto loss_with = [&](const std::vector<float>& l) {
        mod_values m2 = mv;
        m2.logits = l;
        return loss(p, q, k, v, d_o, bind(with_mods(mask, ms, m2), p));
      };
      // The closed form reads the logits through the bound mask: keep them alive in mv.
      const band_mask bound = bind(with_mods(mask, ms, mv), p);
      const reference_grads g = reference_backward(p, bhsd<const double>(q.data(), p.q_dims()),
                                                   bhsd<const double>(k.data(), p.kv_dims()),
                                                   bhsd<const double>(v.data(), p.kv_dims()),
                                                   bhsd<const double>(d_o.data(), p.o_dims()), bound);
      const double h = 1e-6;

      const auto central = [&](std::vector<double>& x, std::size_t at) {
        const double keep = x[at];
        x[at] = keep + h;
        const double up = loss(p, q, k, v, d_o, bound);
        x[at] = keep - h;
        const double down = loss(p, q, k, v, d_o, bound);
        x[at] = keep;
        return (up - down) / (2 * h);
      };
      for (int n = 0; n < 6; ++n) {
        const std::size_t iq = rng() % q.size(), ik = rng() % k.size(), iv = rng() % v.size();
        CHECK(g.dq[iq] == Approx(central(q, iq)).margin(1e-7).epsilon(1e-5));
        CHECK(g.dk[ik] == Approx(central(k, ik)).margin(1e-7).epsilon(1e-5));
        CHECK(g.dv[iv] == Approx(central(v, iv)).margin(1e-7).epsilon(1e-5));
      }
      if (ms.sink)
        for (index_t hh = 0; hh < p.heads; ++hh) {
          // The logits are floats: step by a float-exact amount.
          std::vector<float> up = mv.logits, down = mv.logits;
          up[static_cast<std::size_t>(hh)] += 1.0f / 1024;
          down[static_cast<std::size_t>(hh)] -= 1.0f / 1024;
          const double l_up = loss_with(up), l_down = loss_with(down);
          const double fd = (l_up - l_down) / double(up[static_cast<std::size_t>(hh)] - down[static_cast<std::size_t>(hh)]);
          CHECK(g.dsink[static_cast<std::size_t>(hh)] == Approx(fd).margin(1e-6).epsilon(1e-4));
        }
  };
  for (const mod_set& ms : all_mod_sets()) {
    check_mask(dense{}, ms);
    check_mask(causal{align::bottom_right}, ms);
  }
}

#if !FUSEDATTN_TEST_SUBSET  // [heavy]: not compiled in CI's sanitizer stage
TEMPLATE_TEST_CASE("modifiers: attend_backward matches the float64 closed form, every mask",
                   "[modifiers][backward][heavy]",
                   float, double) {
  const problem shapes[] = {{1, 1, 1, 7, 7, 3}, {2, 4, 2, 70, 90, 64}, {1, 2, 1, 130, 129, 80}, {1, 2, 2, 40, 5, 16}};
  for (const mod_set& ms : all_mod_sets())
    for (const problem& p : shapes)
      for (const any_mask& mask : all_masks()) check_backward_mods<TestType>(p, mask, ms);
}
#endif

TEST_CASE("modifiers: attend_backward with block-sparse layouts and half types", "[modifiers][backward]") {
  const problem p{1, 2, 1, 200, 180, 32};
  const block_geometry g{p.seq_q, p.seq_kv, 64, 48, 1, 2};
  const block_layout layout_ = random_layout(g, 0.5, fresh_seed(), {1, 0, 0, 0});
  for (const mod_set& ms : all_mod_sets()) {
    check_backward_mods<float>(p, block_sparse{layout_, causal{}}, ms);
    check_backward_mods<Eigen::bfloat16>({1, 4, 2, 60, 70, 32}, causal{align::bottom_right}, ms);
  }
}

TEST_CASE("modifiers: attend_backward gives the same bits for any thread count, d sink included",
          "[modifiers][backward]") {
  const problem p{2, 4, 2, 150, 170, 48};
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  operand<float> d_o(p.o_dims(), layout::bhsd), dq(p.q_dims(), layout::bhsd), dk(p.kv_dims(), layout::bhsd),
      dv(p.kv_dims(), layout::bhsd);
  d_o.fill(rng);
  const mod_values mv(p.heads, rng);
  std::vector<float> dsink(static_cast<std::size_t>(p.heads));
  const auto mask = with_mods(causal{}, {true, true, align::top_left, false}, mv) | sinks{mv.logits.data(), dsink.data()};
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
  REQUIRE(attend(policy::cpu<>{2}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse.data()).ok());
  std::vector<std::vector<float>> runs;
  for (const int threads : {1, 2, 3}) {
    REQUIRE(attend_backward(policy::cpu<>{threads}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.cview(), d_o.cview(),
                            lse.data(), dq.view, dk.view, dv.view, mask)
                .ok());
    std::vector<float> all = dq.buf;
    all.insert(all.end(), dk.buf.begin(), dk.buf.end());
    all.insert(all.end(), dv.buf.begin(), dv.buf.end());
    all.insert(all.end(), dsink.begin(), dsink.end());
    runs.push_back(all);
  }
  CHECK(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(float)) == 0);
  CHECK(std::memcmp(runs[0].data(), runs[2].data(), runs[0].size() * sizeof(float)) == 0);
}

TEST_CASE("modifiers: attend_backward refuses bad modifier values, nothing written", "[modifiers][backward]") {
  const problem p{1, 2, 1, 9, 11, 8};
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  operand<float> dq(p.q_dims(), layout::bhsd), dk(p.kv_dims(), layout::bhsd), dv(p.kv_dims(), layout::bhsd);
  dq.fill(rng);
  const std::vector<float> before = dq.buf;
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()), 0.5f);
  const auto refused = [&](const auto& mask, const char* field) {
    const status st = attend_backward(policy::cpu<>{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.cview(),
                                      c.o.cview(), lse.data(), dq.view, dk.view, dv.view, mask);
    INFO(st.what());
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find(field) != std::string::npos);
    CHECK(dq.buf == before);
  };
  refused(causal{} | softcap{-2.0f}, "softcap.cap");
  refused(causal{} | softcap{std::numeric_limits<float>::quiet_NaN()}, "softcap.cap");
  refused(dense{} | alibi{nullptr}, "alibi.slopes");
  refused(dense{} | sinks{nullptr}, "sinks.logits");
}
