/// @file mpi_case.hpp
/// The MPI tests' case: a whole problem built alike on every rank from a seed rank 0 draws, this rank's shards of
/// Q, K and V, and its dist::attend call; the shapes and runs the forward and backward tests sweep, and the
/// error of a shard against reference rows (the float64 bound, or TransformerEngine's tolerance).
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include <fusedattn/dist/attend.hpp>
#include <fusedattn/dist/mpi.hpp>

#include "dist_support.hpp"
#include "support/check.hpp"

namespace fusedattn::testing {

namespace fa = fusedattn;
namespace dist = fusedattn::dist;

/// A seed drawn on rank 0 and shared, so every rank builds the same whole-sequence inputs.
inline std::uint64_t shared_seed(dist::mpi_comm& comm) {
  std::uint64_t seed = fresh_seed();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, comm.native());
  return seed;
}

/// What a sharded case's outputs hold until a call writes them.
constexpr float sentinel = 7.0f;

/// A whole problem, its inputs, and this rank's shards of Q, K, V; O and lse filled with the sentinel.
template <class T>
struct sharded_case {
  std::uint64_t seed;    ///< drawn on rank 0 (shared_seed), the same on every rank
  std::mt19937_64 rng;   ///< seeded with it; the whole problem's inputs are its first draws
  attention_case<T> whole;
  std::vector<T> q, k, v, o;
  std::vector<float> lse;
  fa::problem local;
  sharded_case(const fa::problem& p, dist::layout l, dist::mpi_comm& comm)
      : seed(shared_seed(comm)),
        rng(seed),
        whole(p, layout::bshd, rng),
        q(shard_of(whole.q.cview(), l, comm.size(), comm.rank())),
        k(shard_of(whole.k.cview(), l, comm.size(), comm.rank())),
        v(shard_of(whole.v.cview(), l, comm.size(), comm.rank())),
        o(q.size(), T(sentinel)),
        lse(static_cast<std::size_t>(p.batch * p.heads * dist::shard_rows(p.seq_q, comm.size())), sentinel),
        local(p) {
    local.seq_q = dist::shard_rows(p.seq_q, comm.size());
    local.seq_kv = dist::shard_rows(p.seq_kv, comm.size());
  }
  fa::status run(dist::mpi_comm& comm, const fa::any_mask& mask, const dist::options& opt) {
    const fa::problem& p = whole.p;
    return dist::attend(comm, fa::policy::cpu<>{1}, p, fa::bhsd<const T>(q.data(), local.q_dims()),
                        fa::bhsd<const T>(k.data(), local.kv_dims()), fa::bhsd<const T>(v.data(), local.kv_dims()),
                        fa::bhsd(o.data(), local.o_dims()), mask, lse.data(), opt);
  }
};

/// A status every rank must see succeed (the collective calls return the same status on every rank).
inline void require_ok(const status& st) {
  INFO(st.what());
  REQUIRE(st.ok());
}

/// The shapes the sharded tests sweep for `ranks` ranks: lengths in zigzag units (2·ranks rows), so both layouts
/// split them; no shard lines up with a kernel tile.
inline std::vector<problem> sharded_shapes(int ranks) {
  const index_t u = 2 * ranks;
  return {
      {1, 1, 1, u, u, 1},             // one row per chunk
      {2, 3, 3, u * 21, u * 21, 64},  // chunks of 21 rows: no tile boundary lines up
      {1, 4, 2, u * 17, u * 17, 80},  // GQA
      {1, 4, 1, u * 9, u * 9, 3},     // MQA, tiny head_dim
      {1, 2, 2, u * 5, u * 67, 96},   // seq_q != seq_kv (dense only)
  };
}

/// f(problem, mask, options) for every shape, dense and causal (causal only where seq_q = seq_kv), every layout and
/// strategy given.
template <class F>
void for_each_run(const std::vector<problem>& shapes, std::initializer_list<dist::layout> layouts,
                  std::initializer_list<dist::strategy> strategies, F&& f) {
  for (const problem& p : shapes)
    for (const any_mask& mask : {any_mask{dense{}}, any_mask{causal{}}})
      for (dist::layout l : layouts)
        for (dist::strategy s : strategies) {
          if (std::holds_alternative<causal>(mask) && p.seq_q != p.seq_kv) continue;
          f(p, mask, dist::options{l, s, {}});
        }
}

/// One sharded run in words, for a failure's message: type, shape, mask, layout, strategy, ranks, rank and seed.
template <class T>
std::string describe_run(const dist::mpi_comm& comm, const problem& p, const any_mask& mask, const dist::options& opt,
                         std::uint64_t seed) {
  return std::string(scalar_name<T>()) + " " + describe(p) + " " + describe(mask) + " " +
         dist::layout_name(opt.layout) + " " + dist::strategy_name(opt.strategy) + " ranks " +
         std::to_string(comm.size()) + " rank " + std::to_string(comm.rank()) + " seed=" + std::to_string(seed);
}

/// TransformerEngine's context-parallel tolerance for a 16-bit type, taken as atol = rtol: bf16 2.5e-2, f16 5e-3.
template <class T>
constexpr double te_tolerance() {
  static_assert(std::is_same_v<T, Eigen::bfloat16> || std::is_same_v<T, Eigen::half>,
                "TransformerEngine's tolerances are for bf16 and f16");
  return std::is_same_v<T, Eigen::bfloat16> ? 2.5e-2 : 5e-3;
}

/// The elements of a shard outside |x − ref| <= tol + tol·|ref| (TransformerEngine's form with atol = rtol = tol).
template <class T>
int count_outside(const std::vector<T>& got, const std::vector<double>& ref, double tol) {
  int bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double x = static_cast<double>(got[i]);
    if (!(std::abs(x - ref[i]) <= tol + tol * std::abs(ref[i]))) ++bad;
  }
  return bad;
}

/// Max |x − ref| of one of this rank's shards (contiguous) against reference rows in shard order (NaN: infinite).
template <class T>
double shard_error(const std::vector<T>& o, const std::vector<double>& ref) {
  double err = 0;
  for (std::size_t i = 0; i < o.size(); ++i) {
    const double x = static_cast<double>(o[i]);
    err = std::max(err, std::isnan(x) ? std::numeric_limits<double>::infinity() : std::abs(x - ref[i]));
  }
  return err;
}

}  // namespace fusedattn::testing
