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
#include <type_traits>
#include <utility>
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

/// Whether the decode kernel walks several kv heads of a chunk step by step (one work item) for this KV source:
/// a paged cache, whose pages hold every kv head of their tokens.
template <class KV>
struct interleaves_heads : std::false_type {};
template <class T>
struct interleaves_heads<paged_rows<T>> : std::true_type {};

/// The most kv heads of one decode work item (interleaves_heads).
inline constexpr index_t decode_item_heads = 8;

/// The K and V row addresses of one decode step (at most decode_block_keys keys), gathered run by run from a KV
/// source, and a prefetch of those rows (a hint: no effect on results). Entries past n repeat the last row, so that
/// a step of any length can request these rows as its ahead rows (cpu::dot_tile).
template <class T>
struct step_rows {
  const T* k[cpu::decode_block_keys];
  const T* v[cpu::decode_block_keys];
  index_t n = 0;

  /// Rows of keys [j0, j1) of sequence b, kv head h.
  template <class KV>
  void gather(const KV& kv, index_t b, index_t h, index_t j0, index_t j1) {
    n = j1 - j0;
    for (index_t j = j0; j < j1;) {
      const index_t run = std::min(kv.run(j), j1 - j);
      const T* kr = kv.k_row(b, h, j);
      const T* vr = kv.v_row(b, h, j);
      for (index_t x = 0; x < run; ++x) {
        k[j - j0 + x] = kr + x * kv.k_stride();
        v[j - j0 + x] = vr + x * kv.v_stride();
      }
      j += run;
    }
    for (index_t i = n; i > 0 && i < cpu::decode_block_keys; ++i) k[i] = k[n - 1], v[i] = v[n - 1];
  }

  /// Asks for the cache lines of the K and V rows (d values each) of gathered keys [i0, min(i1, n)).
  void prefetch(index_t i0, index_t i1, index_t d) const {
#if defined(__GNUC__) || defined(__clang__)
    constexpr index_t line = 64;  // bytes per cache line
    const index_t bytes = d * index_t(sizeof(T));
    for (index_t i = i0; i < std::min(i1, n); ++i) {
      const char* kb = reinterpret_cast<const char*>(k[i]);
      const char* vb = reinterpret_cast<const char*>(v[i]);
      for (index_t x = 0; x < bytes; x += line) {
        __builtin_prefetch(kb + x, 0, 3);
        __builtin_prefetch(vb + x, 0, 3);
      }
    }
#else
    (void)i0, (void)i1, (void)d;
#endif
  }
};

