// dist::attend over MPI, run under mpirun on 1, 2 and 3 ranks: each rank's shard of O and lse against the float64
// oracle of the whole problem (f32, f64; bf16 and f16: test_dist_mpi_half.cpp); both layouts and strategies, dense
// and causal, GQA and MQA, seq_q != seq_kv; uneven splits, a bad input on one rank, ranks that disagree and
// unsupported masks are refused by every rank with nothing written. Checks use CHECK after the collective call so every rank stays in step.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "mpi_case.hpp"

using namespace fusedattn::testing;  // and its aliases fa, dist (mpi_case.hpp)
using fusedattn::index_t;

namespace {

/// f32 / f64: the shard against the float64 oracle of the whole problem.
template <class T>
void against_oracle(dist::mpi_comm& comm, const fa::problem& p, const fa::any_mask& mask, const dist::options& opt) {
  sharded_case<T> c(p, opt.layout, comm);
  INFO(describe_run<T>(comm, p, mask, opt, c.seed));
  require_ok(c.run(comm, mask, opt));
  const expected e = expect(c.whole, bind_band(mask, p));
  const std::vector<double> ref_o = shard_rows_of(e.ref.o, p, p.head_dim, opt.layout, comm.size(), comm.rank());
  const std::vector<double> ref_lse = shard_rows_of(e.ref.lse, p, 1, opt.layout, comm.size(), comm.rank());
  const double allowance = merge_allowance<T>(comm.size(), max_abs_finite(e.ref.lse));
  const double err = shard_error(c.o, ref_o);
  INFO("max error " << err << " tolerance " << e.tolerance + allowance);
  CHECK(err <= e.tolerance + allowance);
  const double lse_err = max_lse_error(c.lse, ref_lse);
  INFO("lse error " << lse_err << " tolerance " << e.lse_tolerance + allowance);
  CHECK(lse_err <= e.lse_tolerance + allowance);
}

}  // namespace

TEST_CASE("dist::attend over MPI: f32 and f64 against the float64 oracle", "[dist][mpi]") {
  dist::mpi_comm comm;
  for_each_run(sharded_shapes(comm.size()), {dist::layout::contiguous, dist::layout::zigzag},
               {dist::strategy::ring, dist::strategy::all_gather, dist::strategy::automatic},
               [&](const fa::problem& p, const fa::any_mask& mask, const dist::options& opt) {
                 against_oracle<float>(comm, p, mask, opt);
                 against_oracle<double>(comm, p, mask, opt);
               });
}

TEST_CASE("dist::attend over MPI: K and V in strided views (copied before the ring) give the packed result",
          "[dist][mpi]") {
  dist::mpi_comm comm;
  const int n = comm.size();
  const fa::problem p{2, 3, 3, 2 * n * 7, 2 * n * 7, 24};
  for (const fa::any_mask& mask : {fa::any_mask(fa::causal{}), fa::any_mask(fa::dense{})}) {
    sharded_case<float> c(p, dist::layout::zigzag, comm);
    INFO(describe_run<float>(comm, p, mask, {}, c.seed));
    require_ok(c.run(comm, mask, {dist::layout::zigzag, dist::strategy::ring, {}}));
    // The same shards of K and V with 5 unused floats after every row.
    const fa::index_t d = p.head_dim, pad = d + 5, rows = c.local.batch * c.local.heads_kv * c.local.seq_kv;
    std::vector<float> ks(static_cast<std::size_t>(rows * pad), 9.f), vs(ks.size(), 9.f);
    for (fa::index_t i = 0; i < rows; ++i)
      for (fa::index_t x = 0; x < d; ++x) {
        ks[static_cast<std::size_t>(i * pad + x)] = c.k[static_cast<std::size_t>(i * d + x)];
        vs[static_cast<std::size_t>(i * pad + x)] = c.v[static_cast<std::size_t>(i * d + x)];
      }
    const fa::dims4 kd = c.local.kv_dims();
    const fa::strides4 st{kd.h * kd.s * pad, kd.s * pad, pad, 1};
    std::vector<float> o(c.o.size(), sentinel), lse(c.lse.size(), sentinel);
    require_ok(dist::attend(comm, fa::policy::cpu<>{1}, p, fa::bhsd<const float>(c.q.data(), c.local.q_dims()),
                            fa::tensor_ref<const float>{ks.data(), kd, st}, fa::tensor_ref<const float>{vs.data(), kd, st},
                            fa::bhsd(o.data(), c.local.o_dims()), mask, lse.data(),
                            {dist::layout::zigzag, dist::strategy::ring, {}}));
    double err = 0, lse_err = 0;
    for (std::size_t i = 0; i < o.size(); ++i) err = std::max(err, double(std::abs(o[i] - c.o[i])));
    for (std::size_t i = 0; i < lse.size(); ++i) lse_err = std::max(lse_err, double(std::abs(lse[i] - c.lse[i])));
    CHECK(err <= 1e-6);
    CHECK(lse_err <= 1e-6);
  }
}

