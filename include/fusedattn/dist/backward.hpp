/// @file backward.hpp
/// dist::attend_backward: the backward pass of dist::attend over the same shards (ring with the dK/dV accumulators
/// travelling beside their K/V shard, or all-gather of K/V then a ring reduce-scatter of dK/dV). Each block runs
/// fusedattn::attend_backward with the global O and lse rows. Includes dist/attend.hpp; pair it with an engine.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../core/problem.hpp"
#include "../core/status.hpp"
#include "../core/tensor.hpp"
#include "../dispatch/backward.hpp"
#include "../dispatch/policy.hpp"
#include "../kernels/mask.hpp"
#include "attend.hpp"
#include "comm.hpp"

namespace fusedattn {
namespace dist {
namespace detail {

/// The backward schedule, on validated input that every rank agreed on. Writes dq, dk and dv only when every step
/// succeeded on every rank.
///
/// Why a block's attend_backward is exactly its share of the gradient: with P = exp(s − lse) formed from the GLOBAL
/// lse and δ = rowsum(dO∘O) from the global O, dS = P∘(dP − δ) restricted to a block's keys is the block of the
/// whole problem's dS; dQ sums over key blocks, dK and dV over query blocks.
///
/// Ring: step i computes on the K/V shard of rank r − i. dQ accumulates here (accum_t<T>); the shard's dK/dV
/// accumulator arrives from rank r − 1 during the step's compute (it holds the ranks r − i .. r − 1 so far), gains
/// this rank's part and leaves for rank r + 1 with the next step; after the last step one more hop takes every
/// accumulator home. Both transfers of a step overlap its compute.
/// All-gather: K and V gathered in global order as the forward does, this rank's dK/dV over the whole sequence, then
/// a reduce-scatter: N − 1 hops, each adding this rank's part of the shard that arrived.
template <class Comm, class Exec, class Policy, class T>
status run_backward(Comm& comm, Exec& ex, const Policy& pol, const problem& g, const tensor_ref<const T>& q,
                    const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<const T>& o,
                    const tensor_ref<const T>& d_o, const float* lse, const tensor_ref<T>& dq,
                    const tensor_ref<T>& dk, const tensor_ref<T>& dv, bool is_causal, const options& opt,
                    std::uint64_t fp, timings* tm) {
  using acc_t = accum_t<T>;
  using clock = std::chrono::steady_clock;
  constexpr const char* who = "dist::attend_backward";
  const auto t_start = clock::now();
  const int n = comm.size(), r = comm.rank();
  const problem lp = shard_problem(g, n);
  const index_t lq = lp.seq_q, lkv = lp.seq_kv;
  const index_t kv_elems = g.batch * g.heads_kv * lkv * g.head_dim;     // one shard of K (or V)
  const index_t all_kv_elems = g.batch * g.heads_kv * g.seq_kv * g.head_dim;  // the whole of K (or V)
  const bool gather = opt.strategy == strategy::all_gather ||
                      (opt.strategy == strategy::automatic && g.heads_kv < g.heads);
  // The K/V rows one block's dK/dV parts can cover: a shard (ring) or the whole sequence (all-gather).
  const index_t part_kv_elems = gather ? all_kv_elems : kv_elems;

  // Every buffer first, then one agreement (as dist::attend).
  acc_t* dq_acc = nullptr;                // this rank's dQ so far
  T *part_dq = nullptr, *part_kv = nullptr;  // one block's dQ, and its dK then dV (as attend_backward writes them)
  float* part_lse = nullptr;               // a block's lse rows, packed, when it takes fewer than all rows
  T* buf[2] = {nullptr, nullptr};          // ring: the K/V shard computed on and the one arriving
  acc_t* dkv[2] = {nullptr, nullptr};      // ring: dK then dV accumulators of a shard (the current, the arriving);
                                           // all-gather: the reduce-scatter's outgoing and arriving sums
  T *all = nullptr, *gk = nullptr, *gv = nullptr;  // all-gather: one K/V slot per rank, K and V in global order
  acc_t* g_acc = nullptr;                  // all-gather: this rank's dK then dV over the whole sequence
  status st = ex.allocate(dq_acc, lp.batch * lp.heads * lq * lp.head_dim);
  auto keep = [&st](const status& s) {  // the first failure is the one reported
    if (st) st = s;
  };
  keep(ex.allocate(part_dq, lp.batch * lp.heads * lq * lp.head_dim));
  keep(ex.allocate(part_kv, 2 * part_kv_elems));
  keep(ex.allocate(part_lse, lp.lse_size()));
  keep(ex.allocate(dkv[0], 2 * kv_elems));
  keep(ex.allocate(dkv[1], 2 * kv_elems));
  if (!gather) {
    keep(ex.allocate(buf[0], 2 * kv_elems));
    keep(ex.allocate(buf[1], 2 * kv_elems));
  } else {
    keep(ex.allocate(all, index_t(n) * 2 * kv_elems));
    keep(ex.allocate(gk, all_kv_elems));
    keep(ex.allocate(gv, all_kv_elems));
    keep(ex.allocate(g_acc, 2 * all_kv_elems));
  }
  if (status s = agree(comm, st, fp, who); !s) return s;
  // From here on a failing step stops this rank's compute but not its transfers; the agreement at the end tells
  // every rank. A failing transfer is returned at once.
  keep(ex.zero(dq_acc, lp.batch * lp.heads * lq * lp.head_dim));
  const tensor_ref<acc_t> dq_sum = bhsd(dq_acc, lp.q_dims());
  const tensor_ref<const float> lse_view{lse, {g.batch, g.heads, lq, 1}, {g.heads * lq, lq, 1, 1}};

  // Keys [k0, k0 + nk) of the block last computed, to be added to a dK/dV accumulator.
  index_t pending_k0 = 0, pending_nk = 0;
  // One block against a K/V buffer laid out [b][h_kv][rows][d]: its dQ goes into dq_sum at once, its dK/dV stay
  // in part_kv for add_kv.
  auto block = [&](const block_span& bs, const T* kb, const T* vb, index_t rows) -> status {
    const block_inputs<T> in(g, bs, kb, vb, rows);
    const tensor_ref<T> pdq = bhsd(part_dq, in.p.q_dims());
    const tensor_ref<T> pdk = bhsd(part_kv, in.p.kv_dims());
    const tensor_ref<T> pdv = bhsd(part_kv + part_kv_elems, in.p.kv_dims());
    // attend_backward reads lse as [b][h][i] over the block's rows: this rank's rows as they are, fewer packed.
    const float* block_lse = lse;
    if (bs.nq != lq) {
      if (status s = ex.copy(rows_of(lse_view, bs.q0, bs.nq), bhsd(part_lse, {g.batch, g.heads, bs.nq, 1})); !s)
        return s;
      block_lse = part_lse;
    }
    const tensor_ref<const T> qs = rows_of(q, bs.q0, bs.nq), os = rows_of(o, bs.q0, bs.nq),
                              dos = rows_of(d_o, bs.q0, bs.nq);
    const status s = with_block_mask(bs.mask, [&](const auto& mask) {
      return fusedattn::attend_backward(pol, in.p, qs, in.k, in.v, os, dos, block_lse, pdq, pdk, pdv, mask);
    });
    if (!s) return s;
    pending_k0 = bs.k0;
    pending_nk = bs.nk;
    return ex.add(tensor_ref<const T>(pdq), rows_of(dq_sum, bs.q0, bs.nq));
  };
  // The pending block's dK and dV into rows [k0, k0 + nk) of an accumulator (dK, then dV `elems` further on)
  // laid out [b][h_kv][rows][d].
  auto add_kv = [&](acc_t* acc, index_t rows, index_t elems) -> status {
    const index_t k0 = pending_k0, nk = pending_nk;
    pending_nk = 0;
    const dims4 part{g.batch, g.heads_kv, nk, g.head_dim}, whole{g.batch, g.heads_kv, rows, g.head_dim};
    for (int x = 0; x < 2; ++x)  // dK, then dV
      if (status s = ex.add(tensor_ref<const T>(bhsd(part_kv + x * part_kv_elems, part)),
                            rows_of(bhsd(acc + x * elems, whole), k0, nk));
          !s)
        return s;
    return {};
  };
  auto compute = [&](status s) {
    if (st && opt.parts.compute) st = s;
  };
  ring_link<Comm, Exec> link{comm, ex};
  const std::size_t kv_bytes = std::size_t(2 * kv_elems) * sizeof(T);
  const std::size_t acc_bytes = std::size_t(2 * kv_elems) * sizeof(acc_t);
  int home = 0;  // the dkv buffer that ends up holding this rank's dK/dV

  if (!gather) {
    keep(pack_kv(ex, k, v, buf[0], lp));
    keep(ex.zero(dkv[0], 2 * kv_elems));
    int cur = 0, dcur = 0;
    for (int i = 0; i < n; ++i) {
      typename Comm::request kv_req{}, acc_req{};
      const bool moving = i + 1 < n && opt.parts.communicate;
      const bool acc_moving = i > 0 && opt.parts.communicate;
      if (moving)
        if (status s = link.start(buf[cur], buf[1 - cur], kv_bytes, kv_req); !s) return s;
      // The accumulator of the shard finished last step leaves; the one of this step's shard arrives.
      if (acc_moving)
        if (status s = link.start(dkv[dcur], dkv[1 - dcur], acc_bytes, acc_req); !s) return s;
      pending_nk = 0;
      if (st && opt.parts.compute)
        for (const block_span& bs : ring_blocks(r, (r - i + n) % n, lq, lkv, is_causal, opt.layout))
          compute(block(bs, buf[cur], buf[cur] + kv_elems, lkv));
      if (acc_moving) {
        if (status s = link.finish(acc_req); !s) return s;
        dcur = 1 - dcur;
      }
      if (st && opt.parts.compute && pending_nk > 0) compute(add_kv(dkv[dcur], lkv, kv_elems));
      if (moving) {
        if (status s = link.finish(kv_req); !s) return s;
        cur = 1 - cur;
      }
    }
    // Each accumulator now holds every rank's part of the shard of rank r + 1: one hop takes it home.
    if (n > 1 && opt.parts.communicate) {
      typename Comm::request req{};
      if (status s = link.start(dkv[dcur], dkv[1 - dcur], acc_bytes, req); !s) return s;
      if (status s = link.finish(req); !s) return s;
      dcur = 1 - dcur;
    }
    home = dcur;
  } else {
    keep(ex.zero(g_acc, 2 * all_kv_elems));
    if (status s = gather_kv(link, st, g, k, v, all, gk, gv, opt); !s) return s;
    if (st && opt.parts.compute)
      for (const block_span& bs : gathered_blocks(g, n, r, is_causal, opt.layout)) {
        if (!st) break;
        compute(block(bs, gk, gv, g.seq_kv));
        if (st) compute(add_kv(g_acc, g.seq_kv, all_kv_elems));
      }
    // Reduce-scatter: the sums of shard c are this rank's rows of c (in shard order) plus what arrives.
    const strides4 shard_stride = bhsd(dkv[0], lp.kv_dims()).stride;
    auto gather_rows = [&](int c, acc_t* dst, bool accumulate) -> status {
      index_t local = 0;
      for (int p = 0; p < (opt.layout == layout::zigzag ? 2 : 1); ++p) {
        const row_range rr = shard_piece(opt.layout, g.seq_kv, n, c, p);
        for (int x = 0; x < 2; ++x) {
          const tensor_ref<const acc_t> from =
              rows_of(tensor_ref<const acc_t>(bhsd(g_acc + x * all_kv_elems, g.kv_dims())), rr.begin, rr.size());
          const tensor_ref<acc_t> to = rows_of(tensor_ref<acc_t>{dst + x * kv_elems, lp.kv_dims(), shard_stride},
                                               local, rr.size());
          if (status s = accumulate ? ex.add(from, to) : ex.copy(from, to); !s) return s;
        }
        local += rr.size();
      }
      return {};
    };
    if (n == 1 || !opt.parts.communicate) {
      keep(gather_rows(r, dkv[0], false));
    } else {
      // Hop i sends the sums of shard r − i − 1 and receives those of shard r − i − 2 (after the last hop: r).
      keep(gather_rows((r - 1 + n) % n, dkv[0], false));
      int cur = 0;
      for (int i = 0; i + 1 < n; ++i) {
        typename Comm::request req{};
        if (status s = link.start(dkv[cur], dkv[1 - cur], acc_bytes, req); !s) return s;
        if (status s = link.finish(req); !s) return s;
        cur = 1 - cur;
        if (st && opt.parts.compute) compute(gather_rows((r - i - 2 + 2 * n) % n, dkv[cur], true));
      }
      home = cur;
    }
  }
  // As in dist::attend: the agreement's round trip runs while the last step computes; the copies queue behind it.
  if (status s = agree(comm, st, fp, who); !s) return s;
  // Every rank succeeded: write the gradients.
  const tensor_ref<const acc_t> dk_sum = bhsd<const acc_t>(dkv[home], lp.kv_dims());
  const tensor_ref<const acc_t> dv_sum = bhsd<const acc_t>(dkv[home] + kv_elems, lp.kv_dims());
  if (status s = ex.copy(tensor_ref<const acc_t>(dq_sum), dq); !s) return s;
  if (status s = ex.copy(dk_sum, dk); !s) return s;
  if (status s = ex.copy(dv_sum, dv); !s) return s;
  if (status s = ex.synchronize(); !s) return s;
  if (tm) {
    tm->total = std::chrono::duration<double>(clock::now() - t_start).count();
    tm->waiting = link.waiting;
  }
  return {};
}

}  // namespace detail

/// The backward pass of dist::attend: every rank passes the shards it passed to dist::attend (q, k, v), the shard
/// of O and lse dist::attend returned, and its shard of dL/dO; it receives its shards of dQ, dK and dV, equal to
/// what one attend_backward call over the whole sequence gives for those rows.
///
/// @param comm    a communicator (dist/comm.hpp), as for dist::attend.
/// @param pol     how each block runs: policy::cpu<Arch> (host memory) or policy::cuda (device memory; include
///                dist/cuda.cuh in a .cu file); the same on every rank. Each block calls
///                fusedattn::attend_backward, so a policy without a backward kernel returns its errc::unsupported.
/// @param global  the whole problem, as for dist::attend (the global lengths; an even split).
/// @param q, o, d_o  this rank's shard of queries, output and dL/dO: (batch, heads, seq_q / N, head_dim);
///                k, v: (batch, heads_kv, seq_kv / N, head_dim). Any strides, head_dim stride 1.
/// @param lse     this rank's lse from dist::attend: batch · heads · (seq_q / N) floats, [b][h][local row]; not null.
/// @param dq, dk, dv  this rank's gradient shards, shaped like q, k, v; they must not overlap each other, an input
///                or lse. GQA / MQA sum dK and dV over the query heads of a kv head.
/// @param mask    dense{} or causal{} (seq_q = seq_kv), or an any_mask holding one: the forward's mask.
/// @param opt     the forward's layout; strategy ring, all_gather or automatic (all_gather when heads_kv < heads).
/// @param tm      optional host timings (total, time blocked on transfers).
/// Ring: dQ accumulates on its rank and each shard's dK/dV accumulator travels with the K/V shard (in accum_t<T>),
/// its transfer under the next step's compute; all-gather: K/V gathered, then dK/dV reduce-scattered around the
/// ring. A bad input on one rank makes every rank return an error and no rank writes anything.
/// @return ok; errc::invalid_argument (a field and its value, or disagreeing ranks); errc::unsupported (a mask
///         other than dense or causal, causal with seq_q ≠ seq_kv, a policy without a backward kernel);
///         errc::out_of_memory; errc::backend_error (a communicator failure).
template <class Comm, class Policy, class T, class Mask = fusedattn::dense>
status attend_backward(Comm& comm, const Policy& pol, const problem& global,
                       tensor_ref<const fusedattn::detail::identity_t<T>> q,
                       tensor_ref<const fusedattn::detail::identity_t<T>> k,
                       tensor_ref<const fusedattn::detail::identity_t<T>> v,
                       tensor_ref<const fusedattn::detail::identity_t<T>> o,
                       tensor_ref<const fusedattn::detail::identity_t<T>> d_o, const float* lse, tensor_ref<T> dq,
                       tensor_ref<fusedattn::detail::identity_t<T>> dk, tensor_ref<fusedattn::detail::identity_t<T>> dv,
                       const Mask& mask = {}, const options& opt = {}, timings* tm = nullptr) {
  static_assert(std::is_same_v<Mask, fusedattn::dense> || std::is_same_v<Mask, fusedattn::causal> ||
                    std::is_same_v<Mask, any_mask>,
                "dist::attend_backward takes dense{}, causal{} or an any_mask");
  static_assert(detail::exec_for<Policy>::available,
                "dist::attend_backward with policy::cuda needs fusedattn/dist/cuda.cuh, included in a .cu file");
  constexpr const char* who = "dist::attend_backward";
  const int n = comm.size();
  bool is_causal = false;
  const auto check = [&]() -> status {
    if (!detail::mask_kind<Mask>::is_causal(mask, is_causal))
      return {errc::unsupported, std::string(who) + " takes the dense and causal masks; this mask is neither"};
    if (status s = detail::check_sharding(n, comm.rank(), global, is_causal, opt, who); !s) return s;
    if (status s = validate_policy(pol); !s) return s;
    return validate_backward(detail::shard_problem(global, n), q, k, v, o, d_o, lse, dq, dk, dv, fusedattn::dense{});
  };
  const status local = check();
  const std::string type = std::string(scalar_name<T>()) + " backward";
  const std::uint64_t fp = detail::fingerprint(global, is_causal, opt, type.c_str());
  // A rank with bad input only agrees; the others allocate first and agree inside run_backward (one round trip).
  if (!local) return detail::agree(comm, local, fp, who);
  auto ex = detail::exec_for<Policy>::make(pol);
  return detail::run_backward(comm, ex, pol, global, tensor_ref<const T>(q), tensor_ref<const T>(k),
                              tensor_ref<const T>(v), tensor_ref<const T>(o), tensor_ref<const T>(d_o), lse, dq, dk,
                              dv, is_causal, opt, fp, tm);
}

}  // namespace dist
}  // namespace fusedattn
