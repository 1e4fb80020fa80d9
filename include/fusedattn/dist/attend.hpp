/// @file attend.hpp
/// dist::attend: one attention whose sequence is sharded over the ranks of a communicator (ring with double
/// buffering, or all-gather of K/V), each block computed by fusedattn::attend with lse and merged by lse. The
/// schedule is written once; CPU policies run it on host memory here, policy::cuda on device memory through
/// dist/cuda.cuh. Include an engine (dist/mpi.hpp, dist/nccl.hpp) next to it.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "../core/problem.hpp"
#include "../core/status.hpp"
#include "../core/tensor.hpp"
#include "../core/validate.hpp"
#include "../dispatch/attend.hpp"
#include "../dispatch/policy.hpp"
#include "../kernels/mask.hpp"
#include "comm.hpp"
#include "merge.hpp"

namespace fusedattn {
namespace dist {
namespace detail {

/// The mask of one block: the whole block, causal aligned top-left (a diagonal block, equal lengths) or causal
/// aligned bottom-right (queries that sit at the end of a longer key range).
enum class block_mask { dense, causal_top_left, causal_bottom_right };

/// A view of rows [r0, r0 + n) of `t`.
template <class T>
tensor_ref<T> rows_of(const tensor_ref<T>& t, index_t r0, index_t n) {
  return {t.data + r0 * t.stride.s, {t.dims.b, t.dims.h, n, t.dims.d}, t.stride};
}
/// A view of rows [r0, r0 + n) of an lse view.
template <class F>
lse_ref<F> rows_of(const lse_ref<F>& l, index_t r0, index_t n) {
  return {l.data + r0, l.b, l.h, n, l.stride_b, l.stride_h};
}

/// Host memory, CPU policies: the operations the schedule asks of its memory.
class host_exec {
 public:
  explicit host_exec(int threads) : threads_(threads) {}

  void* stream() const { return nullptr; }

  /// `n` elements of U, owned by this object (zero-filled, so a measuring run never reads garbage).
  template <class U>
  status allocate(U*& out, index_t n) {
    try {
      auto block = std::make_unique<unsigned char[]>(static_cast<std::size_t>(n) * sizeof(U));
      std::memset(block.get(), 0, static_cast<std::size_t>(n) * sizeof(U));
      out = reinterpret_cast<U*>(block.get());
      blocks_.push_back(std::move(block));
    } catch (const std::bad_alloc&) {
      return {errc::out_of_memory, "dist::attend: " + std::to_string(n * index_t(sizeof(U))) + " bytes of host scratch"};
    }
    return {};
  }

  /// dst = src element by element, converted; both views have the same extents.
  template <class S, class D>
  status copy(const tensor_ref<S>& src, const tensor_ref<D>& dst) {
    const dims4 d = src.dims;
    const index_t rows = d.b * d.h;
    (void)rows;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads_) schedule(static) if (threads_ > 1)
#endif
    for (index_t bh = 0; bh < rows; ++bh)
      for (index_t i = 0; i < d.s; ++i) {
        const auto* a = src.row(bh / d.h, bh % d.h, i);
        D* b = dst.row(bh / d.h, bh % d.h, i);
        for (index_t c = 0; c < d.d; ++c) b[c] = static_cast<D>(static_cast<accum_t<D>>(a[c]));
      }
    return {};
  }

  /// dst += src element by element, summed in dst's type; both views have the same extents.
  template <class S, class D>
  status add(const tensor_ref<S>& src, const tensor_ref<D>& dst) {
    const dims4 d = src.dims;
    const index_t rows = d.b * d.h;
    (void)rows;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads_) schedule(static) if (threads_ > 1)
#endif
    for (index_t bh = 0; bh < rows; ++bh)
      for (index_t i = 0; i < d.s; ++i) {
        const auto* a = src.row(bh / d.h, bh % d.h, i);
        D* b = dst.row(bh / d.h, bh % d.h, i);
        for (index_t c = 0; c < d.d; ++c) b[c] += static_cast<D>(static_cast<accum_t<D>>(a[c]));
      }
    return {};
  }

