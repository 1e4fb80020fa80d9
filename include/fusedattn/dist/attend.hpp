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

#if defined(_OPENMP)
#include <omp.h>
#endif

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
    return each_element(src, dst, [](D& b, const auto& a) { b = static_cast<D>(static_cast<accum_t<D>>(a)); });
  }

  /// dst += src element by element, summed in dst's type; both views have the same extents.
  template <class S, class D>
  status add(const tensor_ref<S>& src, const tensor_ref<D>& dst) {
    return each_element(src, dst, [](D& b, const auto& a) { b += static_cast<D>(static_cast<accum_t<D>>(a)); });
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

  /// The union of `count` partial results of the same rows, in one pass: part i's O at parts + i · o.dims'
  /// elements (laid out [b][h][s][d]) and its lse at lses + i · b·h·s ([b][h][s]), into o (converted to its type)
  /// and, when not null, lse ([b][h][s]). Weights in double (merged_lse).
  template <class P, class TO>
  status merge_parts(const P* parts, const float* lses, int count, const tensor_ref<TO>& o, float* lse) {
    const dims4 d = o.dims;
    const index_t rows = d.b * d.h * d.s, elems = rows * d.d;
    std::vector<double> weights(static_cast<std::size_t>(threads_) * static_cast<std::size_t>(count));
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads_) schedule(static) if (threads_ > 1)
#endif
    for (index_t row = 0; row < rows; ++row) {
#if defined(_OPENMP)
      double* w = weights.data() + static_cast<std::size_t>(omp_get_thread_num()) * static_cast<std::size_t>(count);
#else
      double* w = weights.data();
#endif
      const index_t i = row % d.s, h = row / d.s % d.h, b = row / d.s / d.h;
      const double l = merged_lse<double>(lses + row, rows, count);
      for (int p = 0; p < count; ++p) {  // −1 leaves a part out (its O not read): it saw no key, or no part did
        const double lp = lses[p * rows + row];
        w[p] = lp == -std::numeric_limits<double>::infinity() || l == -std::numeric_limits<double>::infinity()
                   ? -1.0
                   : std::exp(lp - l);
      }
      TO* out = o.row(b, h, i);
      for (index_t c = 0; c < d.d; ++c) {
        double x = 0;
        for (int p = 0; p < count; ++p)
          if (!(w[p] < 0.0)) x += w[p] * static_cast<double>(parts[p * elems + row * d.d + c]);
        out[c] = static_cast<TO>(x);
      }
      if (lse) lse[row] = static_cast<float>(l);
    }
    return {};
  }

  /// Nothing to wait for: every operation above has finished when it returns.
  status synchronize() { return {}; }

 private:
  /// op(dst element, src element) over every element of two views of the same extents, rows split over threads.
  template <class S, class D, class Op>
  status each_element(const tensor_ref<S>& src, const tensor_ref<D>& dst, Op op) {
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
        for (index_t c = 0; c < d.d; ++c) op(b[c], a[c]);
      }
    return {};
  }

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

/// The policy of a ring step's attend calls: policy::cuda's runs beside the step's transfer, when there is one
/// (`beside_transfer`), with policy::cuda::concurrent (one block per work item, so the transfer's blocks get SMs as
/// the items finish); the last step, which has no transfer, keeps the persistent grid. Every other policy as given.
template <class Policy>
Policy step_policy(const Policy& pol, bool /*beside_transfer*/) {
  return pol;
}
inline policy::cuda step_policy(const policy::cuda& pol, bool beside_transfer) {
  policy::cuda step = pol;
  step.concurrent = step.concurrent || beside_transfer;
  return step;
}

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

/// One rank's share of the global problem: seq_q / N queries against seq_kv / N keys.
inline problem shard_problem(const problem& global, int ranks) {
  problem lp = global;
  lp.seq_q = global.seq_q / ranks;
  lp.seq_kv = global.seq_kv / ranks;
  return lp;
}

/// One block of the schedule: this rank's queries [q0, q0 + nq) against keys [k0, k0 + nk) of the K/V in hand.
struct block_span {
  index_t q0, nq, k0, nk;
  block_mask mask;
};

