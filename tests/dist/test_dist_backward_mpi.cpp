// dist::attend_backward over MPI, run under mpirun on 1, 2 and 3 ranks: O and lse from dist::attend, then each
// rank's shards of dQ, dK and dV against the float64 gradient oracle of the whole problem (FlashAttention's rule:
// 2 × a plain same-precision implementation's error, plus the rounding of one part per rank), f32 and f64; bf16 and
// f16 also against one process's attend_backward with TransformerEngine's tolerances. Both layouts and strategies,
// dense and causal, GQA and MQA, seq_q != seq_kv, shards that line up with no tile. Bad input on one rank, uneven
// splits, disagreeing ranks, unsupported masks and policies are refused by every rank with nothing written.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>

#include <fusedattn/dist/backward.hpp>

#include "mpi_case.hpp"
#include "support/backward_check.hpp"

using namespace fusedattn::testing;  // and its aliases fa, dist (mpi_case.hpp)
using fusedattn::index_t;

namespace {

/// sharded_case (q, k, v, their shards; O and lse from dist::attend) with dO and the gradient shards (filled with
/// the sentinel).
template <class T>
struct backward_shards : sharded_case<T> {
  operand<T> d_o_whole;
  std::vector<T> d_o, dq, dk, dv;
  backward_shards(const fa::problem& p, dist::layout l, dist::mpi_comm& comm)
      : sharded_case<T>(p, l, comm),
        d_o_whole(p.o_dims(), layout::bshd),
        dq(this->q.size(), T(sentinel)),
        dk(this->k.size(), T(sentinel)),
        dv(this->k.size(), T(sentinel)) {
    d_o_whole.fill(this->rng);
    d_o = shard_of(d_o_whole.cview(), l, comm.size(), comm.rank());
  }
  fa::tensor_ref<const T> in(const std::vector<T>& x, const fa::dims4& d) const { return fa::bhsd<const T>(x.data(), d); }
  /// dist::attend for O and lse (the forward this backward belongs to).
  fa::status forward(dist::mpi_comm& comm, const fa::any_mask& mask, const dist::options& opt) {
    return this->run(comm, mask, opt);
  }
  template <class Policy = fa::policy::cpu<>>
  fa::status backward(dist::mpi_comm& comm, const fa::any_mask& mask, const dist::options& opt,
                      const Policy& pol = Policy{1}) {
    const fa::problem& lp = this->local;
    return dist::attend_backward(comm, pol, this->whole.p, in(this->q, lp.q_dims()), in(this->k, lp.kv_dims()),
                                 in(this->v, lp.kv_dims()), in(this->o, lp.o_dims()), in(d_o, lp.o_dims()),
                                 this->lse.data(), fa::bhsd(dq.data(), lp.q_dims()), fa::bhsd(dk.data(), lp.kv_dims()),
                                 fa::bhsd(dv.data(), lp.kv_dims()), mask, opt);
  }
  bool untouched() const {
    for (const std::vector<T>* g : {&dq, &dk, &dv})
      for (const T& x : *g)
        if (!(static_cast<float>(x) == sentinel)) return false;
    return true;
  }
};

/// Rows of a whole-sequence K/V-shaped reference [b][h_kv][j][c], in the order of rank `rank`'s shard.
std::vector<double> kv_shard_rows_of(const std::vector<double>& whole, const fa::problem& p, dist::layout l, int ranks,
                                     int rank) {
  fa::problem kv = p;
  kv.heads = p.heads_kv;
  kv.seq_q = p.seq_kv;
  return shard_rows_of(whole, kv, p.head_dim, l, ranks, rank);
}

/// FlashAttention's rule for one gradient shard (gradient_tolerance over the whole problem), with what the sharding
/// adds relative to the gradient's size: every rank's part rounded to T before the sum, and P = exp(s − lse) formed
/// from dist::attend's merged float lse (merge_allowance; it dominates for f64, whose plain error is itself that of
/// a float lse).
template <class T>
void check_gradient(const char* name, const std::vector<T>& got, const std::vector<double>& oracle_shard,
                    const std::vector<double>& oracle, const std::vector<double>& plain, int ranks,
                    double max_abs_lse) {
  const double tol = gradient_tolerance<T>(oracle, plain, merge_allowance<T>(ranks, max_abs_lse));
  const double err = shard_error(got, oracle_shard);
  INFO(name << ": error " << err << " plain error " << max_difference(plain, oracle) << " tolerance " << tol);
  CHECK(err <= tol);
}

/// dist::attend then dist::attend_backward on a fresh whole problem; the gradient shards against the oracle, and
/// (the 16-bit types) against one process's attend_backward on the same inputs within TransformerEngine's tolerance.
template <class T>
void against_oracle(dist::mpi_comm& comm, const fa::problem& p, const fa::any_mask& mask, const dist::options& opt) {
  backward_shards<T> c(p, opt.layout, comm);
  const int n = comm.size(), r = comm.rank();
  INFO(describe_run<T>(comm, p, mask, opt, c.seed));
  require_ok(c.forward(comm, mask, opt));
  require_ok(c.backward(comm, mask, opt));
  // One process over the whole problem: O and lse (for the plain implementation), and its gradients.
  operand<T> o(p.o_dims(), layout::bhsd), dq(p.q_dims(), layout::bhsd), dk(p.kv_dims(), layout::bhsd),
      dv(p.kv_dims(), layout::bhsd);
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
  REQUIRE(fa::attend(fa::policy::cpu<>{1}, p, c.whole.q.cview(), c.whole.k.cview(), c.whole.v.cview(), o.view, mask,
                     lse.data())
              .ok());
  const fa::band_mask bound = bind_band(mask, p);
  const reference_grads ref = reference_backward(p, c.whole.q.cview(), c.whole.k.cview(), c.whole.v.cview(),
                                                 c.d_o_whole.cview(), bound);
  const reference_grads plain = plain_backward(p, c.whole.q.cview(), c.whole.k.cview(), c.whole.v.cview(), o.cview(),
                                               c.d_o_whole.cview(), lse.data(), bound);
  const dist::layout l = opt.layout;
  const double lse_max = max_abs_finite(std::vector<double>(lse.begin(), lse.end()));
  check_gradient("dq", c.dq, shard_rows_of(ref.dq, p, p.head_dim, l, n, r), ref.dq, plain.dq, n, lse_max);
  check_gradient("dk", c.dk, kv_shard_rows_of(ref.dk, p, l, n, r), ref.dk, plain.dk, n, lse_max);
  check_gradient("dv", c.dv, kv_shard_rows_of(ref.dv, p, l, n, r), ref.dv, plain.dv, n, lse_max);
  if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double>) {
    constexpr double tol = te_tolerance<T>();
    REQUIRE(fa::attend_backward(fa::policy::cpu<>{1}, p, c.whole.q.cview(), c.whole.k.cview(), c.whole.v.cview(),
                                o.cview(), c.d_o_whole.cview(), lse.data(), dq.view, dk.view, dv.view, mask)
                .ok());
    auto as_double = [](const operand<T>& x) { return std::vector<double>(x.buf.begin(), x.buf.end()); };
    CHECK(count_outside(c.dq, shard_rows_of(as_double(dq), p, p.head_dim, l, n, r), tol) == 0);
    CHECK(count_outside(c.dk, kv_shard_rows_of(as_double(dk), p, l, n, r), tol) == 0);
    CHECK(count_outside(c.dv, kv_shard_rows_of(as_double(dv), p, l, n, r), tol) == 0);
  }
}

}  // namespace

