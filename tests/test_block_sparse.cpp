// Block-sparse attention: the layout builders, the bound mask's schedule against its own allowed(), every kernel
// policy against the float64 oracle (which sees only allowed()), cross-kernel identities and invalid layouts.
#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "support/check.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;

namespace {

/// The CPU policies block-sparse runs through, one thread each.
template <class F>
void for_each_policy(F&& f) {
  f(policy::cpu_naive{1});
  f(policy::cpu<>{1});
  f(policy::cpu_scalar{1});
}

/// Active kv-blocks of CSR row r.
std::vector<block_index> row_of(const block_layout& l, index_t r) {
  return {l.cols().begin() + l.row_offsets()[r], l.cols().begin() + l.row_offsets()[r + 1]};
}

/// Every allowed (i, j) of rows [q0, q1) lies in exactly one segment; segments ascend, are disjoint and inside
/// [0, seq_kv); is_partial of each kv sub-tile of a segment agrees with allowed().
void check_schedule(const block_sparse_mask& m, index_t seq_q, index_t seq_kv, index_t q_tile, index_t kv_tile) {
  for (index_t q0 = 0; q0 < seq_q;) {
    const index_t q1 = std::min({q0 + q_tile, seq_q, (q0 / m.q_granule() + 1) * m.q_granule()});
    std::vector<int> covered(static_cast<std::size_t>(seq_kv), 0);
    index_t prev_end = 0;
    auto segments = m.segments(q0, q1);
    index_t r = 0;
    for (kv_span s; segments.next(s); ++r) {
      CAPTURE(q0, q1, r, s.begin, s.end);
      REQUIRE(!s.empty());
      REQUIRE(s.begin >= prev_end);
      REQUIRE(s.end <= seq_kv);
      prev_end = s.end;
      for (index_t j = s.begin; j < s.end; ++j) covered[static_cast<std::size_t>(j)] = 1;
      for (index_t k0 = s.begin; k0 < s.end; k0 += kv_tile) {
        const index_t k1 = std::min(k0 + kv_tile, s.end);
        bool all = true;
        for (index_t i = q0; i < q1; ++i)
          for (index_t j = k0; j < k1; ++j) all = all && m.allowed(i, j);
        CHECK(m.is_partial(q0, q1, k0, k1) == !all);
      }
    }
    for (index_t i = q0; i < q1; ++i)
      for (index_t j = 0; j < seq_kv; ++j)
        if (m.allowed(i, j)) REQUIRE(covered[static_cast<std::size_t>(j)] == 1);
    // is_partial on any tile, also ones spanning unlisted blocks or the sequence end.
    for (index_t k0 = 0; k0 < seq_kv; k0 += kv_tile) {
      const index_t k1 = k0 + kv_tile;
      bool all = true;
      for (index_t i = q0; i < q1; ++i)
        for (index_t j = k0; j < k1; ++j) all = all && m.allowed(i, j);
      CAPTURE(q0, q1, k0, k1);
      CHECK(m.is_partial(q0, q1, k0, k1) == !all);
    }
    q0 = q1;
  }
}

/// Runs `pol` with `mask` on a fresh random case and returns O (and lse through `lse_out`).
template <class Policy, class Mask>
std::vector<float> run_float(const Policy& pol, const problem& p, const attention_case<float>& c, const Mask& mask,
                             std::vector<float>* lse_out = nullptr) {
  operand<float> o(p.o_dims(), layout::bhsd);
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()), 5.0f);
  const status st = attend(pol, p, c.q.cview(), c.k.cview(), c.v.cview(), o.view, mask, lse.data());
  INFO(st.what());
  REQUIRE(st.ok());
  if (lse_out) *lse_out = lse;
  return o.buf;
}

}  // namespace

