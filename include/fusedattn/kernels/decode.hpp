/// @file decode.hpp
/// The CPU decode kernel: few query rows per kv head against a long KV cache, at memory speed. K and V are read
/// once, in place and in their storage type (no packing), through a KV source; the query heads of a GQA group
/// share every K/V row load; a sequence's keys are cut into chunks that threads share, merged by log-sum-exp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "../core/problem.hpp"
#include "../core/status.hpp"
#include "../core/tensor.hpp"
#include "../core/types.hpp"
#include "../cpu/fp_env.hpp"
#include "../cpu/micro_kernels.hpp"
#include "../cpu/simd.hpp"
#include "../cpu/tiles.hpp"
#include "kv_source.hpp"
#include "mask.hpp"
#include "softmax.hpp"
#include "tile_loop.hpp"

namespace fusedattn {
namespace kernels {

/// Whether a call goes to the decode kernel: a band mask, no explicit tile sizes, and at most
/// cpu::decode_max_rows query rows per kv head (group size × seq_q).
template <class Mask>
bool use_decode_kernel(const problem& p, const tile_sizes& tiles) {
  if constexpr (!std::is_same<Mask, band_mask>::value) {
    (void)p, (void)tiles;
    return false;
  } else {
    return tiles.q == 0 && tiles.kv == 0 && tiles.kv_split == 0 && p.seq_q * p.group_size() <= cpu::decode_max_rows;
  }
}

/// Asks for the cache lines of one row of n values (a hint; no effect on results).
template <class T>
inline void prefetch_row(const T* r, index_t n) {
#if defined(__GNUC__) || defined(__clang__)
  constexpr index_t line = 64;  // bytes per cache line
  const char* bytes = reinterpret_cast<const char*>(r);
  for (index_t x = 0; x < n * index_t(sizeof(T)); x += line) __builtin_prefetch(bytes + x);
#else
  (void)r, (void)n;
#endif
}

/// Per-thread working memory of the decode kernel (rows = group size × seq_q <= decode_max_rows).
template <class Acc>
struct decode_scratch {
  line_vector<Acc> q;      ///< rows × d: the group's query rows, converted to Acc
  line_vector<Acc> s;      ///< rows × lds: scores, then probabilities, of one step
  line_vector<Acc> acc;    ///< rows × d: the unnormalised output
  line_vector<Acc> m, l;   ///< rows: running max (base 2) and sum
  line_vector<Acc> alpha;  ///< rows: this step's rescale factor

