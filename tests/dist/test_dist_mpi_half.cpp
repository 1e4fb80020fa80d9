// dist::attend over MPI with bf16 and f16: each rank's shard against one process's attend over the whole problem on
// the same inputs, and against the float64 oracle, within TransformerEngine's context-parallel tolerances (bf16
// 2.5e-2, f16 5e-3, as atol = rtol); ring and all-gather, dense and causal, MHA and GQA. (Its own translation unit:
// the two halves of the MPI tests compile in parallel.)
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "mpi_case.hpp"

using namespace fusedattn::testing;  // and its aliases fa, dist (mpi_case.hpp)
using fusedattn::index_t;

namespace {

/// bf16 / f16: the shard against one process's attend over the whole problem on the same inputs, and against the
/// oracle, with TransformerEngine's context-parallel tolerances: |x − y| <= atol + rtol·|y|.
template <class T>
void against_one_process(dist::mpi_comm& comm, const fa::problem& p, const fa::any_mask& mask,
                         const dist::options& opt) {
  sharded_case<T> c(p, opt.layout, comm);
  INFO(describe_run<T>(comm, p, mask, opt, c.seed));
  require_ok(c.run(comm, mask, opt));
  std::vector<T> one(static_cast<std::size_t>(p.batch * p.heads * p.seq_q * p.head_dim));
  std::vector<float> one_lse(static_cast<std::size_t>(p.lse_size()));
  REQUIRE(fa::attend(fa::policy::cpu<>{1}, p, c.whole.q.cview(), c.whole.k.cview(), c.whole.v.cview(),
                     fa::bhsd(one.data(), p.o_dims()), mask, one_lse.data())
              .ok());
  const std::vector<double> one_d(one.begin(), one.end());
  const std::vector<double> one_lse_d(one_lse.begin(), one_lse.end());
  const std::vector<double> ref_o = shard_rows_of(one_d, p, p.head_dim, opt.layout, comm.size(), comm.rank());
  const std::vector<double> ref_lse = shard_rows_of(one_lse_d, p, 1, opt.layout, comm.size(), comm.rank());
  const reference oracle = reference_attention<double>(p, c.whole.q.cview(), c.whole.k.cview(), c.whole.v.cview(),
                                                       bind_band(mask, p));
  const std::vector<double> oracle_o = shard_rows_of(oracle.o, p, p.head_dim, opt.layout, comm.size(), comm.rank());
  constexpr double tol = te_tolerance<T>();
  CHECK(count_outside(c.o, ref_o, tol) == 0);
  CHECK(count_outside(c.o, oracle_o, tol) == 0);
  CHECK(max_lse_error(c.lse, ref_lse) <= tol);
}

}  // namespace

TEST_CASE("dist::attend over MPI: bf16 and f16 against one process, TransformerEngine tolerances", "[dist][mpi]") {
  dist::mpi_comm comm;
  const index_t u = 2 * comm.size();
  for_each_run({{1, 4, 4, u * 32, u * 32, 64}, {2, 8, 2, u * 19, u * 19, 128}}, {dist::layout::zigzag},
               {dist::strategy::ring, dist::strategy::all_gather},
               [&](const fa::problem& p, const fa::any_mask& mask, const dist::options& opt) {
                 against_one_process<Eigen::bfloat16>(comm, p, mask, opt);
                 against_one_process<Eigen::half>(comm, p, mask, opt);
               });
}

