// attend_paged: a paged KV cache (both page layouts, every page size class, GQA 1/4/8, f32/f16/bf16) gives
// bitwise the result of the same sequence stored contiguously, and agrees with the float64 oracle; bad caches are
// refused with nothing written.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <variant>
#include <vector>

#include <catch2/catch.hpp>

#include <fusedattn/dispatch/serving.hpp>

#include "support/check.hpp"
#include "support/data.hpp"
#include "support/oracle.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;

namespace {

/// The masks a serving call takes.
using band_choice = std::variant<dense, causal, window>;

/// A paged cache of `lens.size()` sequences filled with random keys and values, its pages scattered in the pool
/// in random order; every pool element no sequence owns holds NaN, so reading it would show in the output.
template <class T>
struct paged_case {
  problem p;
  index_t page_size;
  page_layout layout;
  std::vector<std::int32_t> lens, table;
  index_t blocks_per_seq = 0, pages = 0;
  std::vector<T> k, v, q, o;
  std::vector<float> lse;

  paged_case(const problem& pr, index_t ps, page_layout l, std::vector<std::int32_t> seq_lens, std::mt19937_64& rng)
      : p(pr), page_size(ps), layout(l), lens(std::move(seq_lens)) {
    index_t longest = 0;
    for (auto x : lens) longest = std::max<index_t>(longest, x);
    p.batch = static_cast<index_t>(lens.size());
    p.seq_kv = std::max<index_t>(longest, 1);
    blocks_per_seq = (p.seq_kv + ps - 1) / ps + 1;  // one spare entry per row
    pages = p.batch * blocks_per_seq + 3;           // and spare pages
    std::vector<std::int32_t> ids(static_cast<std::size_t>(pages));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    table.assign(ids.begin(), ids.begin() + p.batch * blocks_per_seq);
    const auto pool = static_cast<std::size_t>(pages * ps * p.heads_kv * p.head_dim);
    k.assign(pool, T(std::numeric_limits<float>::quiet_NaN()));
    v.assign(pool, T(std::numeric_limits<float>::quiet_NaN()));
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    const page_strides st = page_strides_of(layout, ps, p.heads_kv, p.head_dim);
    for (index_t b = 0; b < p.batch; ++b)
      for (index_t h = 0; h < p.heads_kv; ++h)
        for (index_t j = 0; j < lens[static_cast<std::size_t>(b)]; ++j)
          for (index_t c = 0; c < p.head_dim; ++c) {
            const index_t at = table[static_cast<std::size_t>(b * blocks_per_seq + j / ps)] * st.page + h * st.head +
                               (j % ps) * st.token + c;
            k[static_cast<std::size_t>(at)] = static_cast<T>(u(rng));
            v[static_cast<std::size_t>(at)] = static_cast<T>(u(rng));
          }
    q.resize(static_cast<std::size_t>(p.batch * p.heads * p.seq_q * p.head_dim));
    for (auto& x : q) x = static_cast<T>(u(rng));
    o.assign(q.size(), T(7.0f));
    lse.assign(static_cast<std::size_t>(p.lse_size()), 123.0f);
  }
  paged_kv<const T> view() const {
    return paged<const T>(k.data(), v.data(), pages, page_size, p.heads_kv, p.head_dim, layout, table.data(),
                          blocks_per_seq, lens.data());
  }
  /// Sequence b's keys (or values) gathered into a contiguous (1, heads_kv, len, d) buffer.
  std::vector<T> gather(const std::vector<T>& pool, index_t b) const {
    const index_t len = lens[static_cast<std::size_t>(b)];
    const page_strides st = page_strides_of(layout, page_size, p.heads_kv, p.head_dim);
    std::vector<T> out(static_cast<std::size_t>(p.heads_kv * len * p.head_dim));
    for (index_t h = 0; h < p.heads_kv; ++h)
      for (index_t j = 0; j < len; ++j)
        for (index_t c = 0; c < p.head_dim; ++c)
          out[static_cast<std::size_t>((h * len + j) * p.head_dim + c)] =
              pool[static_cast<std::size_t>(table[static_cast<std::size_t>(b * blocks_per_seq + j / page_size)] *
                                                st.page +
                                            h * st.head + (j % page_size) * st.token + c)];
    return out;
  }
};

/// Runs attend_paged on the case, then per sequence: the contiguous attend call on the gathered K/V must give the
/// same bits (O and lse), and the float64 oracle must agree within the usual tolerance.
template <class T, class Mask>
void check_paged(paged_case<T>& c, const Mask& mask, int threads) {
  const problem& p = c.p;
  const status st = attend_paged(policy::cpu<>{threads}, p, bhsd<const T>(c.q.data(), p.q_dims()), c.view(),
                                 bhsd(c.o.data(), p.o_dims()), mask, c.lse.data());
  INFO(st.what());
  REQUIRE(st.ok());
  const index_t rows = p.heads * p.seq_q * p.head_dim;
  for (index_t b = 0; b < p.batch; ++b) {
    const index_t len = c.lens[static_cast<std::size_t>(b)];
    INFO("sequence " << b << " of " << len << " keys");
    problem pb = p;
    pb.batch = 1;
    pb.seq_kv = len;
    const T* qb = c.q.data() + b * rows;
    const T* ob = c.o.data() + b * rows;
    const float* lb = c.lse.data() + b * p.heads * p.seq_q;
    if (len == 0) {
      CHECK(std::all_of(ob, ob + rows, [](const T& x) { return static_cast<float>(x) == 0.0f; }));
      CHECK(std::all_of(lb, lb + p.heads * p.seq_q, [](float x) { return x == -std::numeric_limits<float>::infinity(); }));
      continue;
    }
    const std::vector<T> kb = c.gather(c.k, b), vb = c.gather(c.v, b);
    std::vector<T> o1(static_cast<std::size_t>(rows), T(5.0f));
    std::vector<float> l1(static_cast<std::size_t>(p.heads * p.seq_q));
    REQUIRE(attend(policy::cpu<>{threads}, pb, bhsd(qb, pb.q_dims()), bhsd(kb.data(), pb.kv_dims()),
                   bhsd(vb.data(), pb.kv_dims()), bhsd(o1.data(), pb.o_dims()), mask, l1.data())
                .ok());
    const bool same = std::memcmp(ob, o1.data(), static_cast<std::size_t>(rows) * sizeof(T)) == 0;
    CHECK(same);
    CHECK(std::equal(l1.begin(), l1.end(), lb));
    // Against the float64 oracle.
    const tensor_ref<const T> qv = bhsd(qb, pb.q_dims()), kv = bhsd<const T>(kb.data(), pb.kv_dims()),
                              vv = bhsd<const T>(vb.data(), pb.kv_dims());
    const band_mask bound = bind(mask, pb);
    const reference ref = reference_attention<double>(pb, qv, kv, vv, bound);
    const reference plain = reference_attention<accum_t<T>>(pb, qv, kv, vv, bound);
    double plain_err = 0, err = 0;
    for (std::size_t x = 0; x < ref.o.size(); ++x) {
      plain_err = std::max(plain_err, std::abs(static_cast<double>(static_cast<T>(plain.o[x])) - ref.o[x]));
      const double got = static_cast<double>(ob[x]);
      err = std::max(err, std::isnan(got) ? std::numeric_limits<double>::infinity() : std::abs(got - ref.o[x]));
    }
    INFO("error " << err << " plain " << plain_err);
    CHECK(err <= output_tolerance<T>(plain_err));
    const std::vector<float> lse_b(lb, lb + p.heads * p.seq_q);
    CHECK(max_lse_error(lse_b, ref.lse) <= 1e-4);
  }
}

// FUSEDATTN_TEST_SUBSET (CI's sanitizer stage) keeps float and one 16-bit type.
#if FUSEDATTN_TEST_SUBSET
#define PAGED_TYPES float, Eigen::bfloat16
#else
#define PAGED_TYPES float, Eigen::half, Eigen::bfloat16
#endif

}  // namespace

