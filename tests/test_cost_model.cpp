// The cost model (core/cost_model.hpp): FLOPs against the seed documents' figures, densities and visited key rows
// against brute-force counts over allowed(i, j), and the byte and memory formulas against hand-computed values.
#include <algorithm>
#include <cmath>

#include "support/check.hpp"

using namespace fusedattn;

namespace {

/// Brute-force Σ over q-blocks of the key span [min j, max j] allowed by any row of the block.
double brute_kv_rows(const band_mask& m, index_t block_q) {
  double rows = 0;
  for (index_t q0 = 0; q0 < m.seq_q; q0 += block_q) {
    index_t lo = m.seq_kv, hi = -1;
    for (index_t i = q0; i < std::min(q0 + block_q, m.seq_q); ++i)
      for (index_t j = 0; j < m.seq_kv; ++j)
        if (m.allowed(i, j)) {
          lo = std::min(lo, j);
          hi = std::max(hi, j);
        }
    if (hi >= lo) rows += static_cast<double>(hi - lo + 1);
  }
  return rows;
}

/// A mask whose q-tiles must not straddle multiples of 48 and that visits every key: checks the granule cut.
struct granule_mask {
  index_t seq_kv = 0;
  index_t q_granule() const { return 48; }
  span_segments segments(index_t, index_t) const { return span_segments({0, seq_kv}); }
};

}  // namespace

TEST_CASE("cost: FLOPs of the leaderboard shapes match the seed figures", "[cost]") {
  // (B, H, S, D) and the FLOPs the leaderboard lists, 4·B·H·S²·D, to its three significant digits.
  const struct {
    index_t b, h, s, d;
    double flop;
  } rows[] = {{1, 1, 128, 64, 4.19e6},  {1, 1, 512, 64, 67.1e6},  {1, 1, 1024, 64, 268e6}, {1, 1, 2048, 64, 1.07e9},
              {1, 1, 4096, 64, 4.29e9}, {1, 8, 512, 64, 537e6},   {1, 12, 512, 64, 805e6}, {1, 32, 512, 64, 2.15e9},
              {1, 32, 1024, 128, 17.2e9}, {1, 32, 2048, 128, 68.7e9}};
  for (const auto& r : rows) {
    const problem p{r.b, r.h, r.h, r.s, r.s, r.d};
    CAPTURE(r.h, r.s, r.d);
    CHECK(cost::flops(p) == Approx(r.flop).epsilon(5e-3));
    CHECK(cost::flops(p, 0.5) == Approx(0.5 * cost::flops(p)));
  }
}

TEST_CASE("cost: densities match a count of allowed(i, j)", "[cost]") {
  const problem shapes[] = {{1, 1, 1, 37, 37, 8}, {1, 1, 1, 20, 53, 8}, {1, 1, 1, 53, 20, 8}, {1, 1, 1, 1, 1, 8}};
  for (const problem& p : shapes) {
    const band_mask masks[] = {bind(dense{}, p), bind(causal{}, p), bind(causal{align::bottom_right}, p),
                               bind(window{5, 2}, p)};
    for (const band_mask& m : masks) {
      index_t n = 0;
      for (index_t i = 0; i < p.seq_q; ++i)
        for (index_t j = 0; j < p.seq_kv; ++j) n += m.allowed(i, j) ? 1 : 0;
      CAPTURE(p.seq_q, p.seq_kv, m.lo, m.hi);
      CHECK(cost::density(m, p) == Approx(static_cast<double>(n) / (p.seq_q * p.seq_kv)));
    }
  }
  const problem sq{1, 1, 1, 1024, 1024, 64};
  CHECK(cost::density(bind(dense{}, sq), sq) == 1.0);
  CHECK(cost::density(bind(causal{}, sq), sq) == Approx(1025.0 / 2048.0));
}