/// The blocks of one step of the schedule: none, one, or one a shard piece.
struct block_list {
  block_span at[2]{};
  int count = 0;
  void add(const block_span& b) { at[count++] = b; }
  const block_span* begin() const { return at; }
  const block_span* end() const { return at + count; }
};

/// Ring step: this rank's `lq` queries against the `lkv` keys of rank `src`'s shard, cut to what causal lets them
/// see (causal has lq = lkv). The forward and the backward schedule visit these blocks alike.
inline block_list ring_blocks(int rank, int src, index_t lq, index_t lkv, bool is_causal, layout l) {
  block_list out;
  if (!is_causal) {
    out.add({0, lq, 0, lkv, block_mask::dense});
  } else if (src == rank) {
    // The diagonal: local order is global order on both sides (zigzag keeps the two chunks ascending).
    out.add({0, lq, 0, lkv, block_mask::causal_top_left});
  } else if (l == layout::contiguous) {
    if (src < rank) out.add({0, lq, 0, lkv, block_mask::dense});
  } else if (src < rank) {
    // zigzag, earlier rank: its chunk src precedes both of ours; its chunk 2N−1−src follows both.
    out.add({0, lq, 0, lkv / 2, block_mask::dense});
  } else {
    // zigzag, later rank: both its chunks precede our chunk 2N−1−r and follow our chunk r.
    out.add({lq / 2, lq - lq / 2, 0, lkv, block_mask::dense});
  }
  return out;
}

/// All-gather: this rank's queries against every key in global order; causal as one block a shard piece, queries
/// at global rows [begin, end) seeing keys [0, end) (causal aligned bottom-right).
inline block_list gathered_blocks(const problem& global, int ranks, int rank, bool is_causal, layout l) {
  block_list out;
  if (!is_causal) {
    out.add({0, global.seq_q / ranks, 0, global.seq_kv, block_mask::dense});
    return out;
  }
  index_t local = 0;
  for (int p = 0; p < (l == layout::zigzag ? 2 : 1); ++p) {
    const row_range rr = shard_piece(l, global.seq_q, ranks, rank, p);
    out.add({local, rr.size(), 0, rr.end, block_mask::causal_bottom_right});
    local += rr.size();
  }
  return out;
}

/// f(mask) with the block's mask as a value: dense{}, or causal{} with the block's alignment.
template <class F>
status with_block_mask(block_mask bm, F&& f) {
  if (bm == block_mask::dense) return f(fusedattn::dense{});
  return f(fusedattn::causal{bm == block_mask::causal_top_left ? align::top_left : align::bottom_right});
}

/// What one block's call takes besides its queries: its problem (nq queries, nk keys of the global problem g) and
/// keys [k0, k0 + nk) of K and V buffers laid out [b][h_kv][rows][d].
template <class T>
struct block_inputs {
  problem p;
  tensor_ref<const T> k, v;
  block_inputs(const problem& g, const block_span& bs, const T* kb, const T* vb, index_t rows)
      : p(g), k(key_rows(kb, g, rows, bs)), v(key_rows(vb, g, rows, bs)) {
    p.seq_q = bs.nq;
    p.seq_kv = bs.nk;
  }

 private:
  static tensor_ref<const T> key_rows(const T* base, const problem& g, index_t rows, const block_span& bs) {
    return {base + bs.k0 * g.head_dim,
            {g.batch, g.heads_kv, bs.nk, g.head_dim},
            {g.heads_kv * rows * g.head_dim, rows * g.head_dim, g.head_dim, 1}};
  }
};

/// This rank's place in the ring: exchanges that send to rank r + 1 and receive from rank r − 1 on the executor's
/// stream, and the host seconds spent waiting for them.
template <class Comm, class Exec>
struct ring_link {
  Comm& comm;
  Exec& ex;
  double waiting = 0;

  status start(const void* send, void* recv, std::size_t bytes, typename Comm::request& req) {
    const int n = comm.size(), r = comm.rank();
    return comm.start_exchange(send, (r + 1) % n, recv, (r - 1 + n) % n, bytes, req, ex.stream());
  }
  status finish(typename Comm::request& req) {
    const auto t0 = std::chrono::steady_clock::now();
    const status s = comm.wait(req, ex.stream());
    waiting += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return s;
  }
};