TEST_CASE("block_sparse: random layouts have the exact budget and the frame and are sorted and reproducible",
          "[block_sparse]") {
  const block_geometry g{1000, 2300, 100, 128, 1, 3};  // 10 q-block rows, 18 kv-blocks, 3 patterns
  const index_t n_kv = g.n_kv_blocks();
  for (const double sparsity : {0.0, 0.05, 0.5, 0.9, 1.0}) {
    for (const block_frame f : {block_frame{}, block_frame{2, 3, 1, 2}}) {
      CAPTURE(sparsity, f.left_cols, f.right_cols, f.top_rows, f.bottom_rows);
      const block_layout l = random_layout(g, sparsity, 42, f);
      REQUIRE(detail::check_layout(l.view()).ok());
      const index_t budget = std::llround((1.0 - sparsity) * static_cast<double>(n_kv));
      const index_t frame_cols = f.left_cols + f.right_cols;
      for (index_t r = 0; r < g.rows(); ++r) {
        const index_t qb = r % g.n_q_blocks();
        const auto row = row_of(l, r);
        CHECK(std::is_sorted(row.begin(), row.end()));
        CHECK(std::set<block_index>(row.begin(), row.end()).size() == row.size());
        if (qb < f.top_rows || qb >= g.n_q_blocks() - f.bottom_rows) {
          CHECK(static_cast<index_t>(row.size()) == n_kv);
          continue;
        }
        CHECK(static_cast<index_t>(row.size()) == frame_cols + std::min(budget, n_kv - frame_cols));
        for (index_t kb = 0; kb < f.left_cols; ++kb) CHECK(row[static_cast<std::size_t>(kb)] == kb);
        for (index_t t = 0; t < f.right_cols; ++t) CHECK(row[row.size() - 1 - t] == n_kv - 1 - t);
      }
    }
  }
  const block_layout a = random_layout(g, 0.5, 7), b = random_layout(g, 0.5, 7), c = random_layout(g, 0.5, 8);
  CHECK(a.cols() == b.cols());
  CHECK(a.cols() != c.cols());
  CHECK(row_of(a, 0) != row_of(a, g.n_q_blocks()));  // heads get their own pattern
}

TEST_CASE("block_sparse: the builders agree (block mask / predicate / band mask / intersection)", "[block_sparse]") {
  const block_geometry g{37, 53, 3, 5};
  for (const auto& m : {block_sparse::element_rule{causal{}}, block_sparse::element_rule{causal{align::bottom_right}},
                        block_sparse::element_rule{window{4, 2}}}) {
    const block_layout from_mask = std::visit([&](const auto& x) { return layout_from_mask(g, x); }, m);
    const band_mask bound = std::visit([&](const auto& x) { return bind(x, problem{1, 1, 1, 37, 53, 1}); }, m);
    const block_layout from_pred = layout_from_predicate(g, [&](index_t i, index_t j) { return bound.allowed(i, j); });
    CHECK(from_mask.cols() == from_pred.cols());
    CHECK(from_mask.row_offsets() == from_pred.row_offsets());
    // The intersection of the dense layout with the band is the band's own cover.
    const block_layout inter = std::visit([&](const auto& x) { return intersect(dense_layout(g), x); }, m);
    CHECK(inter.cols() == from_mask.cols());
  }
  // A boolean block mask round-trips, and intersect(random, causal) keeps exactly the blocks with j-block <= diagonal.
  const block_layout r = random_layout(g, 0.4, 3, {1, 0, 0, 0});
  std::vector<std::uint8_t> bits(static_cast<std::size_t>(g.n_q_blocks() * g.n_kv_blocks()), 0);
  for (index_t qb = 0; qb < g.n_q_blocks(); ++qb)
    for (const block_index kb : row_of(r, qb)) bits[static_cast<std::size_t>(qb * g.n_kv_blocks() + kb)] = 1;
  CHECK(layout_from_block_mask(g, bits).cols() == r.cols());
  const block_layout rc = intersect(r, causal{});
  for (index_t qb = 0; qb < g.n_q_blocks(); ++qb) {
    std::vector<block_index> want;
    for (const block_index kb : row_of(r, qb))
      if (kb * g.block_kv <= std::min((qb + 1) * g.block_q, g.seq_q) - 1) want.push_back(kb);
    CHECK(row_of(rc, qb) == want);
  }
  CHECK(dense_layout(g).active_blocks() == g.n_q_blocks() * g.n_kv_blocks());
  CHECK(dense_layout(g).density() == 1.0);
}

