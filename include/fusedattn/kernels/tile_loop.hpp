/// @file tile_loop.hpp
/// The one online-softmax tile loop of the CPU flash kernel, generic over the bound mask (band_mask,
/// block_sparse_mask, ...) and the SIMD arch: plan (tile sizes, q-tiles, key chunks), per-thread scratch with a
/// packed K/V cache, the per-tile steps, the decode split and its log-sum-exp merge. Entry point: flash.hpp.
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
#include "../cpu/micro_kernels.hpp"
#include "../cpu/simd.hpp"
#include "../cpu/tiles.hpp"
#include "mask.hpp"
#include "softmax.hpp"

namespace fusedattn {
namespace kernels {

/// Smallest multiple of `m` that is >= x (m > 0).
inline constexpr index_t round_up(index_t x, index_t m) { return (x + m - 1) / m * m; }

/// Everything the loop derives from the problem before it starts: sizes, padded strides, q-tiles, key chunks.
/// It depends on the problem, the mask's q_granule and the user's tile sizes only, never on the thread count.
struct flash_plan {
  index_t d = 0;         ///< head_dim
  index_t dp = 0;        ///< head_dim padded to the vector width (accumulator and packed V row stride)
  index_t bq = 0;        ///< most query rows per tile
  index_t bq_pad = 0;    ///< bq padded to the micro-kernel's row block
  index_t bkv = 0;       ///< keys per kv tile; kv tiles start at multiples of bkv
  index_t bkv_pad = 0;   ///< bkv padded to the micro-kernel's column block (S and packed Kᵀ row stride)
  index_t kv_tiles = 0;  ///< ceil(seq_kv / bkv)
  index_t chunk = 0;     ///< keys per decode chunk (a multiple of bkv)
  index_t chunks = 1;    ///< key chunks per q-tile (1: no split)
  std::vector<index_t> q_start;  ///< q-tile boundaries: tile t is rows [q_start[t], q_start[t + 1])

  index_t q_tiles() const { return static_cast<index_t>(q_start.size()) - 1; }
};

/// Builds the plan. Q-tiles hold at most `bq` rows and never straddle a multiple of the mask's q_granule.
template <class Acc, class Arch, class Mask>
flash_plan make_plan(const problem& p, const Mask& mask, tile_sizes user) {
  using shape = cpu::kernel_shape<Acc, Arch>;
  const tile_sizes t = cpu::choose_tiles(user, p.head_dim, p.seq_q, p.seq_kv);
  flash_plan f;
  f.d = p.head_dim;
  f.dp = round_up(p.head_dim, shape::width);
  f.bq = std::min(t.q, p.seq_q);
  f.bq_pad = round_up(f.bq, shape::mr);
  f.bkv = std::min(t.kv, p.seq_kv);
  f.bkv_pad = round_up(f.bkv, shape::cols);
  f.kv_tiles = (p.seq_kv + f.bkv - 1) / f.bkv;
  const index_t want_chunks = std::min(t.kv_split, f.kv_tiles);
  f.chunk = round_up((p.seq_kv + want_chunks - 1) / want_chunks, f.bkv);
  f.chunks = (p.seq_kv + f.chunk - 1) / f.chunk;
  const index_t g = mask.q_granule();
  for (index_t q0 = 0; q0 < p.seq_q;) {
    f.q_start.push_back(q0);
    index_t q1 = std::min(q0 + f.bq, p.seq_q);
    if (g > 0) q1 = std::min(q1, (q0 / g + 1) * g);
    q0 = q1;
  }
  f.q_start.push_back(p.seq_q);
  return f;
}

/// Per-thread working memory. Sizes are fixed by the plan; nothing grows with seq_q × seq_kv.
template <class Acc>
struct flash_scratch {
  std::vector<Acc> q;      ///< bq_pad × d: the Q tile, converted to Acc
  std::vector<Acc> s;      ///< bq_pad × bkv_pad: scores S, then probabilities P, of one tile
  std::vector<Acc> acc;    ///< bq_pad × dp: the unnormalised output accumulator
  std::vector<Acc> m, l;   ///< bq_pad: running max (base 2) and running sum per row
  std::vector<Acc> alpha;  ///< bq_pad: this tile's rescale factor per row
  std::vector<Acc> kt;     ///< kv_tiles × d × bkv_pad (+ one column block of slack): packed Kᵀ of one kv head
  std::vector<Acc> v;      ///< kv_tiles × bkv × dp: packed V of one kv head
  std::vector<unsigned char> packed;  ///< kv_tiles flags: tile already packed for (cached_b, cached_h)
  index_t cached_b = -1, cached_h = -1;

