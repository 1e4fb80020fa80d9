// The mask walk of core/mask_walk.hpp that the CPU and CUDA kernels share, checked against the masks' own allowed():
// key_tiles visits every allowed key of a q-tile exactly once (any tile width, key window and split), q_tile_walk
// lists exactly the q tiles that see a kv tile, band_rule::columns is the band's allowed() as a column range.
#include <algorithm>
#include <random>
#include <vector>

#include "support/check.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;

namespace {

/// A mask without the trait member: the walk must take the general path for it.
struct plain_mask {
  span_segments segments(index_t, index_t) const { return span_segments({0, 1}); }
};
static_assert(mask_traits<band_mask>::one_segment, "a band is one segment");
static_assert(!mask_traits<block_sparse_mask>::one_segment, "a block-sparse row has several segments");
static_assert(!mask_traits<plain_mask>::one_segment, "a mask that says nothing takes the general walk");

/// A random band: dense, causal or window in either alignment.
band_mask random_band(const problem& p, std::mt19937_64& rng) {
  const align a = rng() % 2 ? align::top_left : align::bottom_right;
  switch (rng() % 4) {
    case 0: return bind(dense{}, p);
    case 1: return bind(causal{a}, p);
    case 2: return bind(window{index_t(rng() % 40), index_t(rng() % 9), a}, p);
    default: return bind(window{index_t(rng() % 5), index_t(rng() % 70), a}, p);
  }
}

/// Q-tile boundaries of at most `bq` rows that never straddle a multiple of `granule` (0: none), as the CPU plan cuts.
std::vector<index_t> q_tile_starts(index_t seq_q, index_t bq, index_t granule) {
  std::vector<index_t> s;
  for (index_t q0 = 0; q0 < seq_q;) {
    s.push_back(q0);
    index_t q1 = std::min(q0 + bq, seq_q);
    if (granule > 0) q1 = std::min(q1, (q0 / granule + 1) * granule);
    q0 = q1;
  }
  s.push_back(seq_q);
  return s;
}

/// Walks `tiles` and counts, per key, how often a visit covers it; checks that visits start at multiples of the width
/// and ascend, and that every covered key lies in `keys`.
template <class Tiles>
std::vector<int> coverage(Tiles& tiles, index_t width, index_t seq_kv, kv_span keys, int split = 0, int splits = 1) {
  std::vector<int> n(static_cast<std::size_t>(seq_kv), 0);
  index_t prev = -1;
  for (index_t kt = tiles.first(split, splits); kt >= 0; kt = tiles.next(kt)) {
    CAPTURE(kt, tiles.seg_begin, tiles.seg_end);
    REQUIRE(kt % width == 0);
    REQUIRE(kt >= prev);
    prev = kt;
    const index_t k0 = std::max<index_t>(kt, tiles.seg_begin), k1 = std::min<index_t>(kt + width, tiles.seg_end);
    REQUIRE(k0 < k1);
    REQUIRE(k0 >= keys.begin);
    REQUIRE(k1 <= keys.end);
    for (index_t j = k0; j < k1; ++j) ++n[static_cast<std::size_t>(j)];
  }
  return n;
}

/// Every key of `keys` that some row of [q0, q1) allows is covered exactly once; no other key is covered twice.
template <class Mask>
void check_exactly_once(const Mask& m, index_t q0, index_t q1, kv_span keys, const std::vector<int>& n) {
  for (index_t j = 0; j < static_cast<index_t>(n.size()); ++j) {
    bool seen = false;
    for (index_t i = q0; i < q1 && !seen; ++i) seen = m.allowed(i, j);
    CAPTURE(q0, q1, j, keys.begin, keys.end);
    if (seen && j >= keys.begin && j < keys.end) REQUIRE(n[static_cast<std::size_t>(j)] == 1);
    REQUIRE(n[static_cast<std::size_t>(j)] <= 1);
  }
}

/// key_tiles over every q-tile of `m`: run-time widths with a random key window (the CPU loop), a compile-time width
/// of 64 keys over all keys (the CUDA loops), and for one-segment masks every split of 1..4 parts.
template <class Mask>
void check_key_tiles(const Mask& m, index_t seq_q, index_t seq_kv, std::mt19937_64& rng) {
  const index_t bq = 1 + index_t(rng() % 70), width = 1 + index_t(rng() % 80);
  const std::vector<index_t> starts = q_tile_starts(seq_q, bq, m.q_granule());
  for (std::size_t t = 0; t + 1 < starts.size(); ++t) {
    const index_t q0 = starts[t], q1 = starts[t + 1];
    const index_t a = seq_kv > 0 ? index_t(rng() % std::uint64_t(seq_kv + 1)) : 0;
    const index_t b = seq_kv > 0 ? index_t(rng() % std::uint64_t(seq_kv + 1)) : 0;
    const kv_span window{std::min(a, b), std::max(a, b)};
    key_tiles<Mask, 0, index_t> cpu(m, q0, q1, width, window);
    check_exactly_once(m, q0, q1, window, coverage(cpu, width, seq_kv, window));

    const kv_span all{0, seq_kv};
    key_tiles<Mask, 64, int> dev(m, q0, q1);
    check_exactly_once(m, q0, q1, all, coverage(dev, 64, seq_kv, all));
    if constexpr (mask_traits<Mask>::one_segment) {
      for (int splits = 2; splits <= 4; ++splits) {
        std::vector<int> sum(static_cast<std::size_t>(seq_kv), 0);
        for (int s = 0; s < splits; ++s) {
          key_tiles<Mask, 64, int> part(m, q0, q1);
          const std::vector<int> n = coverage(part, 64, seq_kv, all, s, splits);
          for (std::size_t j = 0; j < n.size(); ++j) sum[j] += n[j];
        }
        check_exactly_once(m, q0, q1, all, sum);
      }
    }
  }
}

/// q_tile_walk against brute force: for kv tiles of random width, the q tiles listed are exactly those holding an
/// allowed element, ascending, for a uniform tiling and for the CPU plan's listed tiling.
template <class Mask>
void check_column_walk(const Mask& m, index_t seq_q, index_t seq_kv, std::mt19937_64& rng) {
  const index_t bkv = 1 + index_t(rng() % 70), bm = 1 + index_t(rng() % 50);
  const std::vector<index_t> starts = q_tile_starts(seq_q, bm, m.q_granule());
  const listed_q_tiles listed{starts.data(), index_t(starts.size()) - 1};
  const uniform_q_tiles uniform{bm, seq_q};
  const auto sees = [&](index_t r0, index_t r1, index_t k0, index_t k1) {
    for (index_t i = r0; i < r1; ++i)
      for (index_t j = k0; j < k1; ++j)
        if (m.allowed(i, j)) return true;
    return false;
  };
  for (index_t k0 = 0; k0 < seq_kv; k0 += bkv) {
    const index_t k1 = std::min(k0 + bkv, seq_kv);
    CAPTURE(k0, k1, bm);
    std::vector<kv_span> want_listed, want_uniform, got_listed, got_uniform;
    for (std::size_t t = 0; t + 1 < starts.size(); ++t)
      if (sees(starts[t], starts[t + 1], k0, k1)) want_listed.push_back({starts[t], starts[t + 1]});
    for (index_t r0 = 0; r0 < seq_q; r0 += bm)
      if (sees(r0, std::min(r0 + bm, seq_q), k0, k1)) want_uniform.push_back({r0, std::min(r0 + bm, seq_q)});
    q_tile_walk<listed_q_tiles> wl(m, listed, k0, k1);
    for (kv_span r; wl.next(m, r);) got_listed.push_back(r);
    q_tile_walk<uniform_q_tiles> wu(m, uniform, k0, k1);
    for (kv_span r; wu.next(m, r);) got_uniform.push_back(r);
    const auto same = [](const std::vector<kv_span>& x, const std::vector<kv_span>& y) {
      if (x.size() != y.size()) return false;
      for (std::size_t i = 0; i < x.size(); ++i)
        if (x[i].begin != y[i].begin || x[i].end != y[i].end) return false;
      return true;
    };
    CHECK(same(got_listed, want_listed));
    CHECK(same(got_uniform, want_uniform));
  }
}

/// Random block-sparse masks on p: with and without run arrays, with a random element rule, one pattern or one per
/// head. `layouts` keeps the arrays alive.
std::vector<block_sparse_mask> random_block_masks(const problem& p, std::mt19937_64& rng,
                                                  std::vector<block_layout>& layouts) {
  std::vector<block_sparse_mask> out;
  const index_t block_q = 1 + index_t(rng() % 40), block_kv = 1 + index_t(rng() % 40);
  const double sparsity = double(rng() % 90) / 100.0;
  layouts.push_back(random_layout({p.seq_q, p.seq_kv, block_q, block_kv, 1, p.heads}, sparsity, rng()));
  const block_layout& l = layouts.back();
  const align a = rng() % 2 ? align::top_left : align::bottom_right;
  const block_sparse::element_rule rules[] = {dense{}, causal{a}, window{index_t(rng() % 50), index_t(rng() % 50), a}};
  for (const auto& w : rules) {
    const block_sparse_mask with_runs = bind(block_sparse{l, w}, p);
    block_layout_view v = l.view();
    v.run_offsets = nullptr;
    v.runs = nullptr;
    v.n_run_offsets = v.n_runs = 0;
    const block_sparse_mask without_runs = bind(block_sparse{v, w}, p);
    for (index_t h = 0; h < p.heads; ++h) {
      out.push_back(for_head(with_runs, 0, h));
      out.push_back(for_head(without_runs, 0, h));
    }
  }
  return out;
}

/// `rounds` random shapes (seq_q in [1, max_q], seq_kv in [1, max_kv], 2 heads); check(mask, seq_q, seq_kv) for a
/// random band mask and every random block-sparse mask of each.
template <class Check>
void for_random_masks(std::mt19937_64& rng, int rounds, index_t max_q, index_t max_kv, Check&& check) {
  for (int n = 0; n < rounds; ++n) {
    const index_t seq_q = 1 + index_t(rng() % max_q), seq_kv = 1 + index_t(rng() % max_kv);
    const problem p{1, 2, 2, seq_q, seq_kv, 8};
    CAPTURE(n, seq_q, seq_kv);
    check(random_band(p, rng), seq_q, seq_kv);
    std::vector<block_layout> keep;
    for (const block_sparse_mask& m : random_block_masks(p, rng, keep)) check(m, seq_q, seq_kv);
  }
}

}  // namespace