TEST_CASE("block_sparse: allowed() is the block list of (batch head) intersected with the element rule",
          "[block_sparse]") {
  const problem p{2, 3, 1, 23, 31, 4};
  const block_geometry g{p.seq_q, p.seq_kv, 4, 6, 2, 3};
  const block_layout l = random_layout(g, 0.5, fresh_seed());
  for (const auto& within : {block_sparse::element_rule{dense{}}, block_sparse::element_rule{causal{}}}) {
    const block_sparse_mask bound = bind(block_sparse{l, within}, p);
    const band_mask band = std::visit([&](const auto& w) { return bind(w, p); }, within);
    for (index_t b = 0; b < p.batch; ++b)
      for (index_t h = 0; h < p.heads; ++h) {
        const block_sparse_mask m = for_head(bound, b, h);
        for (index_t i = 0; i < p.seq_q; ++i) {
          const auto row = row_of(l, (b * g.heads + h) * g.n_q_blocks() + i / g.block_q);
          for (index_t j = 0; j < p.seq_kv; ++j) {
            const bool listed = std::find(row.begin(), row.end(), j / g.block_kv) != row.end();
            CAPTURE(b, h, i, j);
            CHECK(m.allowed(i, j) == (listed && band.allowed(i, j)));
          }
          CHECK_FALSE(m.allowed(i, p.seq_kv));
        }
      }
  }
}

TEST_CASE("block_sparse: segments and is_partial agree with allowed()", "[block_sparse]") {
  const index_t seq_q = 41, seq_kv = 67;
  const index_t shapes[][2] = {{3, 5}, {8, 8}, {16, 48}, {7, 1}};
  for (const auto& bs : shapes)
    for (const double sparsity : {0.0, 0.5, 0.9})
      for (const auto& within : {block_sparse::element_rule{dense{}}, block_sparse::element_rule{causal{}},
                                 block_sparse::element_rule{window{6, 2, align::bottom_right}}}) {
        const block_geometry g{seq_q, seq_kv, bs[0], bs[1]};
        const block_layout l = random_layout(g, sparsity, 11, {0, 1, 0, 1});
        const block_sparse_mask m = for_head(bind(block_sparse{l, within}, problem{1, 1, 1, seq_q, seq_kv, 1}), 0, 0);
        CAPTURE(bs[0], bs[1], sparsity, within.index());
        for (const index_t q_tile : {index_t{1}, index_t{4}, bs[0]})
          for (const index_t kv_tile : {index_t{3}, index_t{16}}) check_schedule(m, seq_q, seq_kv, q_tile, kv_tile);
        // Layouts without run arrays (a hand-made view) give one segment per block, same coverage.
        block_layout_view v = l.view();
        v.run_offsets = nullptr;
        v.runs = nullptr;
        v.n_run_offsets = v.n_runs = 0;
        check_schedule(for_head(bind(block_sparse{v, within}, problem{1, 1, 1, seq_q, seq_kv, 1}), 0, 0), seq_q,
                       seq_kv, bs[0], 4);
      }
}

#if !FUSEDATTN_TEST_SUBSET  // [heavy]: not compiled in CI's sanitizer stage
TEST_CASE("block_sparse matches the float64 oracle: the block shapes of the reference kernel",
          "[block_sparse][heavy]") {
  const index_t sizes[] = {128, 256, 512, 1024};
  const double sparsities[] = {0.0, 0.5, 0.9};
  int n = 0;
  for (const index_t bq : sizes)
    for (const index_t bkv : sizes) {
      // Sequence lengths that are not multiples of the blocks, with at least two q- and two kv-block rows.
      const index_t s_q = 2 * bq + 37, s_kv = 2 * bkv + 101;
      const bool per_head = n % 2 == 0;
      const problem p{1, 2, 1, s_q, s_kv, 8};
      const block_geometry g{s_q, s_kv, bq, bkv, 1, per_head ? 2 : 1};
      const block_frame frame = n % 3 == 0 ? block_frame{1, 1, 0, 1} : block_frame{};
      const block_layout l = random_layout(g, sparsities[n % 3], fresh_seed(), frame);
      CAPTURE(bq, bkv, per_head, sparsities[n % 3], frame.left_cols);
      for_each_policy([&](const auto& pol) { check_against_oracle<float>(pol, p, layout::bhsd, block_sparse{l}); });
      ++n;
    }
}
#endif