  void allocate(index_t rows, index_t d, index_t lds) {
    auto grow = [](auto& buf, index_t n) {
      if (buf.size() < static_cast<std::size_t>(n)) buf.resize(static_cast<std::size_t>(n));
    };
    grow(q, rows * d);
    grow(s, rows * lds);
    grow(acc, rows * d);
    grow(m, rows);
    grow(l, rows);
    grow(alpha, rows);
  }
};

/// The decode kernel over every (sequence b, kv head, key chunk).
///   q, o:     (batch, heads, seq_q, d) views; lse optional, [b][h][i].
///   kv:       a KV source (kv_source.hpp); sequence b holds kv.length(b) keys.
///   mask_of:  mask_of(b) is the band_mask of sequence b, bound to (seq_q, kv.length(b)).
/// Rows of one item are the group's query heads × seq_q, row r = (h_kv·group + r / seq_q, r % seq_q). Per step of
/// decode_block_keys keys: S = Q·Kᵀ with each K row loaded once for every row, the online softmax (softmax.hpp),
/// acc = α·acc + P·V with each V row loaded once for every row. A chunk's (m, l, acc) are merged in chunk order.
/// Preconditions: validated, threads >= 1, rows per kv head <= decode_max_rows.
template <class T, class Arch, class KV, class MaskOf>
status decode_attention(const problem& p, const tensor_ref<const T>& q, const KV& kv, const tensor_ref<T>& o,
                        const MaskOf& mask_of, float* lse, int threads) {
  using Acc = accum_t<T>;
  using V = cpu::simd<Acc, Arch>;
  constexpr Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  const index_t d = p.head_dim, g = p.group_size(), rows = g * p.seq_q;
  const index_t lds = round_up(cpu::decode_block_keys, V::width);
  const index_t prow = d + 2;  // one partial row: m, l, acc
  const Acc c_log2 = static_cast<Acc>(p.softmax_scale() * log2e);
  const Acc scale = static_cast<Acc>(p.softmax_scale());

  // Items: for each sequence b, for each of its key chunks, every kv head (the kv heads of one chunk are adjacent:
  // in a [page][token][kv_head][d] cache they share OS pages); first[b] is the first item of sequence b.
  std::vector<index_t> first, chunk_keys, chunks;
  std::vector<Acc> partial;
  index_t items = 0;
  try {
    first.resize(static_cast<std::size_t>(p.batch) + 1);
    chunk_keys.resize(static_cast<std::size_t>(p.batch));
    chunks.resize(static_cast<std::size_t>(p.batch));
    index_t split_items = 0;
    for (index_t b = 0; b < p.batch; ++b) {
      const index_t len = kv.length(b), ck = cpu::decode_chunk_keys(len);
      const auto ub = static_cast<std::size_t>(b);
      chunk_keys[ub] = ck;
      chunks[ub] = std::max<index_t>(1, (len + ck - 1) / ck);
      first[ub] = items;
      items += p.heads_kv * chunks[ub];
      if (chunks[ub] > 1) split_items += p.heads_kv * chunks[ub];
    }
    first[static_cast<std::size_t>(p.batch)] = items;
    if (split_items > 0) partial.resize(static_cast<std::size_t>(items * rows * prow));
  } catch (const std::bad_alloc&) {
    return {errc::out_of_memory, "decode: cannot allocate the partial results"};
  }
  const int n_threads = static_cast<int>(std::max<index_t>(1, std::min<index_t>(threads, items)));
  int failed = 0;

  // The sequence of an item (binary search over first[]).
  auto sequence_of = [&](index_t item) {
    return static_cast<index_t>(std::upper_bound(first.begin(), first.end(), item) - first.begin()) - 1;
  };

#if defined(_OPENMP)
#pragma omp parallel num_threads(n_threads)
#endif
  {
    const cpu::flush_denormals_scope flush_denormals;
    decode_scratch<Acc>& sc = thread_scratch<decode_scratch<Acc>>();
    if (team_allocated(failed, [&] { sc.allocate(rows, d, lds); })) {
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
      for (index_t item = 0; item < items; ++item) {
        const index_t b = sequence_of(item);
        const auto ub = static_cast<std::size_t>(b);
        const index_t local = item - first[ub];
        const index_t c = local / p.heads_kv, h_kv = local % p.heads_kv;
        const band_mask mask = mask_of(b);
        const bool modify = mask.mods.changes_scores();
        const index_t len = kv.length(b);

        // Q rows (rows × d), converted to Acc; row r is query head h_kv·g + r / seq_q, query row r % seq_q.
        for (index_t r = 0; r < rows; ++r) {
          const T* qr = q.row(b, h_kv * g + r / p.seq_q, r % p.seq_q);
          for (index_t x = 0; x < d; ++x) sc.q[static_cast<std::size_t>(r * d + x)] = static_cast<Acc>(qr[x]);
        }
        std::fill(sc.acc.begin(), sc.acc.begin() + rows * d, Acc(0));
        std::fill(sc.m.begin(), sc.m.begin() + rows, neg_inf);
        std::fill(sc.l.begin(), sc.l.begin() + rows, Acc(0));

        // Keys of this chunk that any row may see.
        const kv_span seen = mask.kv_range(0, p.seq_q);
        const index_t key_lo = std::max(seen.begin, c * chunk_keys[ub]);
        const index_t key_hi = std::min({seen.end, (c + 1) * chunk_keys[ub], len});
        for (index_t k0 = key_lo; k0 < key_hi;) {
          // One step: keys [k0, k1), cut at multiples of decode_block_keys; S is rows × width, padded with −inf.
          const index_t k1 = std::min(key_hi, (k0 / cpu::decode_block_keys + 1) * cpu::decode_block_keys);
          const index_t kn = k1 - k0, width = round_up(kn, V::width);
          // Prefetch the next step's K and V rows: a paged cache's rows sit in different OS pages, where the
          // hardware prefetchers stop.
          for (index_t j = k1; j < std::min(key_hi, k1 + cpu::decode_block_keys); ++j) {
            prefetch_row(kv.k_row(b, h_kv, j), d);
            prefetch_row(kv.v_row(b, h_kv, j), d);
          }
          // S (rows × kn) = Q (rows × d) · Kᵀ (d × kn), run by run (a paged source's runs end at pages).
          for (index_t j = k0; j < k1;) {
            const index_t n = std::min(kv.run(j), k1 - j);
            cpu::dot_tile<Acc, Arch>(sc.q.data(), d, rows, kv.k_row(b, h_kv, j), kv.k_stride(), n, d,
                                     sc.s.data() + (j - k0), lds);
            j += n;
          }
          // Mask and online softmax per row: P = 2^(scale·log2e·S − m_new), α = 2^(m_old − m_new).
          // Score modifiers first (modify_row: S becomes base-2 logits, the softmax multiplies by 1).
          const bool partial_step = mask.is_partial(0, p.seq_q, k0, k1);
          for (index_t r = 0; r < rows; ++r) {
            Acc* srow = sc.s.data() + r * lds;
            if (modify) modify_row<Acc, Arch>(srow, width, scale, mask.mods, h_kv * g + r / p.seq_q, r % p.seq_q, k0);
            std::fill(srow + kn, srow + width, neg_inf);
            if (partial_step) mask_row(mask, r % p.seq_q, k0, 0, kn, srow);
            sc.alpha[static_cast<std::size_t>(r)] = online_softmax_row<Acc, Arch>(
                srow, width, modify ? Acc(1) : c_log2, sc.m[static_cast<std::size_t>(r)],
                sc.l[static_cast<std::size_t>(r)]);
          }
          // acc = diag(α)·acc + P·V. On a partial step whose V holds a non-finite value, only allowed keys are
          // summed (0·NaN must not reach a row that does not attend the key; docs/design.md, Numerics).
          bool finite = true;
          if (partial_step)
            for (index_t j = k0; j < k1 && finite; ++j) finite = all_finite(kv.v_row(b, h_kv, j), d);
          for (index_t r = 0; r < rows; ++r) {
            const Acc a = sc.alpha[static_cast<std::size_t>(r)];
            Acc* arow = sc.acc.data() + r * d;
            for (index_t x = 0; x < d; ++x) arow[x] *= a;
          }
          if (finite) {
            for (index_t j = k0; j < k1;) {
              const index_t n = std::min(kv.run(j), k1 - j);
              cpu::pv_tile_in_place<Acc, Arch>(sc.s.data() + (j - k0), lds, kv.v_row(b, h_kv, j), kv.v_stride(), n,
                                               d, sc.acc.data(), d, rows);
              j += n;
            }
          } else {
            for (index_t r = 0; r < rows; ++r) {
              Acc* arow = sc.acc.data() + r * d;
              for (index_t j = k0; j < k1; ++j) {
                if (!mask.allowed(r % p.seq_q, j)) continue;
                const Acc p_rj = sc.s[static_cast<std::size_t>(r * lds + j - k0)];
                const auto* vr = kv.v_row(b, h_kv, j);  // the KV source's storage type
                for (index_t x = 0; x < d; ++x) arow[x] = cpu::tail_mul_add(p_rj, static_cast<Acc>(vr[x]), arow[x]);
              }
            }
          }
          k0 = k1;
        }

        // Finish: O = acc / l and lse (a single chunk), or the chunk's (m, l, acc) rows for the merge.
        for (index_t r = 0; r < rows; ++r) {
          Acc m = sc.m[static_cast<std::size_t>(r)], l = sc.l[static_cast<std::size_t>(r)];
          const Acc* a = sc.acc.data() + r * d;
          if (chunks[ub] > 1) {
            Acc* dst = partial.data() + (item * rows + r) * prow;
            dst[0] = m;
            dst[1] = l;
            std::memcpy(dst + 2, a, static_cast<std::size_t>(d) * sizeof(Acc));
            continue;
          }
          const index_t h = h_kv * g + r / p.seq_q, i = r % p.seq_q;
          T* orow = o.row(b, h, i);
          // The sink joins the denominator once, at the finish (a split chunk's part leaves it to the merge).
          const Acc sink_alpha = online::add_sink(m, l, mask.mods.sink<Acc>(h) * static_cast<Acc>(log2e));
          const Acc inv_l = online::inverse_sum(l) * sink_alpha;
          for (index_t x = 0; x < d; ++x) orow[x] = static_cast<T>(a[x] * inv_l);
          if (lse) lse[(b * p.heads + h) * p.seq_q + i] = online::lse(m, l);
        }
      }

      // Merge the chunks of split sequences, in chunk order: M = max m_c, w_c = 2^(m_c − M), L = Σ w_c·l_c,
      // O = Σ w_c·acc_c / L, lse = M·ln2 + ln L; a chunk that met a NaN (l_c = NaN) makes the row NaN.
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
      for (index_t bh = 0; bh < p.batch * p.heads_kv; ++bh) {
        const index_t b = bh / p.heads_kv, h_kv = bh % p.heads_kv;
        const auto ub = static_cast<std::size_t>(b);
        const index_t n_chunks = chunks[ub];
        if (n_chunks == 1) continue;
        const Acc* parts = partial.data() + (first[ub] + h_kv) * rows * prow;  // chunk c: c·heads_kv items on
        const bound_mods mods = mask_of(b).mods;
        for (index_t r = 0; r < rows; ++r) {
          Acc big_m = neg_inf;
          bool saw_nan = false;
          for (index_t c = 0; c < n_chunks; ++c) {
            const Acc* part = parts + (c * p.heads_kv * rows + r) * prow;
            big_m = std::max(big_m, part[0]);
            saw_nan |= std::isnan(part[1]);
          }
          Acc* row = sc.acc.data();
          std::fill(row, row + d, Acc(0));
          Acc big_l = 0;
          if (saw_nan) {
            big_l = std::numeric_limits<Acc>::quiet_NaN();
          } else if (big_m != neg_inf) {
            for (index_t c = 0; c < n_chunks; ++c) {
              const Acc* part = parts + (c * p.heads_kv * rows + r) * prow;
              if (part[1] <= Acc(0)) continue;
              const Acc w = online::part_weight(part[0], part[1], big_m);
              big_l += w * part[1];
              for (index_t x = 0; x < d; ++x) row[x] += w * part[2 + x];
            }
          }
          const index_t h = h_kv * g + r / p.seq_q, i = r % p.seq_q;
          T* orow = o.row(b, h, i);
          const Acc sink_alpha =
              online::add_sink(big_m, big_l, mods.sink<Acc>(h) * static_cast<Acc>(log2e));
          const Acc inv_l = online::inverse_sum(big_l) * sink_alpha;
          for (index_t x = 0; x < d; ++x) orow[x] = static_cast<T>(row[x] * inv_l);
          if (lse) lse[(b * p.heads + h) * p.seq_q + i] = online::lse(big_m, big_l);
        }
      }
    }
  }
  if (failed) return {errc::out_of_memory, "decode: cannot allocate the per-thread scratch"};
  return {};
}

}  // namespace kernels
}  // namespace fusedattn
