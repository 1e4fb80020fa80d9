/// @file backward.hpp
/// The CPU backward pass of attention (dQ, dK, dV from Q, K, V, O, dO and the forward's lse) by recomputation,
/// FlashAttention-2 style: a column walk over kv tiles, deterministic for any thread count. Entry point for users:
/// dispatch/backward.hpp (attend_backward), which validates first.
///
/// Math, per (batch, head), with P = exp(scale·Q·Kᵀ − lse) on the allowed entries and 0 elsewhere:
///   δ_i = Σ_c dO[i][c]·O[i][c];  dV = Pᵀ·dO;  dP = dO·Vᵀ;  dS = P ∘ (dP − δ);  dK = scale·dSᵀ·Q;  dQ = scale·dS·K.
/// GQA / MQA: dK and dV of a kv head sum over the query heads that read it.
/// Score modifiers (core/score_mod.hpp): S is the modified score s' = cap(scale·q·k) + bias (recomputed, ALiBi too),
/// P = exp(s' − lse) with the forward's lse (which includes the sink), and softcap's chain rule scales dS by
/// cap'(x) = 1 − (cap(x) / softcap)²: dS = P ∘ (dP − δ) ∘ cap'. A sink adds a softmax entry without a value row, so
/// δ and dS keep their form, and d sink_h = −Σ_{b,i} exp(sink_h − lse_{b,h,i})·δ_{b,h,i} (written when sinks.grad is
/// not null, summed in a fixed order).
///
/// Schedule and determinism (no atomics; every output element has one summation order fixed by the problem):
///   1. Per query row (one thread per row): δ, lse·log2e, and Q and dO converted to the accumulation type once
///      (zero rows for rows that saw no key), for every kv tile to read.
///   2. Work items (b, h_kv, chunk c): the item owns the kv tiles t ≡ c (mod chunks) of kv head (b, h_kv) (tiles
///      interleaved so causal masks balance). Per tile it visits the query heads of the group in ascending order
///      and, per head, the q tiles that see the tile (mask.q_range / mask.sees: the column walk) in ascending
///      order; dK and dV of the tile sum in that order in scratch and are written once. The tile's dS·K goes to
///      the item's own partial dQ rows (chunk c), zeroed by the item first.
///   3. dQ = scale · Σ_c partial_c in ascending c, one thread per row.
///   The chunk count depends on the problem only (cpu::backward_tiles), never on the thread count.
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
#include "../cpu/backward_kernels.hpp"
#include "../cpu/fp_env.hpp"
#include "../cpu/simd.hpp"
#include "../cpu/tiles.hpp"
#include "mask.hpp"
#include "softmax.hpp"
#include "tile_loop.hpp"

namespace fusedattn {
namespace cpu {

/// Query rows per tile of the backward pass.
inline constexpr index_t backward_q_tile_rows = 64;
/// Keys per tile of the backward pass: the dK and dV tiles (keys × head_dim) stay in L2 beside the packed K, Kᵀ
/// and Vᵀ. 128 up to head_dim 128, 64 beyond.
inline constexpr index_t backward_kv_tile_keys(index_t d) { return d <= 128 ? 128 : 64; }
/// Work items the chunking aims at (kv chunks per kv head × kv heads): enough for 16 threads to balance.
inline constexpr index_t backward_target_items = 32;
/// The partial dQ buffers (chunks × the size of dQ in the accumulation type) are kept under this many bytes
/// unless one chunk alone needs more.
inline constexpr index_t backward_partial_cap_bytes = index_t(256) << 20;

}  // namespace cpu

namespace kernels {

/// Sizes the backward pass derives from the problem (never from the thread count).
struct backward_plan {
  index_t d = 0;         ///< head_dim
  index_t dp = 0;        ///< head_dim padded to the vector width (row stride of every head_dim-wide tile)
  index_t bq = 0;        ///< most query rows per tile
  index_t bkv = 0;       ///< keys per kv tile (the last one may be shorter)
  index_t ldk = 0;       ///< bkv padded to the vector width (row stride of S, P, dS, Kᵀ, Vᵀ)
  index_t kv_tiles = 0;  ///< ceil(seq_kv / bkv)
  index_t chunks = 1;    ///< kv chunks per kv head (= partial dQ buffers)
  std::vector<index_t> q_start;  ///< q-tile boundaries: tile t is rows [q_start[t], q_start[t + 1])