/// Per-thread working memory of the decode kernel (rows = the item's kv heads × group size × seq_q).
template <class Acc>
struct decode_scratch {
  line_vector<Acc> q;      ///< rows × d: the query rows of the item's heads, converted to Acc
  line_vector<Acc> s;      ///< rows × lds: scores, then probabilities, of one step of one head (sized for all)
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
/// Rows of one (chunk, kv head) unit are the group's query heads × seq_q, row r = (h_kv·group + r / seq_q,
/// r % seq_q).
/// Per step of decode_block_keys keys: S = Q·Kᵀ with each K row loaded once for every row (cpu::dot_tile), the
/// online softmax (softmax.hpp), acc = α·acc + P·V with each V row loaded once for every row
/// (cpu::pv_tile_in_place). A chunk's (m, l, acc) are merged in chunk order. Each line of K and V the micro-kernels
/// load comes with a request for the same line of the next (step, head)'s rows (cpu::request_line): the loads of
/// the next step overlap this one's arithmetic, also where a paged cache's rows sit in different OS pages (where the
/// hardware prefetchers stop).
/// Preconditions: validated, threads >= 1, rows per kv head <= decode_max_rows.
template <class T, class Arch, class KV, class MaskOf>
status decode_attention(const problem& p, const tensor_ref<const T>& q, const KV& kv, const tensor_ref<T>& o,
                        const MaskOf& mask_of, float* lse, int threads) {
  using Acc = accum_t<T>;
  using V = cpu::simd<Acc, Arch>;
  using kv_t = std::remove_cv_t<std::remove_pointer_t<decltype(kv.k_row(0, 0, 0))>>;
  constexpr Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  const index_t d = p.head_dim, g = p.group_size(), rows = g * p.seq_q;
  const index_t lds = round_up(cpu::decode_block_keys, V::width);
  const index_t prow = d + 2;  // one partial row: m, l, acc
  const Acc c_log2 = static_cast<Acc>(p.softmax_scale() * log2e);
  const Acc scale = static_cast<Acc>(p.softmax_scale());

  // Units: for each sequence b, for each of its key chunks, every kv head; first[b] is the first unit of sequence b.
  // A unit's arithmetic depends on the unit only. Work items are runs of up to `per_item` adjacent kv heads of one
  // chunk: a paged cache keeps every kv head of a token in the same OS pages, so an item that walks its heads step
  // by step reaches each OS page for all of them within one step (one TLB fill where one per head was needed).
  std::vector<index_t> first, chunk_keys, chunks;
  std::vector<Acc> partial;
  index_t units = 0;
  try {
    first.resize(static_cast<std::size_t>(p.batch) + 1);
    chunk_keys.resize(static_cast<std::size_t>(p.batch));
    chunks.resize(static_cast<std::size_t>(p.batch));
    index_t split_units = 0;
    for (index_t b = 0; b < p.batch; ++b) {
      const index_t len = kv.length(b), ck = cpu::decode_chunk_keys(len);
      const auto ub = static_cast<std::size_t>(b);
      chunk_keys[ub] = ck;
      chunks[ub] = std::max<index_t>(1, (len + ck - 1) / ck);
      first[ub] = units;
      units += p.heads_kv * chunks[ub];
      if (chunks[ub] > 1) split_units += p.heads_kv * chunks[ub];
    }
    first[static_cast<std::size_t>(p.batch)] = units;
    if (split_units > 0) partial.resize(static_cast<std::size_t>(units * rows * prow));
  } catch (const std::bad_alloc&) {
    return {errc::out_of_memory, "decode: cannot allocate the partial results"};
  }
  // Heads per item: all of a chunk's (at most decode_item_heads) where the source interleaves them, as long as
  // every thread still gets work; one elsewhere. Only the schedule depends on it (and on the thread count).
  index_t per_item = 1;
  if (interleaves_heads<KV>::value) {
    per_item = std::min(p.heads_kv, decode_item_heads);
    while (per_item > 1 && units / p.heads_kv * ((p.heads_kv + per_item - 1) / per_item) < threads) per_item /= 2;
  }
  const index_t groups = (p.heads_kv + per_item - 1) / per_item;  // items per (sequence, chunk)
  const index_t items = units / p.heads_kv * groups;
  const int n_threads = static_cast<int>(std::max<index_t>(1, std::min<index_t>(threads, items)));
  int failed = 0;

  // The sequence of a unit (binary search over first[]).
  auto sequence_of = [&](index_t unit) {
    return static_cast<index_t>(std::upper_bound(first.begin(), first.end(), unit) - first.begin()) - 1;
  };

#if defined(_OPENMP)
#pragma omp parallel num_threads(n_threads)
#endif
  {
    const cpu::flush_denormals_scope flush_denormals;
    decode_scratch<Acc>& sc = thread_scratch<decode_scratch<Acc>>();
    if (team_allocated(failed, [&] { sc.allocate(per_item * rows, d, lds); })) {
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
      for (index_t item = 0; item < items; ++item) {
        // Item → (sequence b, chunk c, kv heads [h_lo, h_hi)); unit of head h: first[b] + c·heads_kv + h.
        const index_t seq_chunk = item / groups, group = item % groups;
        const index_t b = sequence_of(seq_chunk * p.heads_kv);
        const auto ub = static_cast<std::size_t>(b);
        const index_t c = seq_chunk - first[ub] / p.heads_kv;
        const index_t h_lo = group * per_item, h_hi = std::min(p.heads_kv, h_lo + per_item), nh = h_hi - h_lo;
        const band_mask mask = mask_of(b);
        const bool modify = mask.mods.changes_scores();
        const index_t len = kv.length(b);

        // Per head (local index e = h_kv − h_lo): Q rows (rows × d) converted to Acc, row r is query head
        // h_kv·g + r / seq_q, query row r % seq_q; acc, m, l.
        for (index_t e = 0; e < nh; ++e)
          for (index_t r = 0; r < rows; ++r) {
            const T* qr = q.row(b, (h_lo + e) * g + r / p.seq_q, r % p.seq_q);
            Acc* qe = sc.q.data() + (e * rows + r) * d;
            for (index_t x = 0; x < d; ++x) qe[x] = static_cast<Acc>(qr[x]);
          }
        std::fill(sc.acc.begin(), sc.acc.begin() + nh * rows * d, Acc(0));
        std::fill(sc.m.begin(), sc.m.begin() + nh * rows, neg_inf);
        std::fill(sc.l.begin(), sc.l.begin() + nh * rows, Acc(0));

        // Keys of this chunk that any row may see.
        const kv_span seen = mask.kv_range(0, p.seq_q);
        const index_t key_lo = std::max(seen.begin, c * chunk_keys[ub]);
        const index_t key_hi = std::min({seen.end, (c + 1) * chunk_keys[ub], len});
        // Steps of keys [k0, k1), cut at multiples of decode_block_keys, each for every head of the item in turn.
        // The K and V row addresses of one (step, head) are gathered once (a paged source's runs end at pages);
        // those of the next (step, head) are gathered one ahead, and the micro-kernels request their lines into L2
        // one for each line of this step they load (the first step's lines are requested at once).
        step_rows<kv_t> gathered[2];
        step_rows<kv_t>* now = &gathered[0];
        step_rows<kv_t>* next = &gathered[1];
        auto step_end = [&](index_t k0) {
          return std::min(key_hi, (k0 / cpu::decode_block_keys + 1) * cpu::decode_block_keys);
        };
        if (key_lo < key_hi) {
          now->gather(kv, b, h_lo, key_lo, step_end(key_lo));
          now->prefetch(0, now->n, d);
        }
        for (index_t k0 = key_lo; k0 < key_hi;) {
          const index_t k1 = step_end(k0);
          const index_t kn = k1 - k0, width = round_up(kn, V::width);
          const bool partial_step = mask.is_partial(0, p.seq_q, k0, k1);
          for (index_t e = 0; e < nh; ++e) {
            const index_t h_kv = h_lo + e;
            Acc* q_e = sc.q.data() + e * rows * d;
            Acc* acc_e = sc.acc.data() + e * rows * d;
            Acc* m_e = sc.m.data() + e * rows;
            Acc* l_e = sc.l.data() + e * rows;
            next->n = 0;
            if (e + 1 < nh) next->gather(kv, b, h_kv + 1, k0, k1);
            else if (k1 < key_hi) next->gather(kv, b, h_lo, k1, step_end(k1));
            // S (rows × kn, padded with −inf to width) = Q (rows × d) · Kᵀ (d × kn); the next K rows requested.
            const step_rows<kv_t>* ahead = next->n > 0 ? next : now;
            cpu::dot_tile<Acc, Arch>(q_e, d, rows, now->k, kn, d, sc.s.data(), lds, ahead->k);
            // Mask and online softmax per row: P = 2^(scale·log2e·S − m_new), α = 2^(m_old − m_new).
            // Score modifiers first (modify_row: S becomes base-2 logits, the softmax multiplies by 1).
            for (index_t r = 0; r < rows; ++r) {
              Acc* srow = sc.s.data() + r * lds;
              if (modify)
                modify_row<Acc, Arch>(srow, width, scale, mask.mods, h_kv * g + r / p.seq_q, r % p.seq_q, k0);
              std::fill(srow + kn, srow + width, neg_inf);
              if (partial_step) mask_row(mask, r % p.seq_q, k0, 0, kn, srow);
              sc.alpha[static_cast<std::size_t>(r)] =
                  online_softmax_row<Acc, Arch>(srow, width, modify ? Acc(1) : c_log2, m_e[r], l_e[r]);
            }
            // acc = diag(α)·acc + P·V. On a partial step whose V holds a non-finite value, only allowed keys are
            // summed (0·NaN must not reach a row that does not attend the key; docs/design.md, Numerics).
            bool finite = true;
            if (partial_step)
              for (index_t j = 0; j < kn && finite; ++j) finite = all_finite(now->v[j], d);
            for (index_t r = 0; r < rows; ++r) {
              const Acc a = sc.alpha[static_cast<std::size_t>(r)];
              Acc* arow = acc_e + r * d;
              for (index_t x = 0; x < d; ++x) arow[x] *= a;
            }
            if (finite) {
              cpu::pv_tile_in_place<Acc, Arch>(sc.s.data(), lds, now->v, kn, d, acc_e, d, rows, ahead->v);
            } else {
              for (index_t r = 0; r < rows; ++r) {
                Acc* arow = acc_e + r * d;
                for (index_t j = k0; j < k1; ++j) {
                  if (!mask.allowed(r % p.seq_q, j)) continue;
                  const Acc p_rj = sc.s[static_cast<std::size_t>(r * lds + j - k0)];
                  const kv_t* vr = now->v[j - k0];
                  for (index_t x = 0; x < d; ++x)
                    arow[x] = cpu::tail_mul_add(p_rj, static_cast<Acc>(vr[x]), arow[x]);
                }
              }
            }
            std::swap(now, next);
          }
          k0 = k1;
        }

        // Finish each head: O = acc / l and lse (a single chunk), or the chunk's (m, l, acc) rows for the merge.
        for (index_t e = 0; e < nh; ++e) {
          const index_t h_kv = h_lo + e, unit = first[ub] + c * p.heads_kv + h_kv;
          for (index_t r = 0; r < rows; ++r) {
            const auto er = static_cast<std::size_t>(e * rows + r);
            Acc m = sc.m[er], l = sc.l[er];
            const Acc* a = sc.acc.data() + (e * rows + r) * d;
            if (chunks[ub] > 1) {
              Acc* dst = partial.data() + (unit * rows + r) * prow;
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