/// This rank's K and V shards, converted to T, packed at `dst`: K then V, each [b][h_kv][lp.seq_kv][d]. Both copies
/// run; the first failure is returned.
template <class Exec, class T>
status pack_kv(Exec& ex, const tensor_ref<const T>& k, const tensor_ref<const T>& v, T* dst, const problem& lp) {
  const index_t elems = lp.batch * lp.heads_kv * lp.seq_kv * lp.head_dim;
  const status sk = ex.copy(k, bhsd(dst, lp.kv_dims()));
  const status sv = ex.copy(v, bhsd(dst + elems, lp.kv_dims()));
  return sk ? sv : sk;
}

/// All-gather of K and V: this rank's shards packed into its slot of `slots` (slot s: rank s's K then V), the slots
/// passed around the ring (N − 1 hops), then K and V laid out in global row order in gk and gv (every slot read as
/// this rank's own when opt.parts.communicate is off). A failing copy lands in `st` and the copies after it are
/// skipped, the transfers still run (the other ranks wait for them); a failing transfer is returned.
template <class Comm, class Exec, class T>
status gather_kv(ring_link<Comm, Exec>& link, status& st, const problem& g, const tensor_ref<const T>& k,
                 const tensor_ref<const T>& v, T* slots, T* gk, T* gv, const options& opt) {
  const int n = link.comm.size(), r = link.comm.rank();
  const problem lp = shard_problem(g, n);
  const index_t kv_elems = lp.batch * lp.heads_kv * lp.seq_kv * lp.head_dim;
  auto slot = [&](int s) { return slots + index_t(s) * 2 * kv_elems; };
  if (st) {
    const status packed = pack_kv(link.ex, k, v, slot(r), lp);
    st = packed;
  }
  if (opt.parts.communicate)
    for (int i = 0; i + 1 < n; ++i) {
      typename Comm::request req{};
      if (status s = link.start(slot((r - i + n) % n), slot((r - i - 1 + n) % n), std::size_t(2 * kv_elems) * sizeof(T),
                                req);
          !s)
        return s;
      if (status s = link.finish(req); !s) return s;
    }
  const tensor_ref<T> gk_view = bhsd(gk, g.kv_dims()), gv_view = bhsd(gv, g.kv_dims());
  for (int s = 0; s < n && st; ++s) {
    const T* from = opt.parts.communicate ? slot(s) : slot(r);
    const tensor_ref<const T> ks = bhsd(from, lp.kv_dims()), vs = bhsd(from + kv_elems, lp.kv_dims());
    index_t local = 0;
    for (int p = 0; p < (opt.layout == layout::zigzag ? 2 : 1) && st; ++p) {
      const row_range rr = shard_piece(opt.layout, g.seq_kv, n, s, p);
      const status sk = link.ex.copy(rows_of(ks, local, rr.size()), rows_of(gk_view, rr.begin, rr.size()));
      const status sv = sk ? link.ex.copy(rows_of(vs, local, rr.size()), rows_of(gv_view, rr.begin, rr.size())) : sk;
      st = sv;
      local += rr.size();
    }
  }
  return {};
}

/// Whether `t` is laid out [b][h][s][d] with no gaps (a shard that can travel as it is).
template <class T>
bool packed(const tensor_ref<T>& t) {
  const dims4 d = t.dims;
  return t.stride.d == 1 && t.stride.s == d.d && t.stride.h == d.s * d.d && t.stride.b == d.h * d.s * d.d;
}

