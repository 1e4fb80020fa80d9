/// @file mpi_case.hpp
/// The MPI tests' case: a whole problem built alike on every rank from a seed rank 0 draws, this rank's shards of
/// Q, K and V, and its dist::attend call; plus the error of a shard against reference rows.
#pragma once

#include <cmath>
#include <limits>
#include <random>
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

/// A whole problem, its inputs, and this rank's shards of Q, K, V.
template <class T>
struct sharded_case {
  attention_case<T> whole;
  std::vector<T> q, k, v, o;
  std::vector<float> lse;
  fa::problem local;
  sharded_case(const fa::problem& p, dist::layout l, dist::mpi_comm& comm, std::mt19937_64& rng)
      : whole(p, layout::bshd, rng),
        q(shard_of(whole.q.cview(), l, comm.size(), comm.rank())),
        k(shard_of(whole.k.cview(), l, comm.size(), comm.rank())),
        v(shard_of(whole.v.cview(), l, comm.size(), comm.rank())),
        o(q.size(), T(7.0f)),
        lse(static_cast<std::size_t>(p.batch * p.heads * dist::shard_rows(p.seq_q, comm.size())), 7.0f),
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

/// Max |x − ref| of this rank's O shard (contiguous) against reference rows in shard order.
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
