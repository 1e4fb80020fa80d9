// Example 13: context parallelism on CPU processes. One attention whose sequence is sharded over the MPI ranks:
// every rank holds a shard of Q, K and V (zigzag: chunks r and 2N-1-r of 2N), dist::attend rotates the K/V shards
// around the ring (or gathers them, for GQA) and merges the partial results by their lse. Each rank checks its rows
// against a float64 loop over the whole sequence; then dist::attend_backward turns the forward's O and lse and a
// gradient dO into this rank's dQ, dK and dV, checked against one process's attend_backward over the whole sequence.
//   mpirun -np 2 ./example_13_context_parallel            check (exit 1 on a mismatch)
//   mpirun -np 2 ./example_13_context_parallel --bench    scaling efficiency and communication hidden / exposed
//        [--seq 2048,4096] [--heads 8] [--dim 64] [--reps 3]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <fusedattn/fusedattn.hpp>
#include <fusedattn/dist/backward.hpp>  // dist::attend and dist::attend_backward
#include <fusedattn/dist/mpi.hpp>

namespace fa = fusedattn;
namespace dist = fusedattn::dist;

namespace {

/// Rank `rank`'s shard rows of a whole (b, h, S, d) buffer laid out B·H·S·D.
std::vector<float> shard(const std::vector<float>& whole, const fa::dims4& d, int ranks, int rank) {
  const fa::index_t rows = dist::shard_rows(d.s, ranks);
  std::vector<float> out(static_cast<std::size_t>(d.b * d.h * rows * d.d));
  for (fa::index_t bh = 0; bh < d.b * d.h; ++bh) {
    fa::index_t local = 0;
    for (int part = 0; part < 2; ++part) {
      const dist::row_range rr = dist::shard_piece(dist::layout::zigzag, d.s, ranks, rank, part);
      std::copy(whole.begin() + (bh * d.s + rr.begin) * d.d, whole.begin() + (bh * d.s + rr.end) * d.d,
                out.begin() + (bh * rows + local) * d.d);
      local += rr.size();
    }
  }
  return out;
}

std::vector<float> random_values(std::size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> x(n);
  for (float& e : x) e = u(rng);
  return x;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Causal attention of one query row over a whole sequence in float64: the check's reference.
void reference_row(const fa::problem& p, const std::vector<float>& q, const std::vector<float>& k,
                   const std::vector<float>& v, fa::index_t b, fa::index_t h, fa::index_t i, std::vector<double>& out) {
  const fa::index_t g = p.kv_head(h), d = p.head_dim;
  const float* qi = &q[static_cast<std::size_t>(((b * p.heads + h) * p.seq_q + i) * d)];
  std::vector<double> s(static_cast<std::size_t>(i + 1));
  double m = -INFINITY;
  for (fa::index_t j = 0; j <= i; ++j) {
    const float* kj = &k[static_cast<std::size_t>(((b * p.heads_kv + g) * p.seq_kv + j) * d)];
    double dot = 0;
    for (fa::index_t c = 0; c < d; ++c) dot += double(qi[c]) * kj[c];
    s[static_cast<std::size_t>(j)] = dot * p.softmax_scale();
    m = std::max(m, s[static_cast<std::size_t>(j)]);
  }
  double l = 0;
  out.assign(static_cast<std::size_t>(d), 0.0);
  for (fa::index_t j = 0; j <= i; ++j) {
    const double e = std::exp(s[static_cast<std::size_t>(j)] - m);
    l += e;
    const float* vj = &v[static_cast<std::size_t>(((b * p.heads_kv + g) * p.seq_kv + j) * d)];
    for (fa::index_t c = 0; c < d; ++c) out[static_cast<std::size_t>(c)] += e * vj[c];
  }
  for (double& x : out) x /= l;
}

/// The backward pass of the sharded call: dQ, dK, dV of this rank's shards from its O and lse, against the rows of
/// one process's attend + attend_backward over the whole sequence. Returns the largest difference relative to the
/// largest gradient (every rank's).
double backward_error(dist::mpi_comm& comm, const fa::problem& p, const fa::problem& local, dist::strategy s,
                      const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                      const std::vector<float>& d_o, const std::vector<float>& o, const std::vector<float>& lse) {
  const int n = comm.size(), r = comm.rank();
  const std::vector<float> ql = shard(q, p.q_dims(), n, r), kl = shard(k, p.kv_dims(), n, r),
                           vl = shard(v, p.kv_dims(), n, r), dol = shard(d_o, p.o_dims(), n, r);
  std::vector<float> dq(ql.size()), dk(kl.size()), dv(vl.size());
  const fa::status st = dist::attend_backward(
      comm, fa::policy::cpu<>{1}, p, fa::bhsd<const float>(ql.data(), local.q_dims()),
      fa::bhsd<const float>(kl.data(), local.kv_dims()), fa::bhsd<const float>(vl.data(), local.kv_dims()),
      fa::bhsd<const float>(o.data(), local.o_dims()), fa::bhsd<const float>(dol.data(), local.o_dims()), lse.data(),
      fa::bhsd(dq.data(), local.q_dims()), fa::bhsd(dk.data(), local.kv_dims()), fa::bhsd(dv.data(), local.kv_dims()),
      fa::causal{}, dist::options{dist::layout::zigzag, s, {}});
  if (!st) {
    std::fprintf(stderr, "rank %d: %s\n", r, st.what());
    return INFINITY;
  }
  // One process: the whole forward (for O and lse), then the whole backward; this rank's rows of its gradients.
  std::vector<float> ow(q.size()), lw(static_cast<std::size_t>(p.lse_size())), dqw(q.size()), dkw(k.size()), dvw(v.size());
  const auto whole = [](const std::vector<float>& x, const fa::dims4& d) { return fa::bhsd<const float>(x.data(), d); };
  if (!fa::attend(fa::policy::cpu<>{1}, p, whole(q, p.q_dims()), whole(k, p.kv_dims()), whole(v, p.kv_dims()),
                  fa::bhsd(ow.data(), p.o_dims()), fa::causal{}, lw.data()) ||
      !fa::attend_backward(fa::policy::cpu<>{1}, p, whole(q, p.q_dims()), whole(k, p.kv_dims()),
                           whole(v, p.kv_dims()), whole(ow, p.o_dims()), whole(d_o, p.o_dims()), lw.data(),
                           fa::bhsd(dqw.data(), p.q_dims()), fa::bhsd(dkw.data(), p.kv_dims()),
                           fa::bhsd(dvw.data(), p.kv_dims()), fa::causal{}))
    return INFINITY;
  double err = 0, size = 1;
  const std::pair<const std::vector<float>*, std::vector<float>> pairs[3] = {
      {&dq, shard(dqw, p.q_dims(), n, r)}, {&dk, shard(dkw, p.kv_dims(), n, r)}, {&dv, shard(dvw, p.kv_dims(), n, r)}};
  for (const auto& [mine, one] : pairs)
    for (std::size_t i = 0; i < one.size(); ++i) {
      err = std::max(err, double(std::abs((*mine)[i] - one[i])));
      size = std::max(size, double(std::abs(one[i])));
    }
  double both[2] = {err, size};  // the largest error and gradient over every rank
  MPI_Allreduce(MPI_IN_PLACE, both, 2, MPI_DOUBLE, MPI_MAX, comm.native());
  return both[0] / both[1];
}

int check(dist::mpi_comm& comm) {
  const int n = comm.size(), r = comm.rank();
  // GQA 8:2, causal; the sequence cut into 2N chunks of 96 rows.
  const fa::problem p{1, 8, 2, 2 * n * 96, 2 * n * 96, 64};
  std::mt19937_64 rng(13);  // the same whole inputs on every rank
  const std::vector<float> q = random_values(static_cast<std::size_t>(p.batch * p.heads * p.seq_q * p.head_dim), rng);
  const std::vector<float> k = random_values(static_cast<std::size_t>(p.batch * p.heads_kv * p.seq_kv * p.head_dim), rng);
  const std::vector<float> v = random_values(k.size(), rng);
  const std::vector<float> d_o = random_values(q.size(), rng);  // dL/dO of the backward check
  fa::problem local = p;
  local.seq_q = local.seq_kv = dist::shard_rows(p.seq_q, n);
  const std::vector<float> ql = shard(q, p.q_dims(), n, r), kl = shard(k, p.kv_dims(), n, r), vl = shard(v, p.kv_dims(), n, r);
  double worst = 0, worst_backward = 0;
  for (dist::strategy s : {dist::strategy::ring, dist::strategy::all_gather}) {
    std::vector<float> o(ql.size()), lse(static_cast<std::size_t>(local.lse_size()));
    const fa::status st = dist::attend(comm, fa::policy::cpu<>{1}, p, fa::bhsd<const float>(ql.data(), local.q_dims()),
                                       fa::bhsd<const float>(kl.data(), local.kv_dims()),
                                       fa::bhsd<const float>(vl.data(), local.kv_dims()),
                                       fa::bhsd(o.data(), local.o_dims()), fa::causal{}, lse.data(),
                                       dist::options{dist::layout::zigzag, s, {}});
    if (!st) {
      std::fprintf(stderr, "rank %d: %s\n", r, st.what());
      return 1;
    }
    double err = 0;
    std::vector<double> ref;
    for (fa::index_t h = 0; h < p.heads; ++h)
      for (fa::index_t x = 0; x < local.seq_q; ++x) {
        const dist::row_range first = dist::shard_piece(dist::layout::zigzag, p.seq_q, n, r, 0);
        const fa::index_t i = x < first.size() ? first.begin + x
                                               : dist::shard_piece(dist::layout::zigzag, p.seq_q, n, r, 1).begin + x - first.size();
        reference_row(p, q, k, v, 0, h, i, ref);
        for (fa::index_t c = 0; c < p.head_dim; ++c)
          err = std::max(err, std::abs(o[static_cast<std::size_t>((h * local.seq_q + x) * p.head_dim + c)] -
                                       ref[static_cast<std::size_t>(c)]));
      }
    MPI_Allreduce(MPI_IN_PLACE, &err, 1, MPI_DOUBLE, MPI_MAX, comm.native());
    if (r == 0)
      std::printf("%d ranks, %s, causal, GQA 8:2, S %lld, f32: max error vs float64 %.2e\n", n, dist::strategy_name(s),
                  static_cast<long long>(p.seq_q), err);
    worst = std::max(worst, err);
    const double backward = backward_error(comm, p, local, s, q, k, v, d_o, o, lse);
    if (r == 0)
      std::printf("%d ranks, %s, backward: max |dQ, dK, dV - one process| / max |gradient| %.2e\n", n,
                  dist::strategy_name(s), backward);
    worst_backward = std::max(worst_backward, backward);
  }
  const bool ok = worst < 1e-4 && worst_backward < 1e-4;
  if (r == 0) std::printf("%s\n", ok ? "match" : "MISMATCH");
  return ok ? 0 : 1;
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

int bench(dist::mpi_comm& comm, const std::vector<long long>& seqs, int heads, int dim, int reps) {
  const int n = comm.size(), r = comm.rank();
  if (r == 0)
    std::printf("%-6s %-3s %-10s %-10s %-10s %-10s %-9s %-9s %-9s\n", "S", "N", "t1_ms", "tN_ms", "compute_ms",
                "comm_ms", "eff_%", "exposed_ms", "hidden_%");
  for (long long s : seqs) {
    const fa::problem p{1, heads, heads, s, s, dim};
    fa::problem local = p;
    local.seq_q = local.seq_kv = dist::shard_rows(s, n);
    std::mt19937_64 rng(static_cast<std::uint64_t>(s) + static_cast<std::uint64_t>(r));
    const std::size_t shard_elems = static_cast<std::size_t>(p.batch * heads * local.seq_q * dim);
    const std::vector<float> q = random_values(shard_elems, rng), k = random_values(shard_elems, rng),
                             v = random_values(shard_elems, rng);
    std::vector<float> o(shard_elems);
    // One process over the whole sequence, on rank 0 (1 thread, as each rank).
    double t1 = 0;
    if (r == 0) {
      const std::size_t whole = static_cast<std::size_t>(p.batch * heads * s * dim);
      const std::vector<float> qw = random_values(whole, rng), kw = random_values(whole, rng), vw = random_values(whole, rng);
      std::vector<float> ow(whole);
      std::vector<double> t;
      for (int i = 0; i < reps; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        (void)fa::attend(fa::policy::cpu<>{1}, p, fa::bhsd<const float>(qw.data(), p.q_dims()),
                         fa::bhsd<const float>(kw.data(), p.kv_dims()), fa::bhsd<const float>(vw.data(), p.kv_dims()),
                         fa::bhsd(ow.data(), p.o_dims()), fa::causal{});
        t.push_back(seconds_since(t0));
      }
      t1 = median(t);
    }
    auto timed = [&](dist::run_parts parts) {
      std::vector<double> t;
      for (int i = 0; i < reps; ++i) {
        MPI_Barrier(comm.native());
        const auto t0 = std::chrono::steady_clock::now();
        const fa::status st = dist::attend(comm, fa::policy::cpu<>{1}, p, fa::bhsd<const float>(q.data(), local.q_dims()),
                                           fa::bhsd<const float>(k.data(), local.kv_dims()),
                                           fa::bhsd<const float>(v.data(), local.kv_dims()),
                                           fa::bhsd(o.data(), local.o_dims()), fa::causal{}, nullptr,
                                           dist::options{dist::layout::zigzag, dist::strategy::ring, parts});
        double dt = seconds_since(t0);
        if (!st) std::fprintf(stderr, "rank %d: %s\n", r, st.what());
        MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, comm.native());  // the slowest rank's time
        t.push_back(dt);
      }
      return median(t);
    };
    const double tn = timed({true, true}), tc = timed({true, false}), tm = timed({false, true});
    if (r == 0) {
      const double exposed = std::max(0.0, tn - tc);
      const double hidden = tm > 0 ? std::max(0.0, 1.0 - exposed / tm) : 1.0;
      std::printf("%-6lld %-3d %-10.2f %-10.2f %-10.2f %-10.2f %-9.1f %-9.2f %-9.1f\n", s, n, t1 * 1e3, tn * 1e3, tc * 1e3,
                  tm * 1e3, 100.0 * t1 / (n * tn), exposed * 1e3, 100.0 * hidden);
    }
  }
  return 0;
}

std::vector<long long> parse_list(const char* s) {
  std::vector<long long> out;
  for (const char* p = s; *p;) {
    out.push_back(std::atoll(p));
    const char* comma = std::strchr(p, ',');
    if (!comma) break;
    p = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  dist::mpi_comm comm;
  bool bench_mode = false;
  std::vector<long long> seqs = {2048, 4096, 8192};
  int heads = 8, dim = 64, reps = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--bench") bench_mode = true;
    else if (a == "--seq" && i + 1 < argc) seqs = parse_list(argv[++i]);
    else if (a == "--heads" && i + 1 < argc) heads = std::atoi(argv[++i]);
    else if (a == "--dim" && i + 1 < argc) dim = std::atoi(argv[++i]);
    else if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
  }
  const int rc = bench_mode ? bench(comm, seqs, heads, dim, reps) : check(comm);
  MPI_Finalize();
  return rc;
}
