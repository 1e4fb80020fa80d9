/// @file tile_loop.hpp
/// The one online-softmax tile loop of the CPU flash kernel, generic over the bound mask (band_mask,
/// block_sparse_mask, ...) and the SIMD arch: plan (tile sizes, q-tiles, key chunks), per-thread scratch with a
/// packed K/V cache, the per-tile steps, the decode split and its log-sum-exp merge. Entry point: flash.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
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

namespace fusedattn {
namespace kernels {

/// Smallest multiple of `m` that is >= x (m > 0).
inline constexpr index_t round_up(index_t x, index_t m) { return (x + m - 1) / m * m; }

/// Everything the loop derives from the problem before it starts: sizes, padded strides, q-tiles, key chunks.
/// It depends on the problem, the mask's q_granule and the user's tile sizes only, never on the thread count.
struct flash_plan {
  index_t d = 0;         ///< head_dim
  index_t dp = 0;        ///< head_dim padded to the vector width (accumulator row stride)
  index_t bq = 0;        ///< most query rows per tile
  index_t bq_pad = 0;    ///< bq padded to the micro-kernel's row block
  index_t bkv = 0;       ///< most keys per kv tile; kv tiles are cut at multiples of bkv
  index_t cols = 0;      ///< keys per packed Kᵀ panel = S columns per Q·Kᵀ micro-tile; S is computed panel-aligned
  index_t lds = 0;       ///< S row stride: the widest panel-aligned span a kv tile can touch
  index_t panels = 0;    ///< ceil(seq_kv / cols): Kᵀ panels of one kv head
  index_t vw = 0;        ///< columns per packed V chunk (= P·V micro-tile width)
  index_t v_chunks = 0;  ///< ceil(dp / vw)
  index_t chunk = 0;     ///< keys per decode chunk (a multiple of bkv)
  index_t chunks = 1;    ///< key chunks per q-tile (1: no split)
  std::vector<index_t> q_start;  ///< q-tile boundaries: tile t is rows [q_start[t], q_start[t + 1])