TEST_CASE("block_sparse matches the float64 oracle: odd blocks and per-head / per-batch patterns and frames",
          "[block_sparse]") {
  const index_t shapes[][2] = {{3, 5}, {16, 48}, {1, 1}, {64, 32}};
  // The last two are decode shapes (one q-tile, many keys): the flash loop splits the keys into chunks.
  const problem problems[] = {{2, 3, 1, 77, 131, 16}, {1, 2, 2, 150, 61, 5}, {2, 2, 1, 1, 100, 8},
                              {1, 2, 1, 5, 2100, 16}};
  for (const auto& bs : shapes)
    for (const problem& p : problems)
      for (const double sparsity : {0.0, 0.5, 0.9})
        for (const bool with_frame : {false, true}) {
          const index_t pattern_batch = with_frame ? p.batch : 1, pattern_heads = sparsity > 0.7 ? 1 : p.heads;
          const block_geometry g{p.seq_q, p.seq_kv, bs[0], bs[1], pattern_batch, pattern_heads};
          const block_layout l = random_layout(g, sparsity, fresh_seed(),
                                               with_frame ? block_frame{1, 2, 1, 1} : block_frame{});
          CAPTURE(bs[0], bs[1], sparsity, with_frame, pattern_batch, pattern_heads);
          for_each_policy([&](const auto& pol) {
            check_against_oracle<float>(pol, p, layout::bshd, block_sparse{l});
            check_against_oracle<double>(pol, p, layout::padded, block_sparse{l, causal{align::bottom_right}});
          });
        }
}

TEST_CASE("block_sparse(all blocks) == dense and block_sparse(causal cover with causal rule) == causal",
          "[block_sparse]") {
  const problem problems[] = {{1, 2, 2, 300, 300, 32}, {1, 1, 1, 200, 333, 64}, {1, 1, 1, 256, 256, 16}};
  for (const problem& p : problems)
    for (const index_t bs : {index_t{16}, index_t{64}, index_t{128}}) {
      CAPTURE(describe(p), bs);
      const block_geometry g{p.seq_q, p.seq_kv, bs, bs};
      std::mt19937_64 rng(fresh_seed());
      attention_case<float> c(p, layout::bhsd, rng);
      const block_layout all = dense_layout(g), tri = layout_from_mask(g, causal{});
      for_each_policy([&](const auto& pol) {
        std::vector<float> lse_a, lse_b;
        CHECK(run_float(pol, p, c, block_sparse{all}, &lse_a) == run_float(pol, p, c, dense{}, &lse_b));
        CHECK(lse_a == lse_b);
        CHECK(run_float(pol, p, c, block_sparse{tri, causal{}}, &lse_a) == run_float(pol, p, c, causal{}, &lse_b));
        CHECK(lse_a == lse_b);
      });
    }
}

TEST_CASE("block_sparse: the thread count does not change the result", "[block_sparse]") {
  const problem p{2, 3, 3, 200, 230, 24};
  const block_layout l = random_layout({p.seq_q, p.seq_kv, 32, 48, 2, 3}, 0.5, fresh_seed(), {1, 1, 0, 0});
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  std::vector<float> lse1, lse2;
  const std::vector<float> o1 = run_float(policy::cpu<>{1}, p, c, block_sparse{l}, &lse1);
  CHECK(o1 == run_float(policy::cpu<>{2}, p, c, block_sparse{l}, &lse2));
  CHECK(lse1 == lse2);
}