TEMPLATE_TEST_CASE("paged: equals the contiguous call bitwise and the oracle", "[paged]", PAGED_TYPES) {
  using T = TestType;
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  // (heads, heads_kv): GQA group sizes 1, 4 and 8; head_dim 128 and a tail 40.
  const problem heads[] = {{1, 4, 4, 1, 1, 128}, {1, 8, 2, 1, 1, 40}, {1, 8, 1, 1, 1, 64}};
  const index_t page_sizes[] = {8, 16, 24, 64, 256};
  // Lengths that are not multiples of a page, of the decode step (64) or of a tile; an empty sequence; one long
  // enough for several key chunks.
  const std::vector<std::int32_t> lens = {1, 77, 0, 300, 1500};
  int n = 0;
  for (const problem& h : heads)
    for (index_t seq_q : {index_t(1), index_t(3), index_t(20)})
      for (const band_choice& mask : {band_choice{dense{}}, band_choice{causal{align::bottom_right}},
                                      band_choice{window{40, 0, align::bottom_right}},
                                      band_choice{causal{align::top_left}}}) {
        const index_t ps = page_sizes[n % 5];
        const page_layout layout = n % 2 ? page_layout::nhd : page_layout::hnd;
        ++n;
        problem p = h;
        p.seq_q = seq_q;
        INFO(describe(p) << " " << std::visit([](const auto& m) { return mask_name(m); }, mask) << " page " << ps << (layout == page_layout::hnd ? " hnd" : " nhd"));
        paged_case<T> c(p, ps, layout, lens, rng);
        std::visit([&](const auto& m) { check_paged(c, m, 2); }, mask);
      }
}