TEST_CASE("cost: compulsory, naive and flash bytes", "[cost]") {
  // (1, 8, 512, 64) f32: Q, K, V, O of 8·512·64 floats each.
  const problem p{1, 8, 8, 512, 512, 64};
  const double operand = 8.0 * 512 * 64 * 4;
  CHECK(cost::compulsory_bytes(p, 4) == 4 * operand);
  CHECK(cost::compulsory_bytes(p, 2) == 2 * operand);
  // GQA: K and V shrink with h_kv, Q and O do not.
  const problem gqa{2, 8, 2, 100, 300, 32};
  CHECK(cost::compulsory_bytes(gqa, 4) == 4.0 * (2 * (2 * 8 * 100 * 32) + 2 * (2 * 2 * 300 * 32)));
  // Naive: 6 trips of the 8 · 512² float scores on top.
  CHECK(cost::naive_bytes(p, 4, 4) == 4 * operand + 6.0 * 8 * 512 * 512 * 4);
  CHECK(cost::naive_bytes(p, 2, 4, 4) == 2 * operand + 4.0 * 8 * 512 * 512 * 4);
  // Flash, dense: Q and O once, K and V once per q-block (ceil(512 / 64) = 8, ceil(512 / 100) = 6).
  const band_mask dense_m = bind(dense{}, p);
  CHECK(cost::flash_bytes(p, dense_m, 4, 64) == 4.0 * (2 * 8 * 512 * 64 + 2 * 8 * 64 * 512.0 * 8));
  CHECK(cost::flash_bytes(p, dense_m, 4, 100) == 4.0 * (2 * 8 * 512 * 64 + 2 * 8 * 64 * 512.0 * 6));
  CHECK(cost::flash_bytes(p, dense_m, 4, 512) == cost::compulsory_bytes(p, 4));
  // f16 storage re-read as a packed f32 copy: Q and O at 2 bytes, the K/V re-reads at 4.
  CHECK(cost::flash_bytes(p, dense_m, 2, 64, 4) == 2.0 * 2 * 8 * 512 * 64 + 4.0 * 2 * 8 * 64 * 512.0 * 8);
}

TEST_CASE("cost: key rows visited per q-block match a brute-force span", "[cost]") {
  const problem shapes[] = {{1, 1, 1, 130, 130, 8}, {1, 1, 1, 64, 200, 8}, {1, 1, 1, 200, 64, 8}};
  for (const problem& p : shapes) {
    const band_mask masks[] = {bind(dense{}, p), bind(causal{}, p), bind(causal{align::bottom_right}, p),
                               bind(window{16, 0}, p), bind(window{3, 9, align::bottom_right}, p)};
    for (const band_mask& m : masks)
      for (index_t bq : {1, 7, 32, 64, 500}) {
        CAPTURE(p.seq_q, p.seq_kv, m.lo, m.hi, bq);
        CHECK(cost::kv_rows_visited(m, p, bq) == brute_kv_rows(m, bq));
      }
  }
  // q-blocks are cut at multiples of the granule: 128 rows in blocks of 64 with granule 48 → [0,48) [48,96) [96,128).
  const problem p{1, 1, 1, 128, 300, 8};
  CHECK(cost::kv_rows_visited(granule_mask{300}, p, 64) == 3.0 * 300);
}

TEST_CASE("cost: the memory table reproduces the assignment's figures", "[cost]") {
  // 8 heads, f32, D = 64: S 128 → 64 KiB per head, 0.5 MiB in all; 512 → 1, 8 MiB; 1024 → 4, 32; 2048 → 16, 128.
  const double kib = 1024, mib = 1024 * 1024;
  const struct {
    index_t s;
    double per_head, total;
  } rows[] = {{128, 64 * kib, 0.5 * mib}, {512, 1 * mib, 8 * mib}, {1024, 4 * mib, 32 * mib}, {2048, 16 * mib, 128 * mib}};
  for (const auto& r : rows) {
    const problem p{1, 8, 8, r.s, r.s, 64};
    const cost::memory_row m = cost::memory(p, sizeof(float));
    CAPTURE(r.s);
    CHECK(m.naive_per_head == r.per_head);
    CHECK(m.naive_total == r.total);
    // One thread's 64×64 tiles: Q and O (2·64·64), K and V (2·64·64), scores (64·64), m and l (2·64) floats.
    CHECK(m.flash_total == 4.0 * (2 * 64 * 64 + 2 * 64 * 64 + 64 * 64 + 2 * 64));
    CHECK(m.reduction() == Approx(r.total / m.flash_total));
  }
  const problem p{1, 8, 8, 2048, 2048, 64};
  CHECK(cost::memory(p, 4, {64, 64}, 2).flash_total == 2 * cost::flash_working_set_bytes(p, 4));
}

TEST_CASE("cost: roofline helpers", "[cost]") {
  CHECK(cost::intensity(100, 4) == 25);
  CHECK(cost::intensity(100, 0) == 0);
  CHECK(cost::attainable(2, 100e9, 20e9) == 40e9);   // memory-bound: AI × bandwidth
  CHECK(cost::attainable(10, 100e9, 20e9) == 100e9);  // compute-bound: the peak
}