TEST_CASE("block_sparse: lse of Q = K = V = 0 is log(attended keys) exactly and empty rows give 0 and -inf",
          "[block_sparse]") {
  const problem p{1, 2, 1, 50, 77, 8};
  const block_geometry g{p.seq_q, p.seq_kv, 7, 10, 1, 2};
  block_layout l = random_layout(g, 0.6, fresh_seed(), {0, 1, 0, 0});
  // Empty the first q-block row of head 0 and the third of head 1.
  std::vector<index_t> offsets = l.row_offsets();
  std::vector<block_index> cols = l.cols();
  for (const index_t r : {g.n_q_blocks() + 2, index_t{0}}) {
    cols.erase(cols.begin() + offsets[r], cols.begin() + offsets[r + 1]);
    const index_t removed = offsets[r + 1] - offsets[r];
    for (index_t t = r + 1; t < static_cast<index_t>(offsets.size()); ++t) offsets[t] -= removed;
  }
  l = block_layout(g, offsets, cols);
  const block_sparse_mask bound = bind(block_sparse{l}, p);
  for_each_policy([&](const auto& pol) {
    std::vector<float> zeros(static_cast<std::size_t>(p.seq_kv * p.head_dim), 0.0f);
    std::vector<float> qz(static_cast<std::size_t>(p.heads * p.seq_q * p.head_dim), 0.0f);
    std::vector<float> o(qz.size(), 3.0f), lse(static_cast<std::size_t>(p.lse_size()), 3.0f);
    REQUIRE(attend(pol, p, bhsd<const float>(qz.data(), p.q_dims()), bhsd<const float>(zeros.data(), p.kv_dims()),
                   bhsd<const float>(zeros.data(), p.kv_dims()), bhsd(o.data(), p.o_dims()), block_sparse{l},
                   lse.data())
                .ok());
    for (index_t h = 0; h < p.heads; ++h)
      for (index_t i = 0; i < p.seq_q; ++i) {
        const block_sparse_mask m = for_head(bound, 0, h);
        index_t keys = 0;
        for (index_t j = 0; j < p.seq_kv; ++j) keys += m.allowed(i, j) ? 1 : 0;
        const float got = lse[static_cast<std::size_t>(h * p.seq_q + i)];
        CAPTURE(h, i, keys);
        if (keys == 0)
          CHECK(got == -std::numeric_limits<float>::infinity());
        else
          CHECK(got == std::log(static_cast<float>(keys)));
        for (index_t d = 0; d < p.head_dim; ++d) CHECK(o[static_cast<std::size_t>((h * p.seq_q + i) * p.head_dim + d)] == 0.0f);
      }
    CHECK(lse[0] == -std::numeric_limits<float>::infinity());
    CHECK(lse[static_cast<std::size_t>(p.seq_q + 2 * g.block_q)] == -std::numeric_limits<float>::infinity());
    // Random inputs, empty rows included, against the oracle; and without lse.
    check_against_oracle<float>(pol, p, layout::bhsd, block_sparse{l});
    std::mt19937_64 rng(fresh_seed());
    attention_case<float> c(p, layout::bhsd, rng);
    REQUIRE(attend(pol, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, block_sparse{l}).ok());
    std::vector<float> lse_ref;
    CHECK(c.o.buf == run_float(pol, p, c, block_sparse{l}, &lse_ref));
  });
}