  index_t q_tiles() const { return static_cast<index_t>(q_start.size()) - 1; }
};

/// Builds the plan. Q-tiles hold at most `bq` rows and never straddle a multiple of the mask's q_granule.
template <class Acc, class Arch, class Mask>
flash_plan make_plan(const problem& p, const Mask& mask, tile_sizes user) {
  using shape = cpu::kernel_shape<Acc, Arch>;
  static_assert(shape::cols == shape::qk_nr * shape::width, "fusedattn: a Kᵀ panel is one Q·Kᵀ micro-tile wide");
  const tile_sizes t = cpu::choose_tiles(user, p.head_dim, p.seq_q, p.seq_kv);
  flash_plan f;
  f.d = p.head_dim;
  f.dp = round_up(p.head_dim, shape::width);
  f.bq = std::min(t.q, p.seq_q);
  f.bq_pad = round_up(f.bq, shape::mr);
  f.bkv = std::min(t.kv, p.seq_kv);
  f.cols = shape::cols;
  f.lds = round_up(f.bkv, f.cols) + f.cols;
  f.panels = (p.seq_kv + f.cols - 1) / f.cols;
  f.vw = shape::vw;
  f.v_chunks = (f.dp + f.vw - 1) / f.vw;
  const index_t kv_tiles = (p.seq_kv + f.bkv - 1) / f.bkv;
  const index_t want_chunks = std::min(t.kv_split, kv_tiles);
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

/// Sets S entries j in [j0, j1) of query row i to −inf where the mask forbids key kb + j. A one-segment mask
/// (mask_traits) allows one interval of keys per row, band_rule::columns: two fills; any other mask, one allowed()
/// call per element.
template <class Acc, class Mask>
inline void mask_row(const Mask& mask, index_t i, index_t kb, index_t j0, index_t j1, Acc* srow) {
  constexpr Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  if constexpr (mask_traits<Mask>::one_segment) {
    index_t c_lo = 0, c_hi = 0;
    mask.element_band().rule().columns(i, kb, kb + j0, kb + j1, c_lo, c_hi);
    const index_t lo = std::min(c_lo, j1), hi = std::max(c_hi, lo);
    std::fill(srow + j0, srow + lo, neg_inf);
    std::fill(srow + hi, srow + j1, neg_inf);
  } else {
    for (index_t j = j0; j < j1; ++j)
      if (!mask.allowed(i, kb + j)) srow[j] = neg_inf;
  }
}

/// std::allocator with cache-line alignment: every row of the scratch tiles starts a line (their row strides are
/// multiples of the vector width), so no vector load or store of the micro-kernels straddles two lines.
template <class T>
struct line_allocator {
  using value_type = T;
  static constexpr std::size_t alignment = 64;  // bytes per cache line
  line_allocator() = default;
  template <class U>
  line_allocator(const line_allocator<U>&) noexcept {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(alignment))); }
  void deallocate(T* x, std::size_t) noexcept { ::operator delete(x, std::align_val_t(alignment)); }
  /// Default-initialises (no zero fill of megabytes the loop overwrites before it reads them).
  template <class U>
  void construct(U* x) noexcept {
    ::new (static_cast<void*>(x)) U;
  }
  template <class U, class... Args>
  void construct(U* x, Args&&... args) {
    ::new (static_cast<void*>(x)) U(std::forward<Args>(args)...);
  }
  template <class U>
  bool operator==(const line_allocator<U>&) const noexcept { return true; }
  template <class U>
  bool operator!=(const line_allocator<U>&) const noexcept { return false; }
};
/// A scratch buffer of `line_allocator`.
template <class T>
using line_vector = std::vector<T, line_allocator<T>>;

/// Per-thread working memory. Sizes are fixed by the plan; nothing grows with seq_q × seq_kv.
/// The packed K/V cache holds one kv head in the layouts the micro-kernels stream contiguously:
///   Kᵀ: panels × [d][cols]   (panel P holds keys [P·cols, (P+1)·cols), transposed)
///   V:  v_chunks × [seq_kv][vw] (chunk c holds columns [c·vw, (c+1)·vw) of every value row)
template <class Acc>
struct flash_scratch {
  line_vector<Acc> q;      ///< bq_pad × d: the Q tile, converted to Acc
  line_vector<Acc> s;      ///< bq_pad × lds: scores S, then probabilities P, of one tile
  line_vector<Acc> acc;    ///< bq_pad × dp: the unnormalised output accumulator
  line_vector<Acc> m, l;   ///< bq_pad: running max (base 2) and running sum per row
  line_vector<Acc> alpha;  ///< bq_pad: this tile's rescale factor per row
  line_vector<Acc> kt;     ///< panels × d × cols: packed Kᵀ of one kv head
  line_vector<Acc> v;      ///< v_chunks × seq_kv × vw: packed V of one kv head
  std::vector<unsigned char> packed;  ///< per panel: already packed for (cached_b, cached_h)
  std::vector<signed char> v_finite;  ///< per panel: its V rows are all finite (1), are not (0), unchecked (−1)
  index_t cached_b = -1, cached_h = -1;

  /// Elements of Acc of one packed kv head: the Kᵀ panels, then the V chunks.
  static index_t kv_elements(const flash_plan& f, index_t seq_kv) {
    return f.panels * f.d * f.cols + f.v_chunks * seq_kv * f.vw;
  }
  /// Elements of Acc this scratch holds for a plan (also what flash_scratch_bytes counts); `kv_cache` false when
  /// the call packs every kv head once into a shared buffer instead (see flash_tile_loop).
  static index_t elements(const flash_plan& f, index_t seq_kv, bool kv_cache = true) {
    return f.bq_pad * f.d + f.bq_pad * f.lds + f.bq_pad * f.dp + 3 * f.bq_pad +
           (kv_cache ? kv_elements(f, seq_kv) : 0);
  }