TEST_CASE("paged: any thread count gives the same bits", "[paged]") {
  std::mt19937_64 rng(fresh_seed());
  for (index_t seq_q : {index_t(1), index_t(24)}) {
    paged_case<float> c({1, 8, 2, seq_q, 1, 128}, 16, page_layout::nhd, {2000, 513, 9}, rng);
    const auto run = [&](int threads) {
      std::fill(c.o.begin(), c.o.end(), 3.0f);
      REQUIRE(attend_paged(policy::cpu<>{threads}, c.p, bhsd<const float>(c.q.data(), c.p.q_dims()), c.view(),
                           bhsd(c.o.data(), c.p.o_dims()), causal{align::bottom_right}, c.lse.data())
                  .ok());
      return std::make_pair(c.o, c.lse);
    };
    const auto one = run(1);
    CHECK(run(2) == one);
    CHECK(run(5) == one);
  }
}

TEST_CASE("paged: the scalar path and explicit tiles agree with the oracle", "[paged]") {
  std::mt19937_64 rng(fresh_seed());
  paged_case<double> c({1, 4, 2, 2, 1, 33}, 32, page_layout::hnd, {45, 200, 1}, rng);
  REQUIRE(attend_paged(policy::cpu_scalar{2}, c.p, bhsd<const double>(c.q.data(), c.p.q_dims()), c.view(),
                       bhsd(c.o.data(), c.p.o_dims()), causal{align::bottom_right}, c.lse.data())
              .ok());
  const std::vector<double> o_scalar = c.o;
  policy::cpu<> tiled{2};
  tiled.tiles = {2, 16, 0};  // the tile loop over the paged source
  check_paged(c, causal{align::bottom_right}, 2);
  REQUIRE(attend_paged(tiled, c.p, bhsd<const double>(c.q.data(), c.p.q_dims()), c.view(),
                       bhsd(c.o.data(), c.p.o_dims()), causal{align::bottom_right}, c.lse.data())
              .ok());
  double d = 0;
  for (std::size_t x = 0; x < o_scalar.size(); ++x) d = std::max(d, std::abs(o_scalar[x] - c.o[x]));
  CHECK(d <= 1e-12);
}

TEST_CASE("paged: bad caches are refused by name, nothing written", "[paged]") {
  std::mt19937_64 rng(fresh_seed());
  paged_case<float> c({1, 4, 2, 1, 1, 16}, 8, page_layout::hnd, {20, 5}, rng);
  const std::vector<float> o0 = c.o, lse0 = c.lse;
  auto call = [&](const paged_kv<const float>& kv, const problem& p) {
    return attend_paged(policy::cpu<>{2}, p, bhsd<const float>(c.q.data(), p.q_dims()), kv,
                        bhsd(c.o.data(), p.o_dims()), dense{}, c.lse.data());
  };
  const auto refused = [&](const status& st, const std::string& field) {
    INFO(st.what());
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find(field) != std::string::npos);
    CHECK(c.o == o0);
    CHECK(c.lse == lse0);
  };
  {  // a page id out of range, then a negative one
    std::vector<std::int32_t> table = c.table;
    table[static_cast<std::size_t>(c.blocks_per_seq + 0)] = static_cast<std::int32_t>(c.pages);
    auto kv = c.view();
    kv.block_table = table.data();
    refused(call(kv, c.p), "kv.block_table[1][0] is " + std::to_string(c.pages));
    table[static_cast<std::size_t>(c.blocks_per_seq + 0)] = -1;
    refused(call(kv, c.p), "kv.block_table[1][0] is -1");
  }
  {  // a length beyond the sequence's pages
    std::vector<std::int32_t> lens = c.lens;
    lens[1] = static_cast<std::int32_t>(c.blocks_per_seq * c.page_size + 1);
    auto kv = c.view();
    kv.seq_lens = lens.data();
    refused(call(kv, c.p), "kv.seq_lens[1] is " + std::to_string(lens[1]));
    lens[1] = 21;  // within the pages but beyond problem.seq_kv
    refused(call(kv, c.p), "beyond problem.seq_kv");
    lens[1] = -2;
    refused(call(kv, c.p), "kv.seq_lens[1] is -2");
  }
  {  // a block table too short for seq_kv
    auto kv = c.view();
    kv.blocks_per_seq = 2;
    refused(call(kv, c.p), "kv.blocks_per_seq is 2");
  }
  {  // page size not a multiple of 8, or beyond 256; null pointers
    auto kv = c.view();
    kv.page_size = 12;
    refused(call(kv, c.p), "kv.page_size is 12");
    kv.page_size = 264;
    refused(call(kv, c.p), "kv.page_size is 264");
    kv = c.view();
    kv.block_table = nullptr;
    refused(call(kv, c.p), "kv.block_table is null");
    kv = c.view();
    kv.stride.token = -1;
    refused(call(kv, c.p), "kv.stride.token is -1");
  }
  {  // o aliasing the K pool
    const problem& p = c.p;
    auto kv = c.view();
    const status st = attend_paged(policy::cpu<>{1}, p, bhsd<const float>(c.q.data(), p.q_dims()), kv,
                                   bhsd(const_cast<float*>(c.k.data()), p.o_dims()), dense{}, nullptr);
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find("o overlaps kv.k") != std::string::npos);
  }
  {  // other policies
    const status st = attend_paged(policy::cpu_naive{1}, c.p, bhsd<const float>(c.q.data(), c.p.q_dims()), c.view(),
                                   bhsd(c.o.data(), c.p.o_dims()), dense{}, nullptr);
    CHECK(st.code() == errc::unsupported);
    CHECK(c.o == o0);
  }
}