  index_t q_tiles() const { return static_cast<index_t>(q_start.size()) - 1; }
};

/// Builds the backward plan: user tile sizes (0: the defaults above), q-tiles cut at the mask's q_granule.
template <class Acc, class Arch, class Mask>
backward_plan make_backward_plan(const problem& p, const Mask& mask, tile_sizes user) {
  constexpr index_t W = cpu::simd<Acc, Arch>::width;
  backward_plan f;
  f.d = p.head_dim;
  f.dp = round_up(p.head_dim, W);
  f.bq = std::min(user.q > 0 ? user.q : cpu::backward_q_tile_rows, p.seq_q);
  f.bkv = std::min(user.kv > 0 ? user.kv : cpu::backward_kv_tile_keys(p.head_dim), p.seq_kv);
  f.ldk = round_up(f.bkv, W);
  f.kv_tiles = (p.seq_kv + f.bkv - 1) / f.bkv;
  const index_t kv_heads = p.batch * p.heads_kv;
  const index_t per_chunk = p.batch * p.heads * p.seq_q * f.dp * index_t(sizeof(Acc));
  const index_t by_items = std::max<index_t>(1, cpu::backward_target_items / kv_heads);
  const index_t by_memory = std::max<index_t>(1, cpu::backward_partial_cap_bytes / std::max<index_t>(1, per_chunk));
  f.chunks = std::max<index_t>(1, std::min({f.kv_tiles, by_items, by_memory}));
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

/// Per-thread working memory of the backward pass (sizes fixed by the plan).
template <class Acc>
struct backward_scratch {
  line_vector<Acc> s, ds;        ///< bq × ldk: S then P; dP then dS
  line_vector<Acc> k;            ///< bkv × dp: the K tile
  line_vector<Acc> kt, vt;       ///< d × ldk: Kᵀ and Vᵀ of the tile, zero past its keys
  line_vector<Acc> dk, dv;       ///< bkv × dp: the tile's unscaled dK and its dV
  line_vector<Acc> cap_grad;     ///< bq × ldk: softcap's chain-rule factor per score (only with softcap)

  static index_t elements(const backward_plan& f) {
    return 3 * f.bq * f.ldk + f.bkv * f.dp + 2 * f.d * f.ldk + 2 * f.bkv * f.dp;
  }
  void allocate(const backward_plan& f) {
    auto grow = [](auto& buf, index_t n) {
      if (buf.size() < static_cast<std::size_t>(n)) buf.resize(static_cast<std::size_t>(n));
    };
    grow(s, f.bq * f.ldk);
    grow(ds, f.bq * f.ldk);
    grow(k, f.bkv * f.dp);
    grow(kt, f.d * f.ldk);
    grow(vt, f.d * f.ldk);
    grow(dk, f.bkv * f.dp);
    grow(dv, f.bkv * f.dp);
    grow(cap_grad, f.bq * f.ldk);
  }
};

/// Per-row buffers of one call, shared by its threads: Q and dO in Acc, δ, lse·log2e, row flags, and the partial
/// dQ of every chunk. Kept by the calling thread between calls (buffers only grow; see backward_buffers_of).
template <class Acc>
struct backward_buffers {
  line_vector<Acc> q, d_o;         ///< rows × dp: Q and dO converted, zero for rows that saw no key and past d
  line_vector<Acc> delta, lse2;    ///< rows: δ and lse·log2e
  std::vector<unsigned char> flags;  ///< rows: row_live | row_finite
  line_vector<Acc> partial;        ///< chunks × rows × dp: [chunk][b][h][i][dp]

  static constexpr unsigned char row_live = 1;    ///< the row saw a key (lse > −inf)
  static constexpr unsigned char row_finite = 2;  ///< the row's Q and dO are finite

  static index_t elements(const problem& p, const backward_plan& f) {
    const index_t rows = p.batch * p.heads * p.seq_q;
    return (2 + f.chunks) * rows * f.dp + 2 * rows;
  }
  void allocate(const problem& p, const backward_plan& f) {
    const index_t rows = p.batch * p.heads * p.seq_q;
    auto grow = [](auto& buf, index_t n) {
      if (buf.size() < static_cast<std::size_t>(n)) buf.resize(static_cast<std::size_t>(n));
    };
    grow(q, rows * f.dp);
    grow(d_o, rows * f.dp);
    grow(delta, rows);
    grow(lse2, rows);
    grow(flags, rows);
    grow(partial, f.chunks * rows * f.dp);
  }
};

/// The calling thread's backward_buffers (reused across calls, so that a call touches no fresh pages once the
/// buffers are large enough; they are freed when the thread ends).
template <class Acc>
backward_buffers<Acc>& backward_buffers_of_this_thread() {
  static thread_local backward_buffers<Acc> buffers;
  return buffers;
}

/// Bytes of scratch one backward call allocates: per thread backward_scratch, plus the call's backward_buffers
/// (about (2 + chunks) × the size of dQ in the accumulation type).
template <class Acc>
index_t backward_scratch_bytes(const problem& p, const backward_plan& f, index_t threads) {
  return (threads * backward_scratch<Acc>::elements(f) + backward_buffers<Acc>::elements(p, f)) *
             index_t(sizeof(Acc)) +
         p.batch * p.heads * p.seq_q;
}

/// The state shared by all threads of one backward call.
template <class T, class Mask>
struct backward_call {
  const problem& p;
  const tensor_ref<const T>& q;
  const tensor_ref<const T>& k;
  const tensor_ref<const T>& v;
  const tensor_ref<const T>& o;
  const tensor_ref<const T>& d_o;
  const float* lse;
  const tensor_ref<T>& dq;
  const tensor_ref<T>& dk;
  const tensor_ref<T>& dv;
  const Mask& mask;
  const backward_plan& plan;
  backward_buffers<accum_t<T>>& rows;
};

/// Whether none of the n values at x is NaN or ±inf.
template <class Acc>
bool finite_values(const Acc* x, index_t n) {
  bool ok = true;
  for (index_t i = 0; i < n; ++i) ok &= std::isfinite(x[i]);
  return ok;
}

/// Sets row entries j in [0, kn) to 0 where the mask forbids key k0 + j for query row i. A one-segment mask
/// (mask_traits) allows one interval of keys per row, band_rule::columns: two fills; any other mask, one allowed()
/// call per element.
template <class Acc, class Mask>
inline void zero_forbidden(const Mask& mask, index_t i, index_t k0, index_t kn, Acc* row) {
  if constexpr (mask_traits<Mask>::one_segment) {
    index_t c_lo = 0, c_hi = 0;
    mask.element_band().rule().columns(i, k0, k0, k0 + kn, c_lo, c_hi);
    const index_t lo = std::min(c_lo, kn), hi = std::max(c_hi, lo);
    std::fill(row, row + lo, Acc(0));
    std::fill(row + hi, row + kn, Acc(0));
  } else {
    for (index_t j = 0; j < kn; ++j)
      if (!mask.allowed(i, k0 + j)) row[j] = Acc(0);
  }
}

/// One (q tile, kv tile) pair of head (b, h): rows [q0, q1) against the tile packed in `sc` (keys [k0, k0 + kn)).
/// Adds to the tile's dK and dV in scratch and to rows [q0, q1) of the partial dQ at `dq_part` (row stride dp).
template <class T, class Arch, class Mask>
void backward_pair(const backward_call<T, Mask>& call, backward_scratch<accum_t<T>>& sc, const Mask& mask, index_t b,
                   index_t h, index_t q0, index_t q1, index_t k0, index_t kn, bool k_finite, accum_t<T>* dq_part) {
  using Acc = accum_t<T>;
  using V = cpu::simd<Acc, Arch>;
  using vec = typename V::type;
  constexpr index_t W = V::width;
  const problem& p = call.p;
  const backward_plan& f = call.plan;
  const index_t qn = q1 - q0;
  const index_t kvec = (kn + W - 1) / W, dvec = f.dp / W;
  const Acc c = static_cast<Acc>(p.softmax_scale() * log2e);

  // The Q and dO tiles (qn × dp) and the row values, packed by the call's first pass.
  using buffers = backward_buffers<Acc>;
  const index_t row0 = (b * p.heads + h) * p.seq_q + q0;
  const Acc* q_tile = call.rows.q.data() + row0 * f.dp;
  const Acc* do_tile = call.rows.d_o.data() + row0 * f.dp;
  const Acc* lse2 = call.rows.lse2.data() + row0;
  const Acc* delta = call.rows.delta.data() + row0;
  const unsigned char* flags = call.rows.flags.data() + row0;
  const auto live = [&](index_t i) { return (flags[i] & buffers::row_live) != 0; };

  // S (qn × kvec·W) = Q (qn × d) · Kᵀ (d × kvec·W); then P = 2^(c·S − lse·log2e) in place. With score modifiers
  // S first becomes the base-2 modified logits (modify_row, with softcap's chain-rule factor) and c is 1.
  cpu::abt_tile<Acc, Arch>(q_tile, f.dp, sc.kt.data(), f.ldk, f.d, qn, kvec, sc.s.data(), f.ldk);
  const bool partial = mask.is_partial(q0, q1, k0, k0 + kn);
  const bound_mods mods = mods_or_none(mask, 0);
  const bool modify = mods.changes_scores(), capped = mods.softcap != 0.f;
  const vec vc = V::broadcast(modify ? Acc(1) : c);
  for (index_t i = 0; i < qn; ++i) {
    Acc* srow = sc.s.data() + i * f.ldk;
    if (!live(i)) {
      std::fill(srow, srow + kvec * W, Acc(0));
      continue;
    }
    if (modify)
      modify_row<Acc, Arch>(srow, kvec * W, static_cast<Acc>(p.softmax_scale()), mods, h, q0 + i, k0,
                            capped ? sc.cap_grad.data() + i * f.ldk : nullptr);
    const vec neg_lse = V::broadcast(-lse2[i]);
    for (index_t j = 0; j < kvec * W; j += W) V::store(srow + j, V::exp2(V::fma(V::load(srow + j), vc, neg_lse)));
    std::fill(srow + kn, srow + kvec * W, Acc(0));
    if (partial) zero_forbidden(mask, q0 + i, k0, kn, srow);
  }

  // dP (qn × kvec·W) = dO (qn × d) · Vᵀ (d × kvec·W); then dS = P ∘ (dP − δ) (∘ cap' with softcap) in place
  // (forbidden entries exactly 0, whatever dP holds, so that a non-finite value never reaches a gradient through a
  // masked entry).
  cpu::abt_tile<Acc, Arch>(do_tile, f.dp, sc.vt.data(), f.ldk, f.d, qn, kvec, sc.ds.data(), f.ldk);
  for (index_t i = 0; i < qn; ++i) {
    Acc* drow = sc.ds.data() + i * f.ldk;
    if (!live(i)) {
      std::fill(drow, drow + kvec * W, Acc(0));
      continue;
    }
    const Acc* prow = sc.s.data() + i * f.ldk;
    const vec vdelta = V::broadcast(delta[i]);
    for (index_t j = 0; j < kvec * W; j += W)
      V::store(drow + j, V::mul(V::load(prow + j), V::sub(V::load(drow + j), vdelta)));
    if (capped) {
      const Acc* cg = sc.cap_grad.data() + i * f.ldk;
      for (index_t j = 0; j < kvec * W; j += W) V::store(drow + j, V::mul(V::load(drow + j), V::load(cg + j)));
    }
    std::fill(drow + kn, drow + kvec * W, Acc(0));
    if (partial) zero_forbidden(mask, q0 + i, k0, kn, drow);
  }

  bool rows_finite = true;
  if (partial)
    for (index_t i = 0; i < qn; ++i) rows_finite &= (flags[i] & buffers::row_finite) != 0;
  if (partial && !(rows_finite && k_finite)) {
    // A partial tile with a non-finite Q, dO or K value: the GEMMs would multiply a masked entry's exact 0 with
    // it (0·NaN = NaN) and reach gradients the value does not touch. Sum over the allowed entries only.
    for (index_t j = 0; j < kn; ++j) {
      Acc* dvr = sc.dv.data() + j * f.dp;
      Acc* dkr = sc.dk.data() + j * f.dp;
      for (index_t i = 0; i < qn; ++i) {
        if (!live(i) || !mask.allowed(q0 + i, k0 + j)) continue;
        const Acc p_ij = sc.s[static_cast<std::size_t>(i * f.ldk + j)], ds_ij = sc.ds[static_cast<std::size_t>(i * f.ldk + j)];
        for (index_t x = 0; x < f.d; ++x) {
          dvr[x] += p_ij * do_tile[i * f.dp + x];
          dkr[x] += ds_ij * q_tile[i * f.dp + x];
        }
      }
    }
    for (index_t i = 0; i < qn; ++i) {
      if (!live(i)) continue;
      Acc* dqr = dq_part + (q0 + i) * f.dp;
      for (index_t j = 0; j < kn; ++j) {
        if (!mask.allowed(q0 + i, k0 + j)) continue;
        const Acc ds_ij = sc.ds[static_cast<std::size_t>(i * f.ldk + j)];
        for (index_t x = 0; x < f.d; ++x) dqr[x] += ds_ij * sc.k[static_cast<std::size_t>(j * f.dp + x)];
      }
    }
    return;
  }
  // dV (kn × dp) += Pᵀ (kn × qn) · dO (qn × dp);  dK (kn × dp) += dSᵀ (kn × qn) · Q (qn × dp).
  cpu::acc_tile<Acc, Arch>(sc.s.data(), 1, f.ldk, do_tile, f.dp, qn, kn, dvec, sc.dv.data(), f.dp);
  cpu::acc_tile<Acc, Arch>(sc.ds.data(), 1, f.ldk, q_tile, f.dp, qn, kn, dvec, sc.dk.data(), f.dp);
  // dQ rows (qn × dp) += dS (qn × kn) · K (kn × dp).
  cpu::acc_tile<Acc, Arch>(sc.ds.data(), f.ldk, 1, sc.k.data(), f.dp, kn, qn, dvec, dq_part + q0 * f.dp, f.dp);
}

/// One work item: kv chunk `chunk` of kv head (b, h_kv) (see the file comment).
template <class T, class Arch, class Mask>
void backward_item(const backward_call<T, Mask>& call, backward_scratch<accum_t<T>>& sc, index_t b, index_t h_kv,
                   index_t chunk) {
  using Acc = accum_t<T>;
  constexpr index_t W = cpu::simd<Acc, Arch>::width;
  const problem& p = call.p;
  const backward_plan& f = call.plan;
  const index_t group = p.group_size(), h_first = h_kv * group;
  const index_t head_rows = p.seq_q * f.dp;
  // This chunk's partial dQ of the group's query heads (adjacent), zeroed first.
  Acc* part = call.rows.partial.data() + ((chunk * p.batch + b) * p.heads + h_first) * head_rows;
  std::fill(part, part + group * head_rows, Acc(0));
  const Acc scale = static_cast<Acc>(p.softmax_scale());

  for (index_t t = chunk; t < f.kv_tiles; t += f.chunks) {
    const index_t k0 = t * f.bkv, kn = std::min(f.bkv, p.seq_kv - k0), kpad = round_up(kn, W);
    // Pack the tile: K (kn × dp), Kᵀ and Vᵀ (d × ldk, zero from key kn to the vector boundary).
    for (index_t j = 0; j < kn; ++j) {
      const T* kr = call.k.row(b, h_kv, k0 + j);
      const T* vr = call.v.row(b, h_kv, k0 + j);
      Acc* kd = sc.k.data() + j * f.dp;
      for (index_t x = 0; x < f.d; ++x) {
        const Acc kx = static_cast<Acc>(kr[x]);
        kd[x] = kx;
        sc.kt[static_cast<std::size_t>(x * f.ldk + j)] = kx;
        sc.vt[static_cast<std::size_t>(x * f.ldk + j)] = static_cast<Acc>(vr[x]);
      }
      std::fill(kd + f.d, kd + f.dp, Acc(0));
    }
    for (index_t x = 0; x < f.d; ++x) {
      std::fill(sc.kt.data() + x * f.ldk + kn, sc.kt.data() + x * f.ldk + kpad, Acc(0));
      std::fill(sc.vt.data() + x * f.ldk + kn, sc.vt.data() + x * f.ldk + kpad, Acc(0));
    }
    bool k_finite = true;
    for (index_t j = 0; j < kn; ++j) k_finite &= finite_values(sc.k.data() + j * f.dp, f.d);
    std::fill(sc.dk.data(), sc.dk.data() + kn * f.dp, Acc(0));
    std::fill(sc.dv.data(), sc.dv.data() + kn * f.dp, Acc(0));

    // The column walk: per query head of the group, the q tiles that see keys [k0, k0 + kn), ascending.
    for (index_t g = 0; g < group; ++g) {
      const index_t h = h_first + g;
      const auto& mask = for_head(call.mask, b, h);
      const listed_q_tiles q_tiles{f.q_start.data(), static_cast<index_t>(f.q_start.size()) - 1};
      q_tile_walk<listed_q_tiles> walk(mask, q_tiles, k0, k0 + kn);
      for (kv_span rows; walk.next(mask, rows);)
        backward_pair<T, Arch>(call, sc, mask, b, h, rows.begin, rows.end, k0, kn, k_finite, part + g * head_rows);
    }

    // dK = scale · Σ dSᵀ·Q, dV = Σ Pᵀ·dO of the tile, written once.
    for (index_t j = 0; j < kn; ++j) {
      T* dkr = call.dk.row(b, h_kv, k0 + j);
      T* dvr = call.dv.row(b, h_kv, k0 + j);
      const Acc* sk = sc.dk.data() + j * f.dp;
      const Acc* sv = sc.dv.data() + j * f.dp;
      for (index_t x = 0; x < f.d; ++x) {
        dkr[x] = static_cast<T>(scale * sk[x]);
        dvr[x] = static_cast<T>(sv[x]);
      }
    }
  }
}

/// The backward pass over every (batch, kv head, kv chunk), `threads` at a time (see the file comment).
/// Preconditions: the call was validated; tiles >= 0; threads >= 1. Scratch is allocated before anything is
/// written; on failure the call reports out_of_memory with nothing written.
template <class T, class Arch, class Mask>
status flash_backward_loop(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                           const tensor_ref<const T>& v, const tensor_ref<const T>& o,
                           const tensor_ref<const T>& d_o, const float* lse, const tensor_ref<T>& dq,
                           const tensor_ref<T>& dk, const tensor_ref<T>& dv, const Mask& mask, int threads,
                           tile_sizes tiles) {
  using Acc = accum_t<T>;
  backward_plan plan;
  backward_buffers<Acc>& buffers = backward_buffers_of_this_thread<Acc>();
  index_t items = 0;
  int n_threads = 1;
  const index_t rows = p.batch * p.heads * p.seq_q;
  const auto oom = [&] {
    return status{errc::out_of_memory, "backward: cannot allocate " +
                                           std::to_string(backward_scratch_bytes<Acc>(p, plan, n_threads)) +
                                           " bytes of scratch"};
  };
  try {
    plan = make_backward_plan<Acc, Arch>(p, mask, tiles);
    items = p.batch * p.heads_kv * plan.chunks;
    n_threads = static_cast<int>(std::max<index_t>(1, std::min<index_t>(threads, std::max(items, rows))));
    buffers.allocate(p, plan);
  } catch (const std::bad_alloc&) {
    return oom();
  }
  const backward_call<T, Mask> call{p, q, k, v, o, d_o, lse, dq, dk, dv, mask, plan, buffers};
  const Acc scale = static_cast<Acc>(p.softmax_scale());
  const index_t chunk_stride = rows * plan.dp;
  int failed = 0;

#if defined(_OPENMP)
#pragma omp parallel num_threads(n_threads)
#endif
  {
    const cpu::flush_denormals_scope flush_denormals;
    backward_scratch<Acc>& sc = thread_scratch<backward_scratch<Acc>>();
    if (team_allocated(failed, [&] { sc.allocate(plan); })) {
      // 1. Per row: δ_i = Σ_c dO[i][c]·O[i][c], lse·log2e, Q and dO in Acc (zero for a row that saw no key, and
      //    past d), the row's flags.
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
      for (index_t row = 0; row < rows; ++row) {
        const index_t i = row % p.seq_q, h = row / p.seq_q % p.heads, b = row / p.seq_q / p.heads;
        const bool live = lse[row] != -std::numeric_limits<float>::infinity();
        Acc* qr = buffers.q.data() + row * plan.dp;
        Acc* dr = buffers.d_o.data() + row * plan.dp;
        std::fill(qr, qr + plan.dp, Acc(0));
        std::fill(dr, dr + plan.dp, Acc(0));
        Acc sum = 0;
        if (live) {
          const T* qs = q.row(b, h, i);
          const T* os = o.row(b, h, i);
          const T* ds = d_o.row(b, h, i);
          for (index_t x = 0; x < p.head_dim; ++x) {
            qr[x] = static_cast<Acc>(qs[x]);
            dr[x] = static_cast<Acc>(ds[x]);
            sum += dr[x] * static_cast<Acc>(os[x]);
          }
        }
        buffers.delta[static_cast<std::size_t>(row)] = sum;
        buffers.lse2[static_cast<std::size_t>(row)] = static_cast<Acc>(lse[row]) * static_cast<Acc>(log2e);
        const bool finite = finite_values(qr, p.head_dim) && finite_values(dr, p.head_dim);
        buffers.flags[static_cast<std::size_t>(row)] =
            static_cast<unsigned char>((live ? backward_buffers<Acc>::row_live : 0) |
                                       (finite ? backward_buffers<Acc>::row_finite : 0));
      }
      // The sink logits' gradient: d sink_h = −Σ_{b,i} exp(sink_h − lse_{b,h,i})·δ_{b,h,i}, one thread per head,
      // rows in ascending order.
      const bound_mods mods = mods_or_none(mask, 0);
      if (mods.sink_logits && mods.sink_grad) {
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (index_t h = 0; h < p.heads; ++h) {
          const Acc sink = mods.sink<Acc>(h);
          Acc sum = 0;
          for (index_t b = 0; b < p.batch; ++b)
            for (index_t i = 0; i < p.seq_q; ++i) {
              const index_t row = (b * p.heads + h) * p.seq_q + i;
              if (lse[row] == -std::numeric_limits<float>::infinity()) continue;  // a −inf sink, no key: nothing
              sum += std::exp(sink - static_cast<Acc>(lse[row])) * buffers.delta[static_cast<std::size_t>(row)];
            }
          mods.sink_grad[h] = static_cast<float>(-sum);
        }
      }
      // 2. dK, dV per kv tile and the partial dQ per chunk.
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
      for (index_t item = 0; item < items; ++item) {
        const index_t c = item % plan.chunks, bh_kv = item / plan.chunks;
        backward_item<T, Arch, Mask>(call, sc, bh_kv / p.heads_kv, bh_kv % p.heads_kv, c);
      }
      // 3. dQ = scale · Σ_c partial_c, ascending c; 0 for rows that saw no key.
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
      for (index_t row = 0; row < rows; ++row) {
        const index_t i = row % p.seq_q, h = row / p.seq_q % p.heads, b = row / p.seq_q / p.heads;
        T* out = dq.row(b, h, i);
        Acc* sum = sc.dk.data();  // one row of scratch
        std::fill(sum, sum + p.head_dim, Acc(0));
        if (lse[row] != -std::numeric_limits<float>::infinity())
          for (index_t c = 0; c < plan.chunks; ++c) {
            const Acc* part = buffers.partial.data() + c * chunk_stride + row * plan.dp;
            for (index_t x = 0; x < p.head_dim; ++x) sum[x] += part[x];
          }
        for (index_t x = 0; x < p.head_dim; ++x) out[x] = static_cast<T>(scale * sum[x]);
      }
    }
  }
  if (failed) return oom();
  return {};
}

/// Backward pass of flash attention on the CPU with the SIMD arch `Arch`: dQ, dK, dV of
/// O = softmax(scale·Q·Kᵀ + mask)·V given O, dO and the forward's lse. Results are bitwise identical for any
/// thread count. Preconditions: the call was validated (dispatch/backward.hpp). Returns errc::invalid_argument
/// for threads < 1 or a negative tile size, errc::unsupported when this CPU cannot run `Arch`,
/// errc::out_of_memory when the scratch cannot be allocated; nothing is written on failure.
template <class T, class Arch, class Mask>
status flash_backward(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                      const tensor_ref<const T>& v, const tensor_ref<const T>& o, const tensor_ref<const T>& d_o,
                      const float* lse, const tensor_ref<T>& dq, const tensor_ref<T>& dk, const tensor_ref<T>& dv,
                      const Mask& mask, int threads, tile_sizes tiles = {}) {
  if (threads <= 0)
    return status::invalid("policy.threads is " + std::to_string(threads) + "; it must be >= 1");
  if (tiles.q < 0 || tiles.kv < 0)
    return status::invalid("policy.tiles.q / policy.tiles.kv are " + std::to_string(tiles.q) + " / " +
                           std::to_string(tiles.kv) + "; they must be >= 0 (0 chooses by heuristic)");
  if (!cpu::arch_available<Arch>())
    return {errc::unsupported, std::string("this CPU cannot run the ") + Arch::name() +
                                   " code of policy::cpu<Arch>; pick an arch it supports"};
  return flash_backward_loop<T, Arch, Mask>(p, q, k, v, o, d_o, lse, dq, dk, dv, mask, threads, tiles);
}

}  // namespace kernels
}  // namespace fusedattn