  static index_t kt_slack(index_t cols) { return cols; }

  /// Elements of Acc this scratch holds for a plan (also what flash_scratch_bytes counts).
  template <class Arch>
  static index_t elements(const flash_plan& f) {
    const index_t cols = cpu::kernel_shape<Acc, Arch>::cols;
    return f.bq_pad * f.d + f.bq_pad * f.bkv_pad + f.bq_pad * f.dp + 3 * f.bq_pad +
           f.kv_tiles * f.d * f.bkv_pad + kt_slack(cols) + f.kv_tiles * f.bkv * f.dp;
  }

  template <class Arch>
  void allocate(const flash_plan& f) {
    const index_t cols = cpu::kernel_shape<Acc, Arch>::cols;
    auto sz = [](index_t n) { return static_cast<std::size_t>(n); };
    q.assign(sz(f.bq_pad * f.d), Acc(0));
    s.assign(sz(f.bq_pad * f.bkv_pad), Acc(0));
    acc.assign(sz(f.bq_pad * f.dp), Acc(0));
    m.assign(sz(f.bq_pad), Acc(0));
    l.assign(sz(f.bq_pad), Acc(0));
    alpha.assign(sz(f.bq_pad), Acc(1));
    kt.assign(sz(f.kv_tiles * f.d * f.bkv_pad + kt_slack(cols)), Acc(0));
    v.assign(sz(f.kv_tiles * f.bkv * f.dp), Acc(0));
    packed.assign(sz(f.kv_tiles), 0);
  }
};

/// Elements per row of a partial result in the decode split: m, l, then the dp accumulator columns.
inline index_t partial_row(const flash_plan& f) { return f.dp + 2; }

/// The state shared by all threads of one call.
template <class T, class Mask>
struct flash_call {
  const problem& p;
  const tensor_ref<const T>& q;
  const tensor_ref<const T>& k;
  const tensor_ref<const T>& v;
  const tensor_ref<T>& o;
  const Mask& mask;
  float* lse;
  const flash_plan& plan;
  accum_t<T>* partial;  ///< decode split only: [b][h][q-tile][chunk][bq_pad][dp + 2]
};

/// Packs kv tile `t` of kv head (b, h_kv) into the scratch cache, converting to Acc:
///   Kᵀ tile: d × bkv_pad, column j = key t·bkv + j (so the Q·Kᵀ kernel streams whole rows of it);
///   V tile:  bkv × dp, row j = value row t·bkv + j.
/// Columns/rows past seq_kv and V columns past d stay 0 from allocation (every head has the same tail).
template <class T, class Acc>
void pack_kv_tile(const tensor_ref<const T>& k, const tensor_ref<const T>& v, const flash_plan& f, index_t seq_kv,
                  index_t b, index_t h_kv, index_t t, flash_scratch<Acc>& sc) {
  const index_t k0 = t * f.bkv, kn = std::min(f.bkv, seq_kv - k0);
  Acc* kt = sc.kt.data() + t * f.d * f.bkv_pad;
  Acc* vt = sc.v.data() + t * f.bkv * f.dp;
  for (index_t j = 0; j < kn; ++j) {
    const T* kr = k.row(b, h_kv, k0 + j);
    const T* vr = v.row(b, h_kv, k0 + j);
    for (index_t c = 0; c < f.d; ++c) kt[c * f.bkv_pad + j] = static_cast<Acc>(kr[c]);
    for (index_t c = 0; c < f.d; ++c) vt[j * f.dp + c] = static_cast<Acc>(vr[c]);
  }
}

/// One work item: rows [q0, q1) of head (b, h) against the keys of chunk [key_lo, key_hi).
/// Writes O and lse directly (no split), or the partial (m, l, acc) rows at `partial_out` (decode split).
template <class T, class Arch, class Mask>
void flash_item(const flash_call<T, Mask>& call, flash_scratch<accum_t<T>>& sc, index_t b, index_t h, index_t q0,
                index_t q1, index_t key_lo, index_t key_hi, accum_t<T>* partial_out) {
  using Acc = accum_t<T>;
  using shape = cpu::kernel_shape<Acc, Arch>;
  const problem& p = call.p;
  const flash_plan& f = call.plan;
  const auto mask = for_head(call.mask, b, h);  // the (b, h) pattern of per-head masks (block_sparse)
  constexpr Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  const index_t h_kv = p.kv_head(h);
  const index_t qn = q1 - q0;
  const index_t qn_pad = round_up(qn, shape::mr);

  if (sc.cached_b != b || sc.cached_h != h_kv) {
    std::fill(sc.packed.begin(), sc.packed.end(), static_cast<unsigned char>(0));
    sc.cached_b = b;
    sc.cached_h = h_kv;
  }

  // Q tile (qn_pad × d), converted to Acc; padding rows are 0. The scale is applied in the softmax.
  const Acc c_log2 = static_cast<Acc>(p.softmax_scale() * log2e);
  for (index_t i = 0; i < qn; ++i) {
    const T* qr = call.q.row(b, h, q0 + i);
    Acc* dst = sc.q.data() + i * f.d;
    for (index_t c = 0; c < f.d; ++c) dst[c] = static_cast<Acc>(qr[c]);
  }
  std::fill(sc.q.begin() + qn * f.d, sc.q.begin() + qn_pad * f.d, Acc(0));
  std::fill(sc.acc.begin(), sc.acc.begin() + qn_pad * f.dp, Acc(0));
  std::fill(sc.m.begin(), sc.m.end(), neg_inf);
  std::fill(sc.l.begin(), sc.l.end(), Acc(0));
  std::fill(sc.alpha.begin(), sc.alpha.end(), Acc(1));

  const index_t segments = mask.num_segments(q0, q1);
  for (index_t r = 0; r < segments; ++r) {
    const kv_span seg = mask.segment(q0, q1, r);
    const index_t seg_begin = std::max(seg.begin, key_lo), seg_end = std::min(seg.end, key_hi);
    for (index_t k0 = seg_begin; k0 < seg_end;) {
      // The kv tile: keys [k0, k1) inside packed tile t, starting `off` keys into it.
      const index_t t = k0 / f.bkv;
      const index_t k1 = std::min(seg_end, (t + 1) * f.bkv);
      const index_t kn = k1 - k0, off = k0 - t * f.bkv;
      const index_t kn_pad = round_up(kn, shape::cols);
      if (!sc.packed[static_cast<std::size_t>(t)]) {
        pack_kv_tile(call.k, call.v, f, p.seq_kv, b, h_kv, t, sc);
        sc.packed[static_cast<std::size_t>(t)] = 1;
      }
      const Acc* kt = sc.kt.data() + t * f.d * f.bkv_pad + off;
      const Acc* vt = sc.v.data() + (t * f.bkv + off) * f.dp;

      // S (qn_pad × kn_pad) = Q (qn_pad × d) · Kᵀ (d × kn_pad).
      cpu::qk_tile<Acc, Arch>(sc.q.data(), f.d, kt, f.bkv_pad, f.d, qn_pad, kn_pad, sc.s.data(), f.bkv_pad);

      // Mask: padding columns always; forbidden keys only on tiles the mask calls partial.
      const bool partial = mask.is_partial(q0, q1, k0, k1);
      for (index_t i = 0; i < qn; ++i) {
        Acc* srow = sc.s.data() + i * f.bkv_pad;
        for (index_t j = kn; j < kn_pad; ++j) srow[j] = neg_inf;
        if (partial)
          for (index_t j = 0; j < kn; ++j)
            if (!mask.allowed(q0 + i, k0 + j)) srow[j] = neg_inf;
        // P row (1 × kn_pad) = 2^(scale·log2e·S − m_new); α = 2^(m_old − m_new); l = α·l + Σ P.
        sc.alpha[static_cast<std::size_t>(i)] = online_softmax_row<Acc, Arch>(
            srow, kn_pad, c_log2, sc.m[static_cast<std::size_t>(i)], sc.l[static_cast<std::size_t>(i)]);
      }

      // acc (qn_pad × dp) = diag(α)·acc + P (qn_pad × kn) · V (kn × dp).
      cpu::pv_tile<Acc, Arch>(sc.s.data(), f.bkv_pad, vt, f.dp, kn, f.dp, sc.alpha.data(), sc.acc.data(), f.dp,
                              qn_pad);
      k0 = k1;
    }
  }

  // Finish: O = acc / l, lse = m·ln2 + ln l; a row that saw no key gets O = 0, lse = −inf.
  for (index_t i = 0; i < qn; ++i) {
    const Acc m = sc.m[static_cast<std::size_t>(i)], l = sc.l[static_cast<std::size_t>(i)];
    const Acc* a = sc.acc.data() + i * f.dp;
    if (partial_out) {
      Acc* dst = partial_out + i * partial_row(f);
      dst[0] = m;
      dst[1] = l;
      std::memcpy(dst + 2, a, static_cast<std::size_t>(f.dp) * sizeof(Acc));
      continue;
    }
    T* orow = call.o.row(b, h, q0 + i);
    const Acc inv_l = l > Acc(0) ? Acc(1) / l : Acc(0);
    for (index_t c = 0; c < f.d; ++c) orow[c] = static_cast<T>(a[c] * inv_l);
    if (call.lse)
      call.lse[(b * p.heads + h) * p.seq_q + q0 + i] =
          l > Acc(0) ? static_cast<float>(m * static_cast<Acc>(ln2) + std::log(l))
                     : -std::numeric_limits<float>::infinity();
  }
}

/// Decode split: merges the chunks' partial rows of one q-tile in chunk order (so the result does not depend on
/// which thread ran which chunk). `row` is d accumulators of scratch. Math: M = max_c m_c; w_c = 2^(m_c − M); L = Σ w_c·l_c; O = Σ w_c·acc_c / L;
/// lse = M·ln2 + ln L.
template <class T, class Mask>
void merge_chunks(const flash_call<T, Mask>& call, index_t b, index_t h, index_t q0, index_t q1,
                  const accum_t<T>* parts, accum_t<T>* row) {
  using Acc = accum_t<T>;
  const problem& p = call.p;
  const flash_plan& f = call.plan;
  const index_t stride_chunk = f.bq_pad * partial_row(f);
  for (index_t i = 0; i < q1 - q0; ++i) {
    Acc big_m = -std::numeric_limits<Acc>::infinity();
    for (index_t c = 0; c < f.chunks; ++c) big_m = std::max(big_m, parts[c * stride_chunk + i * partial_row(f)]);
    std::fill(row, row + f.d, Acc(0));
    Acc big_l = 0;
    if (big_m != -std::numeric_limits<Acc>::infinity()) {
      for (index_t c = 0; c < f.chunks; ++c) {
        const Acc* part = parts + c * stride_chunk + i * partial_row(f);
        if (part[1] <= Acc(0)) continue;
        const Acc w = std::exp2(part[0] - big_m);
        big_l += w * part[1];
        for (index_t col = 0; col < f.d; ++col) row[col] += w * part[2 + col];
      }
    }
    T* orow = call.o.row(b, h, q0 + i);
    const Acc inv_l = big_l > Acc(0) ? Acc(1) / big_l : Acc(0);
    for (index_t col = 0; col < f.d; ++col) orow[col] = static_cast<T>(row[col] * inv_l);
    if (call.lse)
      call.lse[(b * p.heads + h) * p.seq_q + q0 + i] =
          big_l > Acc(0) ? static_cast<float>(big_m * static_cast<Acc>(ln2) + std::log(big_l))
                         : -std::numeric_limits<float>::infinity();
  }
}

/// Bytes of scratch one call allocates: per-thread flash_scratch × threads, plus the decode split's partial
/// results (b·h·q-tiles·chunks·bq_pad·(dp + 2) accumulators) when the plan splits the keys.
template <class Acc, class Arch>
index_t scratch_bytes(const problem& p, const flash_plan& f, index_t threads) {
  const index_t per_thread = flash_scratch<Acc>::template elements<Arch>(f) * index_t(sizeof(Acc)) + f.kv_tiles;
  const index_t partials = f.chunks > 1 ? p.batch * p.heads * f.q_tiles() * f.chunks * f.bq_pad * partial_row(f) : 0;
  return threads * per_thread + partials * index_t(sizeof(Acc));
}

/// The tile loop over every (batch, head, q-tile, key chunk), `threads` at a time.
/// Preconditions: the call was validated; tiles are >= 0; threads >= 1. Reports out_of_memory, with nothing
/// written, when the scratch cannot be allocated.
template <class T, class Arch, class Mask>
status flash_tile_loop(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                       const tensor_ref<const T>& v, const tensor_ref<T>& o, const Mask& mask, float* lse,
                       int threads, tile_sizes tiles) {
  using Acc = accum_t<T>;
  flash_plan plan;
  std::vector<flash_scratch<Acc>> scratch;
  std::vector<Acc> partial;
  const index_t heads_total = p.batch * p.heads;
  index_t items = 0;
  int n_threads = 1;
  try {
    plan = make_plan<Acc, Arch>(p, mask, tiles);
    items = heads_total * plan.q_tiles() * plan.chunks;
    n_threads = static_cast<int>(std::max<index_t>(1, std::min<index_t>(threads, items)));
    scratch.resize(static_cast<std::size_t>(n_threads));
    for (auto& sc : scratch) sc.template allocate<Arch>(plan);
    if (plan.chunks > 1)
      partial.resize(static_cast<std::size_t>(items * plan.bq_pad * partial_row(plan)));
  } catch (const std::bad_alloc&) {
    return {errc::out_of_memory, "flash: cannot allocate " + std::to_string(scratch_bytes<Acc, Arch>(p, plan, threads)) +
                                     " bytes of scratch"};
  }
  const flash_call<T, Mask> call{p, q, k, v, o, mask, lse, plan, partial.empty() ? nullptr : partial.data()};
  const index_t q_tiles = plan.q_tiles();
  const index_t part_stride = plan.bq_pad * partial_row(plan);

#if defined(_OPENMP)
#pragma omp parallel num_threads(n_threads)
#endif
  {
#if defined(_OPENMP)
    flash_scratch<Acc>& sc = scratch[static_cast<std::size_t>(omp_get_thread_num())];
#pragma omp for schedule(dynamic, 1)
#else
    flash_scratch<Acc>& sc = scratch[0];
#endif
    for (index_t item = 0; item < items; ++item) {
      // item = ((b·heads + h)·q_tiles + qt)·chunks + c: heads sharing a kv head are adjacent (cache reuse).
      const index_t c = item % plan.chunks;
      const index_t qt = (item / plan.chunks) % q_tiles;
      const index_t bh = item / (plan.chunks * q_tiles);
      const index_t key_lo = c * plan.chunk, key_hi = std::min(p.seq_kv, key_lo + plan.chunk);
      flash_item<T, Arch, Mask>(call, sc, bh / p.heads, bh % p.heads, plan.q_start[static_cast<std::size_t>(qt)],
                                plan.q_start[static_cast<std::size_t>(qt) + 1], key_lo, key_hi,
                                call.partial ? call.partial + item * part_stride : nullptr);
    }
    if (call.partial) {
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
      for (index_t bq = 0; bq < heads_total * q_tiles; ++bq) {
        const index_t qt = bq % q_tiles, bh = bq / q_tiles;
        merge_chunks(call, bh / p.heads, bh % p.heads, plan.q_start[static_cast<std::size_t>(qt)],
                     plan.q_start[static_cast<std::size_t>(qt) + 1], call.partial + bq * plan.chunks * part_stride,
                     sc.acc.data());
      }
    }
  }
  return {};
}

}  // namespace kernels
}  // namespace fusedattn