TEST_CASE("mask walk: key_tiles visits every allowed key of a q-tile exactly once", "[mask_walk]") {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  for_random_masks(rng, 40, 150, 170,
                   [&](const auto& m, index_t seq_q, index_t seq_kv) { check_key_tiles(m, seq_q, seq_kv, rng); });
}

TEST_CASE("mask walk: q_tile_walk lists exactly the q tiles that see a kv tile", "[mask_walk]") {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  for_random_masks(rng, 30, 130, 140,
                   [&](const auto& m, index_t seq_q, index_t seq_kv) { check_column_walk(m, seq_q, seq_kv, rng); });
}

TEST_CASE("mask walk: band_rule::columns is the band's allowed() as a column range, in index_t and in int",
          "[mask_walk]") {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  for (int n = 0; n < 200; ++n) {
    const index_t seq_q = 1 + index_t(rng() % 300), seq_kv = 1 + index_t(rng() % 300);
    const band_mask m = random_band({1, 1, 1, seq_q, seq_kv, 8}, rng);
    const band_rule<index_t> wide = m.rule();
    const auto clamp32 = [](index_t v) { return int(std::max<index_t>(-(index_t(3) << 29), std::min<index_t>(v, index_t(3) << 29))); };
    const band_rule<int> narrow{int(seq_kv), clamp32(m.lo), clamp32(m.hi)};
    const index_t i = index_t(rng() % std::uint64_t(seq_q)), w = 1 + index_t(rng() % 64);
    const index_t k0 = index_t(rng() % std::uint64_t(seq_kv)) / w * w;
    const index_t kb = k0 + index_t(rng() % std::uint64_t(w)), ke = std::min(kb + 1 + index_t(rng() % std::uint64_t(w)), k0 + w);
    index_t c_lo = 0, c_hi = 0;
    int n_lo = 0, n_hi = 0;
    wide.columns(i, k0, kb, ke, c_lo, c_hi);
    narrow.columns(int(i), int(k0), int(kb), int(ke), n_lo, n_hi);
    CAPTURE(n, seq_q, seq_kv, m.lo, m.hi, i, k0, kb, ke, c_lo, c_hi);
    for (index_t c = 0; c < w; ++c) {
      const index_t j = k0 + c;
      const bool want = j >= kb && j < ke && m.allowed(i, j);
      CHECK((c >= c_lo && c < c_hi) == want);
      CHECK((c >= n_lo && c < n_hi) == want);
      CHECK(narrow.allowed(int(i), int(j)) == m.allowed(i, j));
    }
    const index_t q1 = std::min(seq_q, i + 1 + index_t(rng() % 20));
    bool all = true;
    for (index_t r = i; r < q1; ++r)
      for (index_t j = k0; j < k0 + w; ++j) all = all && m.allowed(r, j);
    CHECK(m.is_partial(i, q1, k0, k0 + w) == !all);
    CHECK(narrow.is_partial(int(i), int(q1), int(k0), int(k0 + w)) == !all);
  }
}