TEST_CASE("dist::attend over MPI: refusals reach every rank and nothing is written", "[dist][mpi]") {
  dist::mpi_comm comm;
  const int n = comm.size();
  const fa::problem p{1, 2, 2, 4 * n, 4 * n, 16};
  auto refused = [&](sharded_case<float>& c, const fa::status& st, fa::errc code, const std::string& own) {
    INFO(st.what());
    CHECK(st.code() == code);
    if (!own.empty()) CHECK(st.message().find(own) != std::string::npos);
    for (float x : c.o) CHECK(x == sentinel);
    for (float x : c.lse) CHECK(x == sentinel);
  };
  SECTION("a sequence that does not split evenly") {
    fa::problem odd = p;
    odd.seq_q = odd.seq_kv = 4 * n + 1;
    sharded_case<float> c(p, dist::layout::zigzag, comm);
    const fa::status st = dist::attend(comm, fa::policy::cpu<>{1}, odd, fa::bhsd<const float>(c.q.data(), c.local.q_dims()),
                                       fa::bhsd<const float>(c.k.data(), c.local.kv_dims()),
                                       fa::bhsd<const float>(c.v.data(), c.local.kv_dims()),
                                       fa::bhsd(c.o.data(), c.local.o_dims()), fa::causal{}, c.lse.data());
    refused(c, st, fa::errc::invalid_argument, "problem.seq_q is " + std::to_string(4 * n + 1));
  }
  SECTION("the last rank passes a null q: it names the field, every other rank names it") {
    sharded_case<float> c(p, dist::layout::zigzag, comm);
    const bool culprit = comm.rank() == n - 1;
    const fa::status st =
        dist::attend(comm, fa::policy::cpu<>{1}, p,
                     fa::bhsd<const float>(culprit ? nullptr : c.q.data(), c.local.q_dims()),
                     fa::bhsd<const float>(c.k.data(), c.local.kv_dims()),
                     fa::bhsd<const float>(c.v.data(), c.local.kv_dims()), fa::bhsd(c.o.data(), c.local.o_dims()),
                     fa::causal{}, c.lse.data());
    refused(c, st, fa::errc::invalid_argument, culprit ? "q.data is null" : "rank " + std::to_string(n - 1) + " failed");
  }
  SECTION("the ranks disagree on the scale") {
    sharded_case<float> c(p, dist::layout::zigzag, comm);
    fa::problem mine = p;
    if (comm.rank() == 0) mine.scale = 0.5;
    const fa::status st = dist::attend(comm, fa::policy::cpu<>{1}, mine, fa::bhsd<const float>(c.q.data(), c.local.q_dims()),
                                       fa::bhsd<const float>(c.k.data(), c.local.kv_dims()),
                                       fa::bhsd<const float>(c.v.data(), c.local.kv_dims()),
                                       fa::bhsd(c.o.data(), c.local.o_dims()), fa::dense{}, c.lse.data());
    if (n > 1)
      refused(c, st, fa::errc::invalid_argument, "different problems");
    else
      CHECK(st.ok());  // one rank has no one to disagree with
  }
  SECTION("a window mask, and causal with seq_q != seq_kv, are unsupported") {
    sharded_case<float> c(p, dist::layout::zigzag, comm);
    refused(c, c.run(comm, fa::window{3, 0}, {}), fa::errc::unsupported, "dense and causal");
    fa::problem cross = p;
    cross.seq_kv = 2 * p.seq_kv;
    std::vector<float> k2(c.k.size() * 2, 0.5f), v2(k2.size(), 0.5f);
    fa::problem lc = c.local;
    lc.seq_kv = 2 * c.local.seq_kv;
    const fa::status st = dist::attend(comm, fa::policy::cpu<>{1}, cross, fa::bhsd<const float>(c.q.data(), lc.q_dims()),
                                       fa::bhsd<const float>(k2.data(), lc.kv_dims()),
                                       fa::bhsd<const float>(v2.data(), lc.kv_dims()), fa::bhsd(c.o.data(), lc.o_dims()),
                                       fa::causal{}, c.lse.data());
    refused(c, st, fa::errc::unsupported, "seq_q = seq_kv");
  }
}