  /// `n` elements of U (float or double) set to zero.
  template <class U>
  status zero(U* p, index_t n) {
    std::memset(p, 0, static_cast<std::size_t>(n) * sizeof(U));
    return {};
  }

  status fill(float* p, index_t n, float value) {
    for (index_t i = 0; i < n; ++i) p[i] = value;
    return {};
  }

  status copy_floats(const float* src, float* dst, index_t n) {
    std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
    return {};
  }

  template <class TA, class TB, class TO>
  status merge(const tensor_ref<TA>& o_a, const lse_ref<const float>& lse_a, const tensor_ref<TB>& o_b,
               const lse_ref<const float>& lse_b, const tensor_ref<TO>& o, const lse_ref<float>& lse) {
    return merge_partials(o_a, lse_a, o_b, lse_b, o, lse, threads_);
  }

  /// Nothing to wait for: every operation above has finished when it returns.
  status synchronize() { return {}; }

 private:
  int threads_;
  std::vector<std::unique_ptr<unsigned char[]>> blocks_;
};

/// The memory a policy's schedule runs on: host_exec for CPU policies; dist/cuda.cuh adds policy::cuda.
template <class Policy, class = void>
struct exec_for {
  static constexpr bool available = false;
};
template <class Arch>
struct exec_for<policy::cpu<Arch>> {
  static constexpr bool available = true;
  using type = host_exec;
  static type make(const policy::cpu<Arch>& p) { return host_exec(p.threads); }
};
template <>
struct exec_for<policy::cpu_naive> {
  static constexpr bool available = true;
  using type = host_exec;
  static type make(const policy::cpu_naive& p) { return host_exec(p.threads); }
};

/// FNV-1a over the fields every rank must pass alike, so ranks that disagree fail together instead of hanging
/// on transfers of different sizes.
inline std::uint64_t fingerprint(const problem& g, bool causal, const options& opt, const char* type_name) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&h](std::uint64_t x) {
    for (int i = 0; i < 8; ++i) {
      h ^= (x >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  const index_t fields[6] = {g.batch, g.heads, g.heads_kv, g.seq_q, g.seq_kv, g.head_dim};
  for (index_t f : fields) mix(static_cast<std::uint64_t>(f));
  const double scale = g.softmax_scale();
  std::uint64_t bits = 0;
  std::memcpy(&bits, &scale, sizeof bits);
  mix(bits);
  mix(causal ? 1 : 0);
  mix(static_cast<std::uint64_t>(opt.layout));
  mix(static_cast<std::uint64_t>(opt.strategy));
  mix(static_cast<std::uint64_t>(opt.parts.compute) * 2 + static_cast<std::uint64_t>(opt.parts.communicate));
  for (const char* c = type_name; *c; ++c) mix(static_cast<unsigned char>(*c));
  return h >> 2;  // non-negative as int64, and its negation too
}

/// Every rank learns whether every rank is fine, and whether all passed the same fingerprint. Returns `local` where
/// it failed; elsewhere, when another rank failed, the lowest such rank's error code with a sentence naming it
/// (and `who`, the calling entry point).
template <class Comm>
status agree(Comm& comm, const status& local, std::uint64_t fp, const char* who = "dist::attend") {
  const std::int64_t n = comm.size();
  constexpr std::int64_t codes = 8;
  std::int64_t v[3] = {local.ok() ? n * codes : std::int64_t(comm.rank()) * codes + std::int64_t(local.code()),
                       static_cast<std::int64_t>(fp), -static_cast<std::int64_t>(fp)};
  if (status st = comm.all_reduce_min(v, 3); !st) return st;
  if (!local) return local;
  if (v[0] < n * codes) {
    const auto code = static_cast<errc>(v[0] % codes);
    return {code, std::string(who) + ": rank " + std::to_string(v[0] / codes) + " failed (" + to_string(code) +
                      "; its own status says why); this rank's part was fine and nothing was written"};
  }
  if (v[1] != -v[2])
    return status::invalid(std::string(who) +
                           ": the ranks passed different problems, masks, options or scalar types; every rank must "
                           "pass the same global problem");
  return {};
}

/// The schedule, on validated input that every rank agreed on. Writes o and lse only when every step succeeded on
/// every rank.
template <class Comm, class Exec, class Policy, class T>
status run(Comm& comm, Exec& ex, const Policy& pol, const problem& g, const tensor_ref<const T>& q,
           const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<T>& o, bool is_causal,
           float* lse, const options& opt, std::uint64_t fp, timings* tm) {
  using acc_t = accum_t<T>;
  using clock = std::chrono::steady_clock;
  const auto t_start = clock::now();
  double waiting = 0;
  const int n = comm.size(), r = comm.rank();
  const index_t lq = g.seq_q / n, lkv = g.seq_kv / n;
  problem lp = g;
  lp.seq_q = lq;
  lp.seq_kv = lkv;
  const index_t kv_elems = g.batch * g.heads_kv * lkv * g.head_dim;
  const bool gather = opt.strategy == strategy::all_gather ||
                      (opt.strategy == strategy::automatic && g.heads_kv < g.heads);

  // Accumulator (acc_t, O and lse of the union so far) and one block's part (T, as attend writes it).
  acc_t* acc_o = nullptr;
  T* part_o = nullptr;
  float *acc_lse = nullptr, *part_lse = nullptr;
  // Every buffer first, then one agreement: a rank that cannot allocate must not leave the others in a transfer.
  T* buf[2] = {nullptr, nullptr};  // ring: the shard computed on and the one arriving
  T *all = nullptr, *gk = nullptr, *gv = nullptr;  // all-gather: one slot per rank, then K and V in global order
  status st = ex.allocate(acc_o, lp.batch * lp.heads * lq * lp.head_dim);
  auto keep = [&st](const status& s) {  // the first failure is the one reported
    if (st) st = s;
  };
  keep(ex.allocate(part_o, lp.batch * lp.heads * lq * lp.head_dim));
  keep(ex.allocate(acc_lse, lp.lse_size()));
  keep(ex.allocate(part_lse, lp.lse_size()));
  if (!gather) {
    keep(ex.allocate(buf[0], 2 * kv_elems));
    keep(ex.allocate(buf[1], 2 * kv_elems));
  } else {
    keep(ex.allocate(all, index_t(n) * 2 * kv_elems));
    keep(ex.allocate(gk, g.batch * g.heads_kv * g.seq_kv * g.head_dim));
    keep(ex.allocate(gv, g.batch * g.heads_kv * g.seq_kv * g.head_dim));
  }
  if (status s = agree(comm, st, fp); !s) return s;
  // From here on a failing step (a copy, a kernel) stops this rank's compute but not its transfers: the others
  // are waiting for them. The agreement at the end tells everyone. A failing transfer is returned at once.
  keep(ex.fill(acc_lse, lp.lse_size(), -std::numeric_limits<float>::infinity()));
  const tensor_ref<acc_t> acc = bhsd(acc_o, lp.q_dims());
  const lse_ref<float> acc_l = lse_bhs(acc_lse, lp.q_dims());

  // Queries [q0, q0 + nq) of this rank against keys [k0, k0 + nk) of a K/V buffer laid out [b][h_kv][rows][d].
  auto block = [&](index_t q0, index_t nq, const T* kb, const T* vb, index_t rows, index_t k0, index_t nk,
                   block_mask bm) -> status {
    problem sp = g;
    sp.seq_q = nq;
    sp.seq_kv = nk;
    const strides4 kv_st{g.heads_kv * rows * g.head_dim, rows * g.head_dim, g.head_dim, 1};
    const tensor_ref<const T> ks{kb + k0 * g.head_dim, sp.kv_dims(), kv_st};
    const tensor_ref<const T> vs{vb + k0 * g.head_dim, sp.kv_dims(), kv_st};
    const tensor_ref<T> part = bhsd(part_o, sp.q_dims());
    const tensor_ref<const T> qs = rows_of(q, q0, nq);
    const status s =
        bm == block_mask::dense
            ? fusedattn::attend(pol, sp, qs, ks, vs, part, fusedattn::dense{}, part_lse)
            : fusedattn::attend(pol, sp, qs, ks, vs, part,
                                fusedattn::causal{bm == block_mask::causal_top_left ? align::top_left : align::bottom_right},
                                part_lse);
    if (!s) return s;
    const tensor_ref<acc_t> acc_rows = rows_of(acc, q0, nq);
    const lse_ref<float> acc_l_rows = rows_of(acc_l, q0, nq);
    return ex.merge(tensor_ref<const acc_t>(acc_rows), lse_ref<const float>(acc_l_rows),
                    tensor_ref<const T>(part), lse_bhs(static_cast<const float*>(part_lse), sp.q_dims()), acc_rows,
                    acc_l_rows);
  };
  // After a failure a rank keeps communicating (the others are waiting for its transfers) but computes no more.
  auto compute = [&](status s) {
    if (st && opt.parts.compute) st = s;
  };
  auto exchange = [&](const T* send, T* recv, typename Comm::request& req) -> status {
    return comm.start_exchange(send, (r + 1) % n, recv, (r - 1 + n) % n, std::size_t(2 * kv_elems) * sizeof(T), req,
                               ex.stream());
  };
  auto finish_exchange = [&](typename Comm::request& req) -> status {
    const auto t0 = clock::now();
    const status s = comm.wait(req, ex.stream());
    waiting += std::chrono::duration<double>(clock::now() - t0).count();
    return s;
  };
  const tensor_ref<T> own_kv_k{nullptr, lp.kv_dims(), {g.heads_kv * lkv * g.head_dim, lkv * g.head_dim, g.head_dim, 1}};

  if (!gather) {
    // Ring: step i computes on the shard of rank r − i while shard r − i − 1 arrives (double buffering).
    tensor_ref<T> kd = own_kv_k, vd = own_kv_k;
    kd.data = buf[0];
    vd.data = buf[0] + kv_elems;
    keep(ex.copy(k, kd));
    keep(ex.copy(v, vd));
    const index_t half = lq / 2;
    int cur = 0;
    for (int i = 0; i < n; ++i) {
      const int src = (r - i + n) % n;
      typename Comm::request req{};
      const bool moving = i + 1 < n && opt.parts.communicate;
      if (moving)
        if (status s = exchange(buf[cur], buf[1 - cur], req); !s) return s;
      const T* kb = buf[cur];
      const T* vb = buf[cur] + kv_elems;
      if (st && opt.parts.compute) {
        if (!is_causal) {
          compute(block(0, lq, kb, vb, lkv, 0, lkv, block_mask::dense));
        } else if (src == r) {
          // The diagonal: local order is global order on both sides (zigzag keeps the two chunks ascending).
          compute(block(0, lq, kb, vb, lkv, 0, lkv, block_mask::causal_top_left));
        } else if (opt.layout == layout::contiguous) {
          if (src < r) compute(block(0, lq, kb, vb, lkv, 0, lkv, block_mask::dense));
        } else if (src < r) {
          // zigzag, earlier rank: its chunk src precedes both of ours; its chunk 2N−1−src follows both.
          compute(block(0, lq, kb, vb, lkv, 0, half, block_mask::dense));
        } else {
          // zigzag, later rank: both its chunks precede our chunk 2N−1−r and follow our chunk r.
          compute(block(half, lq - half, kb, vb, lkv, 0, lkv, block_mask::dense));
        }
      }
      if (moving) {
        if (status s = finish_exchange(req); !s) return s;
        cur = 1 - cur;
      }
    }
  } else {
    // All-gather: slot s of `all` receives rank s's packed K/V; then K and V are laid out in global order.
    auto slot = [&](int s) { return all + index_t(s) * 2 * kv_elems; };
    tensor_ref<T> kd = own_kv_k, vd = own_kv_k;
    kd.data = slot(r);
    vd.data = slot(r) + kv_elems;
    keep(ex.copy(k, kd));
    keep(ex.copy(v, vd));
    if (opt.parts.communicate)
      for (int i = 0; i + 1 < n; ++i) {
        typename Comm::request req{};
        if (status s = exchange(slot((r - i + n) % n), slot((r - i - 1 + n) % n), req); !s) return s;
        if (status s = finish_exchange(req); !s) return s;
      }
    const index_t skv = g.seq_kv;
    const tensor_ref<T> gk_view = bhsd(gk, g.kv_dims()), gv_view = bhsd(gv, g.kv_dims());
    const int pieces = opt.layout == layout::zigzag ? 2 : 1;
    for (int s = 0; s < n && st; ++s) {
      const T* from = opt.parts.communicate ? slot(s) : slot(r);
      index_t local = 0;
      for (int p = 0; p < pieces && st; ++p) {
        const row_range rr = shard_piece(opt.layout, skv, n, s, p);
        tensor_ref<const T> ks = own_kv_k, vs = own_kv_k;
        ks.data = from;
        vs.data = from + kv_elems;
        const status sk = ex.copy(rows_of(ks, local, rr.size()), rows_of(gk_view, rr.begin, rr.size()));
        const status sv = sk ? ex.copy(rows_of(vs, local, rr.size()), rows_of(gv_view, rr.begin, rr.size())) : sk;
        st = sv;
        local += rr.size();
      }
    }
    if (st && opt.parts.compute) {
      if (!is_causal) {
        compute(block(0, lq, gk, gv, skv, 0, skv, block_mask::dense));
      } else {
        index_t local = 0;
        for (int p = 0; p < pieces; ++p) {
          // Queries at global rows [begin, end) see keys [0, end): causal aligned bottom-right.
          const row_range rr = shard_piece(opt.layout, g.seq_q, n, r, p);
          compute(block(local, rr.size(), gk, gv, skv, 0, rr.end, block_mask::causal_bottom_right));
          local += rr.size();
        }
      }
    }
  }
  if (st) {
    const status synced = ex.synchronize();
    st = synced;
  }
  if (status s = agree(comm, st, fp); !s) return s;
  // Every rank succeeded: write the outputs.
  if (status s = ex.copy(tensor_ref<const acc_t>(acc), o); !s) return s;
  if (lse)
    if (status s = ex.copy_floats(acc_lse, lse, lp.lse_size()); !s) return s;
  if (status s = ex.synchronize(); !s) return s;
  if (tm) {
    tm->total = std::chrono::duration<double>(clock::now() - t_start).count();
    tm->waiting = waiting;
  }
  return {};
}

/// The checks of a sharded call that do not read its tensors: the communicator's rank, the options, the global
/// problem, causal's equal lengths and the even split. `who` names the entry point in messages.
inline status check_sharding(int n, int rank, const problem& global, bool is_causal, const options& opt,
                             const char* who) {
  if (n < 1 || rank < 0 || rank >= n)
    return status::invalid("comm: rank " + std::to_string(rank) + " of " + std::to_string(n));
  if (opt.layout != layout::contiguous && opt.layout != layout::zigzag)
    return status::invalid("options.layout is not a dist::layout value");
  if (opt.strategy != strategy::automatic && opt.strategy != strategy::ring && opt.strategy != strategy::all_gather)
    return status::invalid("options.strategy is not a dist::strategy value");
  if (status s = validate(global); !s) return s;
  if (is_causal && global.seq_q != global.seq_kv)
    return {errc::unsupported, std::string(who) + ": causal needs problem.seq_q = seq_kv; they are " +
                                   std::to_string(global.seq_q) + " and " + std::to_string(global.seq_kv)};
  const index_t unit = opt.layout == layout::zigzag ? 2 * index_t(n) : index_t(n);
  const char* names[2] = {"seq_q", "seq_kv"};
  const index_t seqs[2] = {global.seq_q, global.seq_kv};
  for (int i = 0; i < 2; ++i)
    if (seqs[i] % unit != 0)
      return status::invalid("problem." + std::string(names[i]) + " is " + std::to_string(seqs[i]) + "; a " +
                             layout_name(opt.layout) + " split over " + std::to_string(n) +
                             " ranks needs a multiple of " + std::to_string(unit) + " (uneven shards are not supported)");
  return {};
}

template <class Mask>
struct mask_kind;
template <>
struct mask_kind<dense> {
  static status is_causal(const dense&, bool& c) { return c = false, status{}; }
};
template <>
struct mask_kind<causal> {
  static status is_causal(const causal&, bool& c) { return c = true, status{}; }
};
template <>
struct mask_kind<any_mask> {
  static status is_causal(const any_mask& m, bool& c) {
    if (std::holds_alternative<dense>(m)) return c = false, status{};
    if (std::holds_alternative<causal>(m)) return c = true, status{};
    return {errc::unsupported, "dist::attend takes the dense and causal masks; this mask is neither"};
  }
};

}  // namespace detail

/// Attention over a sequence sharded across the ranks of `comm`: every rank passes its shard of Q, K and V and
/// receives its shard of O (and lse), equal to what one attend call over the whole sequence gives for those rows.
///
/// @param comm    a communicator (dist/comm.hpp): dist::mpi_comm, dist::nccl_comm, or your own.
/// @param pol     how each block runs: a CPU policy (host memory), or policy::cuda (device memory; include
///                dist/cuda.cuh in a .cu file). The same on every rank.
/// @param global  the whole problem: seq_q and seq_kv are the GLOBAL lengths; the same on every rank. They must be
///                multiples of the rank count (contiguous) or of twice it (zigzag): uneven shards are refused.
/// @param q, o    this rank's shard of queries / output: (batch, heads, seq_q / N, head_dim), rows in the order
///                shard_piece gives; k, v: (batch, heads_kv, seq_kv / N, head_dim). Any strides, head_dim stride 1.
/// @param mask    dense{}, causal{} (seq_q = seq_kv; both alignments then agree) or an any_mask holding one of them.
/// @param lse     optional: this rank's batch · heads · (seq_q / N) floats, [b][h][local row], natural log.
/// @param opt     layout (zigzag by default: it balances causal work), strategy (ring, all_gather, automatic).
/// @param tm      optional host timings (total, time blocked on transfers).
/// Every rank validates its own input, then all agree: a bad input on one rank makes every rank return an error
/// (that rank's own reason there, "rank r failed" elsewhere) and no rank writes anything; no rank is left waiting.
/// @return ok; errc::invalid_argument (a field and its value, or disagreeing ranks); errc::unsupported (a window or
///         block-sparse mask, causal with seq_q ≠ seq_kv, a backend not compiled in); errc::out_of_memory;
///         errc::backend_error (a communicator failure).
template <class Comm, class Policy, class T, class Mask = fusedattn::dense>
status attend(Comm& comm, const Policy& pol, const problem& global,
              tensor_ref<const fusedattn::detail::identity_t<T>> q, tensor_ref<const fusedattn::detail::identity_t<T>> k,
              tensor_ref<const fusedattn::detail::identity_t<T>> v, tensor_ref<T> o, const Mask& mask = {},
              float* lse = nullptr, const options& opt = {}, timings* tm = nullptr) {
  static_assert(std::is_same_v<Mask, fusedattn::dense> || std::is_same_v<Mask, fusedattn::causal> ||
                    std::is_same_v<Mask, any_mask>,
                "dist::attend takes dense{}, causal{} or an any_mask");
  static_assert(detail::exec_for<Policy>::available,
                "dist::attend with policy::cuda needs fusedattn/dist/cuda.cuh, included in a .cu file");
  const int n = comm.size();
  bool is_causal = false;
  const status mask_ok = detail::mask_kind<Mask>::is_causal(mask, is_causal);
  const auto check = [&]() -> status {
    if (!mask_ok) return mask_ok;
    if (status s = detail::check_sharding(n, comm.rank(), global, is_causal, opt, "dist::attend"); !s) return s;
    problem lp = global;
    lp.seq_q = global.seq_q / n;
    lp.seq_kv = global.seq_kv / n;
    if (status s = validate_policy(pol); !s) return s;
    return validate(lp, q, k, v, o, fusedattn::dense{}, lse);
  };
  const status local = check();
  const std::uint64_t fp = detail::fingerprint(global, is_causal, opt, scalar_name<T>());
  if (status s = detail::agree(comm, local, fp); !s) return s;
  auto ex = detail::exec_for<Policy>::make(pol);
  return detail::run(comm, ex, pol, global, tensor_ref<const T>(q), tensor_ref<const T>(k), tensor_ref<const T>(v),
                     o, is_causal, lse, opt, fp, tm);
}

}  // namespace dist
}  // namespace fusedattn