TEST_CASE("paged: host mirrors equal to the tables give the same bits; a differing mirror is refused by name",
          "[paged][mirror]") {
  std::mt19937_64 rng(fresh_seed());
  // Pages of 8: sequence 0 reads 3 of its 4 block-table entries, sequence 1 one, sequence 2 none (no keys).
  paged_case<float> c({1, 4, 2, 1, 1, 16}, 8, page_layout::nhd, {20, 5, 0}, rng);
  const problem& p = c.p;
  auto call = [&](const paged_kv<const float>& kv) {
    std::fill(c.o.begin(), c.o.end(), 7.0f);
    std::fill(c.lse.begin(), c.lse.end(), 123.0f);
    return attend_paged(policy::cpu<>{2}, p, bhsd<const float>(c.q.data(), p.q_dims()), kv,
                        bhsd(c.o.data(), p.o_dims()), causal{align::bottom_right}, c.lse.data());
  };
  REQUIRE(call(c.view()).ok());
  const std::vector<float> o_plain = c.o, lse_plain = c.lse;
  const std::vector<float> o_sentinel(c.o.size(), 7.0f), lse_sentinel(c.lse.size(), 123.0f);
  std::vector<std::int32_t> table = c.table, lens = c.lens;  // the mirrors: copies of the tables
  // Both mirrors, each one alone, and a mirror whose entries the call does not read differ (beyond a row's pages).
  table[static_cast<std::size_t>(c.blocks_per_seq + 1)] = -5;  // sequence 1 reads entry 0 only
  table[static_cast<std::size_t>(2 * c.blocks_per_seq)] = 999;  // sequence 2 reads none
  for (const auto& kv : {c.view().with_host_tables(table.data(), lens.data()),
                         c.view().with_host_tables(table.data(), nullptr),
                         c.view().with_host_tables(nullptr, lens.data())}) {
    const status st = call(kv);
    INFO(st.what());
    REQUIRE(st.ok());
    CHECK(c.o == o_plain);
    CHECK(c.lse == lse_plain);
  }
  const auto refused = [&](const paged_kv<const float>& kv, const std::string& field) {
    const status st = call(kv);
    INFO(st.what());
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find(field) != std::string::npos);
    CHECK(c.o == o_sentinel);
    CHECK(c.lse == lse_sentinel);
  };
  {  // a page id the call reads, differing (in range: only the comparison catches it)
    std::vector<std::int32_t> bad = c.table;
    const std::int32_t was = bad[2];
    bad[2] = c.table[static_cast<std::size_t>(c.blocks_per_seq)];
    refused(c.view().with_host_tables(bad.data(), nullptr),
            "kv.host_block_table[0][2] is " + std::to_string(bad[2]) + " but kv.block_table[0][2] is " +
                std::to_string(was));
  }
  {  // a length differing, also within the pages
    std::vector<std::int32_t> bad = c.lens;
    bad[1] = 4;
    refused(c.view().with_host_tables(nullptr, bad.data()), "kv.host_seq_lens[1] is 4 but kv.seq_lens[1] is 5");
  }
  {  // the mirrors travel through the conversion to a const view
    std::vector<float> k = c.k, v = c.v;
    std::vector<std::int32_t> bad = c.lens;
    bad[0] = 19;
    const paged_kv<float> mutable_view =
        paged<float>(k.data(), v.data(), c.pages, c.page_size, p.heads_kv, p.head_dim, c.layout, c.table.data(),
                     c.blocks_per_seq, c.lens.data())
            .with_host_tables(c.table.data(), bad.data());
    const paged_kv<const float> as_const = mutable_view;
    CHECK(as_const.host_block_table == c.table.data());
    refused(as_const, "kv.host_seq_lens[0] is 19");
  }
}