  /// Sizes the buffers for a plan (the packed K/V cache only when `kv_cache`) and forgets the cached kv head.
  /// Buffers only grow and are not zero-filled, so a thread's scratch is reused across calls without touching
  /// fresh pages. Every element is written before it is read: S columns outside the tile's keys are set to −inf,
  /// packing zero-fills the Kᵀ columns past seq_kv and the V columns past d.
  void allocate(const flash_plan& f, index_t seq_kv, bool kv_cache = true) {
    auto grow = [](auto& buf, index_t n) {
      if (buf.size() < static_cast<std::size_t>(n)) buf.resize(static_cast<std::size_t>(n));
    };
    grow(q, f.bq_pad * f.d);
    grow(s, f.bq_pad * f.lds);
    grow(acc, f.bq_pad * f.dp);
    grow(m, f.bq_pad);
    grow(l, f.bq_pad);
    grow(alpha, f.bq_pad);
    if (kv_cache) {
      grow(kt, f.panels * f.d * f.cols);
      grow(v, f.v_chunks * seq_kv * f.vw);
      grow(packed, f.panels);
    }
    grow(v_finite, f.panels);
    cached_b = cached_h = -1;
  }
};

/// Elements per row of a partial result in the decode split: m, l, then the dp accumulator columns.
inline index_t partial_row(const flash_plan& f) { return f.dp + 2; }

/// The state shared by all threads of one call. K and V come from a KV source (kv_source.hpp).
template <class T, class Mask, class KV = strided_kv<T>>
struct flash_call {
  const problem& p;
  const tensor_ref<const T>& q;
  const KV& kv;
  const tensor_ref<T>& o;
  const Mask& mask;
  float* lse;
  const flash_plan& plan;
  accum_t<T>* partial;  ///< decode split only: [b][h][q-tile][chunk][bq_pad][dp + 2]
  accum_t<T>* packed;   ///< shared packed K/V, [b][h_kv][kv_elements], or nullptr: per-thread caches
};

/// Packs panel `pn` (keys [pn·cols, min((pn + 1)·cols, seq_kv))) of kv head (b, h_kv) into the packed head at
/// `kt_head` / `v_head` (f.kv_elements layout), converting to Acc (half types convert here, once per key):
///   Kᵀ panel: d × cols, kt[c][j] = k[pn·cols + j][c], 0 past seq_kv;
///   V: for each column chunk, v[key][x] = v[key][chunk·vw + x], 0 past d.
/// K and V may have a storage type of their own (the KV source's), widened here. Under a bf16-pair kernel set
/// (cpu::pair_packers<Arch>::pairs) both are packed as bf16 pairs instead, in the same places, by the set's packers
/// (x86_kernels.hpp, arm_kernels.hpp).
template <class T, class Arch = scalar_arch, class Acc, class KV>
void pack_panel(const KV& kv, const flash_plan& f, index_t seq_kv, index_t b, index_t h_kv, index_t pn, Acc* kt_head,
                Acc* v_head) {
  const index_t k0 = pn * f.cols, kn = std::min(f.cols, seq_kv - k0);
  Acc* kt = kt_head + pn * f.d * f.cols;
  if constexpr (cpu::pair_packers<Arch>::pairs) {
    using packers = cpu::pair_packers<Arch>;
    packers::pack_k_pairs([&](index_t j) { return kv.k_row(b, h_kv, k0 + j); }, kn, f.d, kt);
    for (index_t j = k0; j < k0 + kn; ++j)
      for (index_t ch = 0; ch < f.v_chunks; ++ch)
        packers::pack_v_pair_row(kv.v_row(b, h_kv, j), j + 1 < seq_kv ? kv.v_row(b, h_kv, j + 1) : nullptr,
                                 ch * f.vw, f.d, v_head + (ch * seq_kv + j) * f.vw);
    return;
  }
  for (index_t j = 0; j < kn; ++j) {
    const auto* kr = kv.k_row(b, h_kv, k0 + j);
    for (index_t c = 0; c < f.d; ++c) kt[c * f.cols + j] = static_cast<Acc>(kr[c]);
  }
  if (kn < f.cols)
    for (index_t c = 0; c < f.d; ++c) std::fill(kt + c * f.cols + kn, kt + (c + 1) * f.cols, Acc(0));
  for (index_t j = 0; j < kn; ++j) {
    const auto* vr = kv.v_row(b, h_kv, k0 + j);
    for (index_t ch = 0; ch < f.v_chunks; ++ch) {
      Acc* dst = v_head + (ch * seq_kv + k0 + j) * f.vw;
      const index_t c0 = ch * f.vw, cn = std::max<index_t>(0, std::min(f.vw, f.d - c0));
      for (index_t x = 0; x < cn; ++x) dst[x] = static_cast<Acc>(vr[c0 + x]);
      for (index_t x = cn; x < f.vw; ++x) dst[x] = Acc(0);
    }
  }
}

/// Whether none of the n values at r is NaN or ±inf, from the bits: an IEEE value (float, double, half, bfloat16)
/// is non-finite exactly when its exponent field is all ones, i.e. when it has every bit of +inf set. Integer
/// ops only, no dependency chain: the compiler vectorises the loop.
template <class T>
bool all_finite(const T* r, index_t n) {
  using U = std::conditional_t<sizeof(T) == 2, std::uint16_t,
                               std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>;
  static_assert(sizeof(U) == sizeof(T), "fusedattn: all_finite expects a 2-, 4- or 8-byte IEEE type");
  const T inf_value = std::numeric_limits<T>::infinity();
  U inf = 0;
  std::memcpy(&inf, &inf_value, sizeof(U));
  U non_finite = 0;
  for (index_t c = 0; c < n; ++c) {
    U bits = 0;
    std::memcpy(&bits, r + c, sizeof(U));
    non_finite |= static_cast<U>((bits & inf) == inf);
  }
  return non_finite == 0;
}

/// Whether the V rows of keys [k0, k1) of kv head (b, h_kv) are all finite, from per-panel flags that are
/// computed from V itself the first time a panel is asked about (once per kv head and thread, and only for
/// panels that partial tiles touch). Conservative: a non-finite value anywhere in a touched panel says no.
template <class KV, class Acc>
bool values_finite(const KV& kv, const flash_plan& f, index_t seq_kv, index_t b, index_t h_kv,
                   index_t k0, index_t k1, flash_scratch<Acc>& sc) {
  bool finite = true;
  for (index_t pn = k0 / f.cols; pn <= (k1 - 1) / f.cols; ++pn) {
    signed char& state = sc.v_finite[static_cast<std::size_t>(pn)];
    if (state < 0) {
      bool panel_finite = true;
      for (index_t j = pn * f.cols; j < std::min(seq_kv, (pn + 1) * f.cols); ++j)
        panel_finite &= all_finite(kv.v_row(b, h_kv, j), f.d);
      state = panel_finite ? 1 : 0;
    }
    finite &= state == 1;
  }
  return finite;
}

/// acc (qn × dp) = diag(α)·acc + P·V over the allowed keys only: the P·V step of a partial tile whose V holds a
/// non-finite value, where the micro-kernel's 0·v for a forbidden key would put NaN into a row that does not
/// attend that key (docs/design.md, Numerics). Plain loops over V as the caller passed it (rare inputs only).
///   p: P at the tile's first key, row stride ldp (qn × kn); keys [k0, k0 + kn) of kv head (b, h_kv).
template <class KV, class Acc, class Mask>
void pv_tile_allowed(const Mask& mask, const KV& kv, index_t b, index_t h_kv, index_t q0, index_t qn,
                     index_t k0, index_t kn, index_t d, const Acc* p, index_t ldp, const Acc* alpha, Acc* acc,
                     index_t lda) {
  for (index_t i = 0; i < qn; ++i) {
    Acc* a = acc + i * lda;
    for (index_t c = 0; c < d; ++c) a[c] *= alpha[i];
    for (index_t j = 0; j < kn; ++j) {
      if (!mask.allowed(q0 + i, k0 + j)) continue;
      const Acc p_ij = p[i * ldp + j];
      const auto* vr = kv.v_row(b, h_kv, k0 + j);
      for (index_t c = 0; c < d; ++c) a[c] = cpu::tail_mul_add(p_ij, static_cast<Acc>(vr[c]), a[c]);
    }
  }
}

/// One work item: rows [q0, q1) of head (b, h) against the keys of chunk [key_lo, key_hi).
/// Writes O and lse directly (no split), or the partial (m, l, acc) rows at `partial_out` (decode split).
template <class T, class Arch, class Mask, class KV>
void flash_item(const flash_call<T, Mask, KV>& call, flash_scratch<accum_t<T>>& sc, index_t b, index_t h, index_t q0,
                index_t q1, index_t key_lo, index_t key_hi, accum_t<T>* partial_out) {
  using Acc = accum_t<T>;
  const problem& p = call.p;
  const flash_plan& f = call.plan;
  const auto& mask = for_head(call.mask, b, h);  // the (b, h) pattern of per-head masks (block_sparse)
  constexpr Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  const index_t h_kv = p.kv_head(h);
  const index_t qn = q1 - q0;

  // Packed Kᵀ/V of kv head (b, h_kv): the call's shared copy (already packed), or this thread's cache, packed
  // panel by panel on first use.
  Acc* kt_head = sc.kt.data();
  Acc* v_head = sc.v.data();
  // The per-panel flags (packed, V finite) belong to one kv head: forget them when the head changes.
  if (sc.cached_b != b || sc.cached_h != h_kv) {
    if (!call.packed) std::fill(sc.packed.begin(), sc.packed.begin() + f.panels, static_cast<unsigned char>(0));
    std::fill(sc.v_finite.begin(), sc.v_finite.begin() + f.panels, static_cast<signed char>(-1));
    sc.cached_b = b;
    sc.cached_h = h_kv;
  }
  if (call.packed) {
    kt_head = call.packed + (b * p.heads_kv + h_kv) * flash_scratch<Acc>::kv_elements(f, p.seq_kv);
    v_head = kt_head + f.panels * f.d * f.cols;
  }

  // Q tile (qn × d), converted to Acc. The scale is applied in the softmax, or by modify_row when the call's
  // score modifiers change the scores (then S holds base-2 logits and the softmax multiplies by 1).
  const Acc c_log2 = static_cast<Acc>(p.softmax_scale() * log2e);
  const bound_mods mods = mods_or_none(mask, 0);
  const bool modify = mods.changes_scores();
  const Acc c_softmax = modify ? Acc(1) : c_log2;
  const Acc sink2 = mods.template sink<Acc>(h) * static_cast<Acc>(log2e);
  for (index_t i = 0; i < qn; ++i) {
    const T* qr = call.q.row(b, h, q0 + i);
    Acc* dst = sc.q.data() + i * f.d;
    for (index_t c = 0; c < f.d; ++c) dst[c] = static_cast<Acc>(qr[c]);
  }
  if constexpr (cpu::pair_packers<Arch>::pairs) cpu::pair_packers<Arch>::prepare_q_pairs(sc.q.data(), qn, f.d);
  std::fill(sc.acc.begin(), sc.acc.begin() + qn * f.dp, Acc(0));
  std::fill(sc.m.begin(), sc.m.begin() + qn, neg_inf);
  std::fill(sc.l.begin(), sc.l.begin() + qn, Acc(0));

  // The kv tiles (core/mask_walk.hpp, key_tiles): the mask's key segments within this chunk [key_lo, key_hi), cut at
  // multiples of bkv; visit kt covers keys [k0, k1) = [kt, kt + bkv) ∩ its segment.
  key_tiles<Mask, 0, index_t> tiles(mask, q0, q1, f.bkv, {key_lo, key_hi});
  for (index_t kt = tiles.first(); kt >= 0; kt = tiles.next(kt)) {
    // The kv tile: keys [k0, k1). S is computed on the panel-aligned span [kb, ke) ⊇ [k0, k1); its columns
    // outside [k0, k1) are masked below.
    const index_t k0 = std::max(kt, tiles.seg_begin), k1 = std::min(kt + f.bkv, tiles.seg_end);
    const index_t kn = k1 - k0;
    const index_t kb = k0 / f.cols * f.cols, ke = round_up(k1, f.cols), width = ke - kb;
    if (!call.packed)
      for (index_t pn = kb / f.cols; pn < ke / f.cols; ++pn)
        if (!sc.packed[static_cast<std::size_t>(pn)]) {
          pack_panel<T, Arch>(call.kv, f, p.seq_kv, b, h_kv, pn, kt_head, v_head);
          sc.packed[static_cast<std::size_t>(pn)] = 1;
        }

    // S (qn × width) = Q (qn × d) · Kᵀ (d × width), panel by panel.
    cpu::qk_tile<Acc, Arch>(sc.q.data(), f.d, kt_head + kb * f.d, f.d, qn, width, sc.s.data(), f.lds);

    // Mask: columns outside [k0, k1) always; forbidden keys only on tiles the mask calls partial.
    const bool partial = mask.is_partial(q0, q1, k0, k1);
    const index_t j0 = k0 - kb, j1 = k1 - kb;
    for (index_t i = 0; i < qn; ++i) {
      Acc* srow = sc.s.data() + i * f.lds;
      // Score modifiers (softcap, ALiBi) on the whole panel-aligned row, before the mask sets −inf.
      if (modify) modify_row<Acc, Arch>(srow, width, static_cast<Acc>(p.softmax_scale()), mods, h, q0 + i, kb);
      for (index_t j = 0; j < j0; ++j) srow[j] = neg_inf;
      for (index_t j = j1; j < width; ++j) srow[j] = neg_inf;
      if (partial) mask_row(mask, q0 + i, kb, j0, j1, srow);
      // P row (1 × width) = 2^(scale·log2e·S − m_new); α = 2^(m_old − m_new); l = α·l + Σ P.
      sc.alpha[static_cast<std::size_t>(i)] = online_softmax_row<Acc, Arch>(
          srow, width, c_softmax, sc.m[static_cast<std::size_t>(i)], sc.l[static_cast<std::size_t>(i)]);
    }

    // acc (qn × dp) = diag(α)·acc + P (qn × kn) · V (kn × dp), P from column j0 on. A partial tile whose V
    // holds a non-finite value sums over the allowed keys only (0·NaN must not reach rows that skip the key).
    if (partial && !values_finite(call.kv, f, p.seq_kv, b, h_kv, k0, k1, sc))
      pv_tile_allowed(mask, call.kv, b, h_kv, q0, qn, k0, kn, f.d, sc.s.data() + j0, f.lds, sc.alpha.data(),
                      sc.acc.data(), f.dp);
    else
      cpu::pv_tile<Acc, Arch>(sc.s.data() + j0, f.lds, v_head + k0 * f.vw, p.seq_kv * f.vw, kn, f.dp,
                              sc.alpha.data(), sc.acc.data(), f.dp, qn);
  }

  // Finish: the sink logit joins l (online::add_sink; nothing when sinks are off), O = acc / l, lse = m·ln2 + ln l;
  // a row that saw no key gets O = 0, lse = −inf (or the sink's logit); one that met a NaN gets O = lse = NaN.
  // A decode-split part stores (m, l, acc) without the sink: merge_chunks adds it once.
  for (index_t i = 0; i < qn; ++i) {
    Acc m = sc.m[static_cast<std::size_t>(i)], l = sc.l[static_cast<std::size_t>(i)];
    const Acc* a = sc.acc.data() + i * f.dp;
    if (partial_out) {
      Acc* dst = partial_out + i * partial_row(f);
      dst[0] = m;
      dst[1] = l;
      std::memcpy(dst + 2, a, static_cast<std::size_t>(f.dp) * sizeof(Acc));
      continue;
    }
    T* orow = call.o.row(b, h, q0 + i);
    const Acc sink_alpha = online::add_sink(m, l, sink2);
    const Acc inv_l = online::inverse_sum(l) * sink_alpha;
    for (index_t c = 0; c < f.d; ++c) orow[c] = static_cast<T>(a[c] * inv_l);
    if (call.lse) call.lse[(b * p.heads + h) * p.seq_q + q0 + i] = online::lse(m, l);
  }
}

/// Decode split: merges the chunks' partial rows of one q-tile in chunk order (so the result does not depend on
/// which thread ran which chunk). `row` is d accumulators of scratch.
/// Math: M = max_c m_c; w_c = 2^(m_c − M); L = Σ w_c·l_c; then the sink joins (M, L) (online::add_sink);
/// O = Σ w_c·acc_c / L; lse = M·ln2 + ln L. A chunk that met a NaN (l_c = NaN) makes L = NaN, so O = lse = NaN.
template <class T, class Mask, class KV>
void merge_chunks(const flash_call<T, Mask, KV>& call, index_t b, index_t h, index_t q0, index_t q1,
                  const accum_t<T>* parts, accum_t<T>* row) {
  using Acc = accum_t<T>;
  const problem& p = call.p;
  const flash_plan& f = call.plan;
  const index_t stride_chunk = f.bq_pad * partial_row(f);
  const Acc sink2 = mods_or_none(call.mask, 0).template sink<Acc>(h) * static_cast<Acc>(log2e);
  for (index_t i = 0; i < q1 - q0; ++i) {
    Acc big_m = -std::numeric_limits<Acc>::infinity();
    bool saw_nan = false;
    for (index_t c = 0; c < f.chunks; ++c) {
      const Acc* part = parts + c * stride_chunk + i * partial_row(f);
      big_m = std::max(big_m, part[0]);
      saw_nan |= std::isnan(part[1]);
    }
    std::fill(row, row + f.d, Acc(0));
    Acc big_l = 0;
    if (saw_nan) {
      big_l = std::numeric_limits<Acc>::quiet_NaN();
    } else if (big_m != -std::numeric_limits<Acc>::infinity()) {
      for (index_t c = 0; c < f.chunks; ++c) {
        const Acc* part = parts + c * stride_chunk + i * partial_row(f);
        if (part[1] <= Acc(0)) continue;
        const Acc w = online::part_weight(part[0], part[1], big_m);
        big_l += w * part[1];
        for (index_t col = 0; col < f.d; ++col) row[col] += w * part[2 + col];
      }
    }
    T* orow = call.o.row(b, h, q0 + i);
    const Acc sink_alpha = online::add_sink(big_m, big_l, sink2);
    const Acc inv_l = online::inverse_sum(big_l) * sink_alpha;
    for (index_t col = 0; col < f.d; ++col) orow[col] = static_cast<T>(row[col] * inv_l);
    if (call.lse) call.lse[(b * p.heads + h) * p.seq_q + q0 + i] = online::lse(big_m, big_l);
  }
}

/// Whether a call with `threads` threads packs every kv head once into one shared buffer (in parallel, before
/// any tile) instead of one packed cache per thread: when there are fewer kv heads (b·h_kv) than threads, so that
/// several threads would otherwise pack the same head. The shared buffer is then smaller than the caches.
inline bool share_packed_kv(const problem& p, index_t threads) {
  return threads > 1 && p.batch * p.heads_kv < threads;
}

/// Bytes of scratch one call allocates: per-thread flash_scratch × threads (with a packed K/V cache each, or the
/// shared packed K/V of all b·h_kv heads once, see share_packed_kv), plus the decode split's partial results
/// (b·h·q-tiles·chunks·bq_pad·(dp + 2) accumulators) when the plan splits the keys.
template <class Acc, class Arch>
index_t scratch_bytes(const problem& p, const flash_plan& f, index_t threads) {
  const bool shared = share_packed_kv(p, threads);
  // + per panel: the v_finite flags, and the `packed` flags of the per-thread cache
  const index_t per_thread =
      flash_scratch<Acc>::elements(f, p.seq_kv, !shared) * index_t(sizeof(Acc)) + (shared ? 1 : 2) * f.panels;
  const index_t partials = f.chunks > 1 ? p.batch * p.heads * f.q_tiles() * f.chunks * f.bq_pad * partial_row(f) : 0;
  const index_t packed = shared ? p.batch * p.heads_kv * flash_scratch<Acc>::kv_elements(f, p.seq_kv) : 0;
  return threads * per_thread + (partials + packed) * index_t(sizeof(Acc));
}

/// The calling thread's scratch of type Scratch (flash_scratch, decode_scratch, backward_scratch): one per thread,
/// reused across calls (each kernel's allocate() grows it only when a call needs more).
template <class Scratch>
Scratch& thread_scratch() {
  static thread_local Scratch sc;
  return sc;
}

/// Sizes the calling thread's scratch by `allocate()` (which may throw std::bad_alloc), then agrees with its OpenMP
/// team: true when every thread of the team allocated. Every thread of the team calls it (it holds a barrier), so no
/// thread starts writing output before all have their scratch; `failed` is the team's shared flag, 0 before the
/// parallel region and 1 after it when any thread failed.
template <class Allocate>
bool team_allocated(int& failed, Allocate&& allocate) {
  try {
    allocate();
  } catch (const std::bad_alloc&) {
#if defined(_OPENMP)
#pragma omp atomic write
#endif
    failed = 1;
  }
  int any_failed = 0;
#if defined(_OPENMP)
#pragma omp barrier
#pragma omp atomic read
#endif
  any_failed = failed;
  return !any_failed;
}

/// The tile loop over every (batch, head, q-tile, key chunk), `threads` at a time.
/// Preconditions: the call was validated; tiles are >= 0; threads >= 1. Every thread sizes its scratch before any
/// output is written; if any allocation fails the call reports out_of_memory with nothing written.
/// K and V come from `kv`, a KV source (kv_source.hpp) holding p.seq_kv keys for each of the p.batch sequences.
template <class T, class Arch, class Mask, class KV>
status flash_tile_loop(const problem& p, const tensor_ref<const T>& q, const KV& kv, const tensor_ref<T>& o,
                       const Mask& mask, float* lse, int threads, tile_sizes tiles) {
  using Acc = accum_t<T>;
  flash_plan plan;
  std::vector<Acc> partial;
  line_vector<Acc> packed;
  bool shared = false;
  const index_t heads_total = p.batch * p.heads;
  index_t items = 0;
  int n_threads = 1;
  const auto oom = [&] {
    return status{errc::out_of_memory, "flash: cannot allocate " +
                                           std::to_string(scratch_bytes<Acc, Arch>(p, plan, n_threads)) +
                                           " bytes of scratch"};
  };
  try {
    plan = make_plan<Acc, Arch>(p, mask, tiles);
    items = heads_total * plan.q_tiles() * plan.chunks;
    n_threads = static_cast<int>(std::max<index_t>(1, std::min<index_t>(threads, items)));
    if (plan.chunks > 1) partial.resize(static_cast<std::size_t>(items * plan.bq_pad * partial_row(plan)));
    shared = share_packed_kv(p, n_threads);
    if (shared)
      packed.resize(static_cast<std::size_t>(p.batch * p.heads_kv * flash_scratch<Acc>::kv_elements(plan, p.seq_kv)));
  } catch (const std::bad_alloc&) {
    return oom();
  }
  Acc* const partial_rows = partial.empty() ? nullptr : partial.data();
  const flash_call<T, Mask, KV> call{p, q, kv, o, mask, lse, plan, partial_rows, shared ? packed.data() : nullptr};
  const index_t kv_heads = p.batch * p.heads_kv;
  const index_t head_elements = flash_scratch<Acc>::kv_elements(plan, p.seq_kv);
  const index_t q_tiles = plan.q_tiles();
  const index_t part_stride = plan.bq_pad * partial_row(plan);
  int failed = 0;

#if defined(_OPENMP)
#pragma omp parallel num_threads(n_threads)
#endif
  {
    // Every thread computes with subnormals flushed to zero, its own FP mode restored on exit (fp_env.hpp).
    const cpu::flush_denormals_scope flush_denormals;
    flash_scratch<Acc>& sc = thread_scratch<flash_scratch<Acc>>();
    if (team_allocated(failed, [&] { sc.allocate(plan, p.seq_kv, !shared); })) {
      if (call.packed) {
        // Shared packed K/V: every panel of every kv head once, split across the threads; the loop's implicit
        // barrier orders it before any tile reads it.
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (index_t hp = 0; hp < kv_heads * plan.panels; ++hp) {
          const index_t bh_kv = hp / plan.panels;
          Acc* kt_head = call.packed + bh_kv * head_elements;
          pack_panel<T, Arch>(kv, plan, p.seq_kv, bh_kv / p.heads_kv, bh_kv % p.heads_kv, hp % plan.panels, kt_head,
                     kt_head + plan.panels * plan.d * plan.cols);
        }
      }
#if defined(_OPENMP)
#pragma omp for schedule(guided)
#endif
      for (index_t item = 0; item < items; ++item) {
        // item = ((b·heads + h)·q_tiles + qt)·chunks + c: heads sharing a kv head are adjacent, and guided
        // scheduling hands out long runs of adjacent items first (packed K/V reuse), short ones last (balance).
        const index_t c = item % plan.chunks;
        const index_t qt = (item / plan.chunks) % q_tiles;
        const index_t bh = item / (plan.chunks * q_tiles);
        const index_t key_lo = c * plan.chunk, key_hi = std::min(p.seq_kv, key_lo + plan.chunk);
        flash_item<T, Arch, Mask, KV>(call, sc, bh / p.heads, bh % p.heads, plan.q_start[static_cast<std::size_t>(qt)],
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
  }
  if (failed) return oom();
  return {};
}

}  // namespace kernels
}  // namespace fusedattn