/// The schedule, on validated input that every rank agreed on. Writes o and lse only when every step succeeded on
/// every rank.
///
/// Each step's block writes its own partial result (O in T, lse in float; a part's rows that no block covered keep
/// lse = −inf); after the agreement one pass merges the parts by their lse straight into o and lse (merged_lse's
/// rules). Per ring step that is one attend call and nothing else on the compute stream: no per-step merge, no
/// float accumulator read and written N times, no final copy. The ring's first transfer sends the caller's K and V
/// as they are when they are packed (no copy into a send buffer), and step 0 computes on them.
template <class Comm, class Exec, class Policy, class T>
status run(Comm& comm, Exec& ex, const Policy& pol, const problem& g, const tensor_ref<const T>& q,
           const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<T>& o, bool is_causal,
           float* lse, const options& opt, std::uint64_t fp, timings* tm) {
  using clock = std::chrono::steady_clock;
  const auto t_start = clock::now();
  const int n = comm.size(), r = comm.rank();
  const problem lp = shard_problem(g, n);
  const index_t lq = lp.seq_q, lkv = lp.seq_kv;
  const index_t kv_elems = g.batch * g.heads_kv * lkv * g.head_dim;
  const index_t o_elems = lp.batch * lp.heads * lq * lp.head_dim;
  const bool gather = opt.strategy == strategy::all_gather ||
                      (opt.strategy == strategy::automatic && g.heads_kv < g.heads);
  // Ring: the caller's K and V are step 0's shard (and travel as they are) when both are packed.
  const bool direct = !gather && packed(k) && packed(v);
  const int part_count = gather ? 1 : n;  // ring: step i's part is part i

  // Every buffer first, then one agreement (which also answers dist::attend's check of the input on every rank):
  // a rank that cannot allocate must not leave the others in a transfer.
  T* parts = nullptr;         // part_count partial O's, [b][h][lq][d] each
  float* part_lses = nullptr;  // their lse, [b][h][lq] each
  float* block_lse = nullptr;  // a block's lse when it covers fewer rows than the shard's (packed [b][h][nq])
  T* buf[2] = {nullptr, nullptr};  // ring: the shard computed on and the one arriving
  T *all = nullptr, *gk = nullptr, *gv = nullptr;  // all-gather: one slot per rank, then K and V in global order
  status st = ex.allocate(parts, index_t(part_count) * o_elems);
  auto keep = [&st](const status& s) {  // the first failure is the one reported
    if (st) st = s;
  };
  keep(ex.allocate(part_lses, index_t(part_count) * lp.lse_size()));
  keep(ex.allocate(block_lse, lp.lse_size()));
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
  keep(ex.fill(part_lses, index_t(part_count) * lp.lse_size(), -std::numeric_limits<float>::infinity()));

  // One block against the K/V in hand (views of every key row in hand), into part `pi`'s rows [q0, q0 + nq).
  auto block = [&](const block_span& bs, const tensor_ref<const T>& kh, const tensor_ref<const T>& vh, int pi,
                   const Policy& step_pol) -> status {
    problem bp = g;
    bp.seq_q = bs.nq;
    bp.seq_kv = bs.nk;
    const tensor_ref<T> part = rows_of(bhsd(parts + pi * o_elems, lp.q_dims()), bs.q0, bs.nq);
    const bool whole = bs.nq == lq;  // attend writes lse packed [b][h][nq]: the part's own rows when they are all
    float* l = whole ? part_lses + pi * lp.lse_size() : block_lse;
    const status s = with_block_mask(bs.mask, [&](const auto& mask) {
      return fusedattn::attend(step_pol, bp, rows_of(q, bs.q0, bs.nq), rows_of(kh, bs.k0, bs.nk),
                               rows_of(vh, bs.k0, bs.nk), part, mask, l);
    });
    if (!s || whole) return s;
    const tensor_ref<const float> from{block_lse, {g.batch, g.heads, bs.nq, 1}, {g.heads * bs.nq, bs.nq, 1, 1}};
    const tensor_ref<float> to{part_lses + pi * lp.lse_size(), {g.batch, g.heads, bs.nq, 1}, {g.heads * lq, lq, 1, 1}};
    return ex.copy(from, rows_of(to, bs.q0, bs.nq));
  };
  // After a failure a rank keeps communicating (the others are waiting for its transfers) but computes no more.
  auto compute = [&](status s) {
    if (st && opt.parts.compute) st = s;
  };
  ring_link<Comm, Exec> link{comm, ex};

  if (!gather) {
    // Ring: step i computes on the shard of rank r − i while shard r − i − 1 arrives (double buffering).
    auto shard_k = [&](const T* b) { return tensor_ref<const T>(bhsd(b, lp.kv_dims())); };
    auto shard_v = [&](const T* b) { return tensor_ref<const T>(bhsd(b + kv_elems, lp.kv_dims())); };
    tensor_ref<const T> kh = k, vh = v;
    if (!direct) {
      keep(pack_kv(ex, k, v, buf[0], lp));
      kh = shard_k(buf[0]);
      vh = shard_v(buf[0]);
    }
    int cur = 0;
    for (int i = 0; i < n; ++i) {
      typename Comm::request req{}, req_v{};
      const bool moving = i + 1 < n && opt.parts.communicate;
      const bool two = moving && i == 0 && direct;  // K and V from the caller's buffers: one exchange each
      if (moving) {
        const std::size_t bytes = std::size_t(two ? kv_elems : 2 * kv_elems) * sizeof(T);
        if (status s = link.start(two ? k.data : buf[cur], buf[1 - cur], bytes, req); !s) return s;
        if (two)
          if (status s = link.start(v.data, buf[1 - cur] + kv_elems, bytes, req_v); !s) return s;
      }
      // The policy follows the real schedule (a transfer beside every step but the last) also when the
      // transfers are switched off for measuring.
      const Policy step_pol = step_policy(pol, i + 1 < n);
      if (st && opt.parts.compute)
        for (const block_span& bs : ring_blocks(r, (r - i + n) % n, lq, lkv, is_causal, opt.layout))
          compute(block(bs, kh, vh, i, step_pol));
      if (moving) {
        if (status s = link.finish(req); !s) return s;
        if (two)
          if (status s = link.finish(req_v); !s) return s;
        cur = 1 - cur;
        kh = shard_k(buf[cur]);
        vh = shard_v(buf[cur]);
      }
    }
  } else {
    if (status s = gather_kv(link, st, g, k, v, all, gk, gv, opt); !s) return s;
    if (st && opt.parts.compute)
      for (const block_span& bs : gathered_blocks(g, n, r, is_causal, opt.layout))
        compute(block(bs, bhsd<const T>(gk, g.kv_dims()), bhsd<const T>(gv, g.kv_dims()), 0, step_policy(pol, false)));
  }
  // The agreement needs what every rank enqueued to have been accepted, not to have finished: its round trip runs
  // while the last step computes, and the merge queues behind it. (A kernel that faults while running leaves the
  // device unusable, so the merge cannot run after it; the synchronisation below reports the fault.)
  if (status s = agree(comm, st, fp); !s) return s;
  // Every rank succeeded: the parts, merged, are the outputs.
  if (status s = ex.merge_parts(static_cast<const T*>(parts), part_lses, part_count, o, lse); !s) return s;
  if (status s = ex.synchronize(); !s) return s;
  if (tm) {
    tm->total = std::chrono::duration<double>(clock::now() - t_start).count();
    tm->waiting = link.waiting;
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
/// Scratch per rank (host or device memory, as the policy): the ring keeps one partial result per step (N × this
/// rank's O in T, N × its lse in float, merged in one pass at the end) and two K/V shard buffers; the all-gather one
/// partial result, the whole K and V and one K/V slot per rank.
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
    if (status s = validate_policy(pol); !s) return s;
    return validate(detail::shard_problem(global, n), q, k, v, o, fusedattn::dense{}, lse);
  };
  const status local = check();
  const std::uint64_t fp = detail::fingerprint(global, is_causal, opt, scalar_name<T>());
  // A rank with bad input only agrees; the others allocate first, and their first agreement inside run is the
  // same collective call: one round trip tells every rank about the input and the buffers together.
  if (!local) return detail::agree(comm, local, fp);
  auto ex = detail::exec_for<Policy>::make(pol);
  return detail::run(comm, ex, pol, global, tensor_ref<const T>(q), tensor_ref<const T>(k), tensor_ref<const T>(v),
                     o, is_causal, lse, opt, fp, tm);
}

}  // namespace dist
}  // namespace fusedattn