TEST_CASE("block_sparse: every invalid layout is rejected naming the field with nothing written", "[block_sparse]") {
  const problem p{2, 2, 1, 40, 50, 8};
  const block_geometry g{40, 50, 8, 16, 1, 2};  // 5 q-block rows × 4 kv-blocks, per head
  const block_layout good = random_layout(g, 0.5, 5, {1, 0, 0, 0});
  struct bad_case {
    const char* field;
    block_layout_view view;
  };
  std::vector<bad_case> cases;
  const auto with = [&](const char* field, auto&& change) {
    block_layout_view v = good.view();
    change(v);
    cases.push_back({field, v});
  };
  // Arrays edited by hand (copies, so `good` stays valid).
  std::vector<index_t> offsets = good.row_offsets();
  std::vector<block_index> unsorted = good.cols(), duplicate = good.cols(), out_of_range = good.cols(),
                           negative = good.cols();
  const index_t r0 = good.row_offsets()[0];
  REQUIRE(good.row_size(0) >= 2);
  std::swap(unsorted[r0], unsorted[r0 + 1]);
  duplicate[r0 + 1] = duplicate[r0];
  out_of_range[good.row_offsets()[1] - 1] = static_cast<block_index>(g.n_kv_blocks());
  negative[r0] = -1;
  std::vector<index_t> not_monotone = offsets;
  not_monotone[2] = not_monotone[3] + 1;
  std::vector<index_t> bad_start = offsets;
  bad_start[0] = 1;
  with("cols[", [&](block_layout_view& v) { v.cols = unsorted.data(); v.run_offsets = nullptr; v.runs = nullptr; });
  with("duplicate", [&](block_layout_view& v) { v.cols = duplicate.data(); v.run_offsets = nullptr; v.runs = nullptr; });
  with("[0, 4)", [&](block_layout_view& v) { v.cols = out_of_range.data(); v.run_offsets = nullptr; v.runs = nullptr; });
  with("is -1", [&](block_layout_view& v) { v.cols = negative.data(); v.run_offsets = nullptr; v.runs = nullptr; });
  with("row_offsets[3]", [&](block_layout_view& v) { v.row_offsets = not_monotone.data(); });
  with("row_offsets[0] is 1", [&](block_layout_view& v) { v.row_offsets = bad_start.data(); });
  with("row_offsets has 10", [&](block_layout_view& v) { v.n_row_offsets -= 1; });
  with("cols has", [&](block_layout_view& v) { v.n_cols -= 1; });
  with("runs", [&](block_layout_view& v) { v.runs = good.view().runs + 2; v.n_runs -= 1; });
  with("block_q is 0", [&](block_layout_view& v) { v.geometry.block_q = 0; });
  with("block_kv is -16", [&](block_layout_view& v) { v.geometry.block_kv = -16; });
  with("seq_q is 41", [&](block_layout_view& v) { v.geometry.seq_q = 41; });
  with("seq_kv is 48", [&](block_layout_view& v) { v.geometry.seq_kv = 48; });
  with("heads is 3", [&](block_layout_view& v) { v.geometry.heads = 3; });
  with("batch is 4", [&](block_layout_view& v) { v.geometry.batch = 4; });
  with("row_offsets is null", [&](block_layout_view& v) { v.row_offsets = nullptr; });
  // A layout built for other sizes, and a malformed block mask.
  const block_layout other_seq = random_layout({40, 64, 8, 16, 1, 2}, 0.5, 5);
  cases.push_back({"seq_kv is 64", other_seq.view()});
  const block_layout short_mask = layout_from_block_mask(g, std::vector<bool>(3, true));
  cases.push_back({"the block mask has 3 entries", short_mask.view()});

  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  const std::vector<float> o_before = c.o.buf;
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()), 9.0f);
  for (const bad_case& bc : cases)
    for_each_policy([&](const auto& pol) {
      const status st = attend(pol, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view,
                               any_mask{block_sparse{bc.view}}, lse.data());
      CAPTURE(bc.field, st.what());
      CHECK(st.code() == errc::invalid_argument);
      CHECK(st.message().find(bc.field) != std::string::npos);
      CHECK(st.message().find("block_sparse") != std::string::npos);
      CHECK(unchanged(c.o.buf, o_before));
      CHECK(std::all_of(lse.begin(), lse.end(), [](float x) { return x == 9.0f; }));
    });
  CHECK(attend(policy::cpu_naive{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, block_sparse{good}).ok());
  CHECK(attend(policy::cpu_naive{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view,
               block_sparse{good, window{-1, 2}})
            .message()
            .find("window.left") != std::string::npos);
}