TEST_CASE("dist::attend_backward over MPI: f32 and f64 against the float64 gradient oracle", "[dist][mpi][backward]") {
  dist::mpi_comm comm;
  for_each_run(sharded_shapes(comm.size()), {dist::layout::contiguous, dist::layout::zigzag},
               {dist::strategy::ring, dist::strategy::all_gather},
               [&](const fa::problem& p, const fa::any_mask& mask, const dist::options& opt) {
                 against_oracle<float>(comm, p, mask, opt);
                 against_oracle<double>(comm, p, mask, opt);
               });
}

TEST_CASE("dist::attend_backward over MPI: bf16 and f16 against the oracle and one process", "[dist][mpi][backward]") {
  dist::mpi_comm comm;
  const index_t u = 2 * comm.size();
  for_each_run({{1, 2, 2, u * 24, u * 24, 64}, {1, 4, 2, u * 13, u * 13, 128}}, {dist::layout::zigzag},
               {dist::strategy::ring, dist::strategy::automatic},
               [&](const fa::problem& p, const fa::any_mask& mask, const dist::options& opt) {
                 against_oracle<Eigen::bfloat16>(comm, p, mask, opt);
                 against_oracle<Eigen::half>(comm, p, mask, opt);
               });
}

TEST_CASE("dist::attend_backward over MPI: refusals reach every rank and nothing is written", "[dist][mpi][backward]") {
  dist::mpi_comm comm;
  const int n = comm.size();
  const fa::problem p{1, 2, 2, 4 * n, 4 * n, 16};
  backward_shards<float> c(p, dist::layout::zigzag, comm);
  REQUIRE(c.forward(comm, fa::causal{}, {}).ok());
  auto refused = [&](const fa::status& st, fa::errc code, const std::string& own) {
    INFO(st.what());
    CHECK(st.code() == code);
    if (!own.empty()) CHECK(st.message().find(own) != std::string::npos);
    CHECK(c.untouched());
  };
  const bool culprit = comm.rank() == n - 1;
  const std::string elsewhere = "rank " + std::to_string(n - 1) + " failed";
  auto in = [&](const std::vector<float>& x, const fa::dims4& d) { return fa::bhsd<const float>(x.data(), d); };
  SECTION("the last rank passes a null d_o: it names the field, every other rank names it") {
    const fa::status st = dist::attend_backward(
        comm, fa::policy::cpu<>{1}, p, in(c.q, c.local.q_dims()), in(c.k, c.local.kv_dims()), in(c.v, c.local.kv_dims()),
        in(c.o, c.local.o_dims()), fa::bhsd<const float>(culprit ? nullptr : c.d_o.data(), c.local.o_dims()),
        c.lse.data(), fa::bhsd(c.dq.data(), c.local.q_dims()), fa::bhsd(c.dk.data(), c.local.kv_dims()),
        fa::bhsd(c.dv.data(), c.local.kv_dims()), fa::causal{});
    refused(st, fa::errc::invalid_argument, culprit ? "d_o.data is null" : elsewhere);
  }
  SECTION("the last rank passes dv on dk's memory") {
    float* dv = culprit ? c.dk.data() : c.dv.data();
    const fa::status st = dist::attend_backward(
        comm, fa::policy::cpu<>{1}, p, in(c.q, c.local.q_dims()), in(c.k, c.local.kv_dims()), in(c.v, c.local.kv_dims()),
        in(c.o, c.local.o_dims()), in(c.d_o, c.local.o_dims()), c.lse.data(), fa::bhsd(c.dq.data(), c.local.q_dims()),
        fa::bhsd(c.dk.data(), c.local.kv_dims()), fa::bhsd(dv, c.local.kv_dims()), fa::causal{});
    refused(st, fa::errc::invalid_argument, culprit ? "dk overlaps dv" : elsewhere);
  }
  SECTION("the last rank passes no lse") {
    const fa::status st = dist::attend_backward(
        comm, fa::policy::cpu<>{1}, p, in(c.q, c.local.q_dims()), in(c.k, c.local.kv_dims()), in(c.v, c.local.kv_dims()),
        in(c.o, c.local.o_dims()), in(c.d_o, c.local.o_dims()), culprit ? nullptr : c.lse.data(),
        fa::bhsd(c.dq.data(), c.local.q_dims()), fa::bhsd(c.dk.data(), c.local.kv_dims()),
        fa::bhsd(c.dv.data(), c.local.kv_dims()), fa::causal{});
    refused(st, fa::errc::invalid_argument, culprit ? "lse is null" : elsewhere);
  }
  SECTION("a sequence that does not split evenly") {
    fa::problem odd = p;
    odd.seq_q = odd.seq_kv = 4 * n + 1;
    const fa::status st = dist::attend_backward(
        comm, fa::policy::cpu<>{1}, odd, in(c.q, c.local.q_dims()), in(c.k, c.local.kv_dims()),
        in(c.v, c.local.kv_dims()), in(c.o, c.local.o_dims()), in(c.d_o, c.local.o_dims()), c.lse.data(),
        fa::bhsd(c.dq.data(), c.local.q_dims()), fa::bhsd(c.dk.data(), c.local.kv_dims()),
        fa::bhsd(c.dv.data(), c.local.kv_dims()), fa::causal{});
    refused(st, fa::errc::invalid_argument, "problem.seq_q is " + std::to_string(4 * n + 1));
  }
  SECTION("the ranks disagree on the layout") {
    const dist::options opt{comm.rank() == 0 ? dist::layout::contiguous : dist::layout::zigzag, {}, {}};
    const fa::status st = c.backward(comm, fa::causal{}, opt);
    if (n > 1)
      refused(st, fa::errc::invalid_argument, "different problems");
    else
      CHECK(st.ok());  // one rank has no one to disagree with
  }
  SECTION("a window mask, and a policy without a backward kernel, are unsupported") {
    refused(c.backward(comm, fa::window{3, 0}, {}), fa::errc::unsupported, "dense and causal");
    refused(c.backward(comm, fa::causal{}, {}, fa::policy::cpu_naive{1}), fa::errc::unsupported, "");
  }
}
