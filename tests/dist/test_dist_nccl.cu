// fusedattn/dist on GPUs, one process: cuda::merge_partials against the CPU merge (random rows, rows whose part saw
// no key, NaN rows); dist::attend over NCCL with one host thread per GPU (ncclCommInitAll over every GPU here, up
// to 4; one GPU still runs the schedule) against one GPU's attend on the same inputs, bf16, TransformerEngine's
// tolerance (atol = rtol = 2.5e-2): causal ring over zigzag shards, GQA all-gather, dense contiguous; and a bad input
// on one rank refused by every rank with nothing written. dist::attend_backward the same way against one GPU's
// fa::attend_backward (dQ, dK, dV): causal zigzag ring, dense contiguous ring, causal GQA all-gather. Built whenever CUDA and NCCL are (CI compiles it); exit 77
// (skipped) without a GPU.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fusedattn/fusedattn.hpp>
#include <fusedattn/dist/cuda.cuh>
#include <fusedattn/dist/merge.hpp>
#include <fusedattn/dist/nccl.hpp>

namespace fa = fusedattn;
namespace dist = fusedattn::dist;
using bf16 = Eigen::bfloat16;

namespace {

int failures = 0;
void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::printf("FAILED: %s\n", what.c_str());
  }
}

template <class T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  cudaMalloc(&d, h.size() * sizeof(T));
  cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}
template <class T>
std::vector<T> to_host(const T* d, std::size_t n) {
  std::vector<T> h(n);
  cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
  return h;
}

void merge_against_cpu(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f), ul(-4.f, 4.f);
  const fa::dims4 d{2, 3, 37, 128};
  const std::size_t n = std::size_t(d.b * d.h * d.s * d.d), rows = std::size_t(d.b * d.h * d.s);
  std::vector<bf16> a(n), b(n);
  for (auto& x : a) x = bf16(u(rng));
  for (auto& x : b) x = bf16(u(rng));
  std::vector<float> la(rows), lb(rows);
  for (auto& x : la) x = ul(rng);
  for (auto& x : lb) x = ul(rng);
  const float inf = std::numeric_limits<float>::infinity();
  la[3] = -inf;  // part a saw no key
  lb[5] = -inf;  // part b saw no key
  la[7] = lb[7] = -inf;
  lb[11] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> o_cpu(n), l_cpu(rows);
  expect(fa::merge_partials(fa::bhsd<const bf16>(a.data(), d), la.data(), fa::bhsd<const bf16>(b.data(), d), lb.data(),
                            fa::bhsd(o_cpu.data(), d), l_cpu.data())
             .ok(),
         "CPU merge");
  bf16 *da = to_device(a), *db = to_device(b);
  float *dla = to_device(la), *dlb = to_device(lb), *dout = nullptr, *dl = nullptr;
  cudaMalloc(&dout, n * sizeof(float));
  cudaMalloc(&dl, rows * sizeof(float));
  const fa::status st = fa::cuda::merge_partials(fa::bhsd<const bf16>(da, d), dla, fa::bhsd<const bf16>(db, d), dlb,
                                                 fa::bhsd(dout, d), dl, nullptr);
  expect(st.ok(), std::string("cuda::merge_partials: ") + st.what());
  const std::vector<float> o_gpu = to_host(dout, n), l_gpu = to_host(dl, rows);
  double err = 0, lerr = 0;
  bool nan_ok = true;
  for (std::size_t i = 0; i < n; ++i) {
    if (std::isnan(o_cpu[i]) || std::isnan(o_gpu[i])) {
      nan_ok &= std::isnan(o_cpu[i]) && std::isnan(o_gpu[i]);
      continue;
    }
    err = std::max(err, double(std::abs(o_cpu[i] - o_gpu[i])));
  }
  for (std::size_t i = 0; i < rows; ++i) {
    if (std::isnan(l_cpu[i]) || std::isnan(l_gpu[i])) {
      nan_ok &= std::isnan(l_cpu[i]) && std::isnan(l_gpu[i]);
      continue;
    }
    if (std::isinf(l_cpu[i]) || std::isinf(l_gpu[i])) {
      nan_ok &= l_cpu[i] == l_gpu[i];
      continue;
    }
    lerr = std::max(lerr, double(std::abs(l_cpu[i] - l_gpu[i])));
  }
  // The CPU forms the weights in double, the GPU in float: a few float roundings of |lse| <= 5.
  expect(err <= 4e-6 && lerr <= 4e-6 && nan_ok,
         "cuda::merge_partials vs CPU: max error " + std::to_string(err) + ", lse " + std::to_string(lerr) +
             (nan_ok ? "" : ", NaN / -inf rows differ") + ", seed " + std::to_string(seed));
  for (void* p : {(void*)da, (void*)db, (void*)dla, (void*)dlb, (void*)dout, (void*)dl}) cudaFree(p);
}

/// A whole problem's bf16 Q, K, V on the host and one GPU's output and lse for it.
struct whole_case {
  fa::problem p;
  std::vector<bf16> q, k, v, o;
  std::vector<float> lse;
};

whole_case one_gpu(const fa::problem& p, const fa::any_mask& mask, std::uint64_t seed) {
  whole_case c{p, {}, {}, {}, {}, {}};
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  c.q.resize(std::size_t(p.batch * p.heads * p.seq_q * p.head_dim));
  c.k.resize(std::size_t(p.batch * p.heads_kv * p.seq_kv * p.head_dim));
  c.v.resize(c.k.size());
  for (auto* t : {&c.q, &c.k, &c.v})
    for (auto& x : *t) x = bf16(u(rng));
  cudaSetDevice(0);
  bf16 *dq = to_device(c.q), *dk = to_device(c.k), *dv = to_device(c.v), *dout = nullptr;
  float* dl = nullptr;
  cudaMalloc(&dout, c.q.size() * sizeof(bf16));
  cudaMalloc(&dl, std::size_t(p.lse_size()) * sizeof(float));
  const fa::status st = fa::attend(fa::policy::cuda{}, p, fa::bhsd<const bf16>(dq, p.q_dims()),
                                   fa::bhsd<const bf16>(dk, p.kv_dims()), fa::bhsd<const bf16>(dv, p.kv_dims()),
                                   fa::bhsd(dout, p.o_dims()), mask, dl);
  expect(st.ok(), std::string("one GPU: ") + st.what());
  c.o = to_host(dout, c.q.size());
  c.lse = to_host(dl, std::size_t(p.lse_size()));
  for (void* x : {(void*)dq, (void*)dk, (void*)dv, (void*)dout, (void*)dl}) cudaFree(x);
  return c;
}

/// Rank r's shard of a whole (b, h, S, d) host buffer.
std::vector<bf16> shard(const std::vector<bf16>& whole, fa::dims4 d, dist::layout l, int n, int r) {
  const fa::index_t rows = dist::shard_rows(d.s, n);
  std::vector<bf16> out(std::size_t(d.b * d.h * rows * d.d));
  for (fa::index_t bh = 0; bh < d.b * d.h; ++bh) {
    fa::index_t local = 0;
    for (int part = 0; part < 2; ++part) {
      const dist::row_range rr = dist::shard_piece(l, d.s, n, r, part);
      std::copy(whole.begin() + (bh * d.s + rr.begin) * d.d, whole.begin() + (bh * d.s + rr.end) * d.d,
                out.begin() + (bh * rows + local) * d.d);
      local += rr.size();
    }
  }
  return out;
}

/// Every GPU runs its rank of dist::attend on its own host thread; `bad_rank` (or -1) passes a null q.
void sharded(const std::vector<ncclComm_t>& comms, const fa::problem& p, const fa::any_mask& mask,
             const dist::options& opt, int bad_rank, const std::string& name) {
  const int n = int(comms.size());
  const whole_case w = one_gpu(p, mask, 1000 + std::uint64_t(p.seq_q) + std::uint64_t(p.heads_kv));
  std::vector<fa::status> result(static_cast<std::size_t>(n));
  std::vector<std::vector<bf16>> outs(static_cast<std::size_t>(n));
  std::vector<std::vector<float>> lses(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      dist::nccl_comm comm(comms[std::size_t(r)]);
      if (!comm.ok()) {
        (void)(result[std::size_t(r)] = comm.ok());
        return;
      }
      fa::problem local = p;
      local.seq_q = dist::shard_rows(p.seq_q, n);
      local.seq_kv = dist::shard_rows(p.seq_kv, n);
      bf16* dq = to_device(shard(w.q, p.q_dims(), opt.layout, n, r));
      bf16* dk = to_device(shard(w.k, p.kv_dims(), opt.layout, n, r));
      bf16* dv = to_device(shard(w.v, p.kv_dims(), opt.layout, n, r));
      const std::vector<bf16> sentinel(std::size_t(local.batch * local.heads * local.seq_q * local.head_dim), bf16(7.f));
      const std::vector<float> lse_sentinel(std::size_t(local.lse_size()), 7.f);
      bf16* dout = to_device(sentinel);
      float* dl = to_device(lse_sentinel);
      cudaStream_t stream;
      cudaStreamCreate(&stream);
      (void)(result[std::size_t(r)] = dist::attend(
          comm, fa::policy::cuda{stream}, p, fa::bhsd<const bf16>(r == bad_rank ? nullptr : dq, local.q_dims()),
          fa::bhsd<const bf16>(dk, local.kv_dims()), fa::bhsd<const bf16>(dv, local.kv_dims()),
          fa::bhsd(dout, local.o_dims()), mask, dl, opt));
      cudaStreamSynchronize(stream);
      outs[std::size_t(r)] = to_host(dout, sentinel.size());
      lses[std::size_t(r)] = to_host(dl, lse_sentinel.size());
      cudaStreamDestroy(stream);
      for (void* x : {(void*)dq, (void*)dk, (void*)dv, (void*)dout, (void*)dl}) cudaFree(x);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    const std::vector<bf16>& o = outs[std::size_t(r)];
    const std::vector<float>& l = lses[std::size_t(r)];
    if (bad_rank >= 0) {
      bool untouched = true;
      for (bf16 x : o) untouched &= float(x) == 7.f;
      for (float x : l) untouched &= x == 7.f;
      expect(!result[std::size_t(r)].ok() && untouched,
             name + ": rank " + std::to_string(r) + " must refuse and write nothing (" + result[std::size_t(r)].what() + ")");
      continue;
    }
    expect(result[std::size_t(r)].ok(), name + ": rank " + std::to_string(r) + ": " + result[std::size_t(r)].what());
    const fa::index_t lq = dist::shard_rows(p.seq_q, n);
    const dist::row_range first = dist::shard_piece(opt.layout, p.seq_q, n, r, 0);
    long long bad = 0;
    double lse_err = 0;
    for (fa::index_t bh = 0; bh < p.batch * p.heads; ++bh)
      for (fa::index_t x = 0; x < lq; ++x) {
        const fa::index_t g = x < first.size() ? first.begin + x
                                               : dist::shard_piece(opt.layout, p.seq_q, n, r, 1).begin + x - first.size();
        for (fa::index_t c = 0; c < p.head_dim; ++c) {
          const double y = float(o[std::size_t((bh * lq + x) * p.head_dim + c)]);
          const double want = float(w.o[std::size_t((bh * p.seq_q + g) * p.head_dim + c)]);
          if (!(std::abs(y - want) <= 2.5e-2 + 2.5e-2 * std::abs(want))) ++bad;
        }
        lse_err = std::max(lse_err, double(std::abs(l[std::size_t(bh * lq + x)] - w.lse[std::size_t(bh * p.seq_q + g)])));
      }
    expect(bad == 0 && lse_err <= 2.5e-2, name + ": rank " + std::to_string(r) + ": " + std::to_string(bad) +
                                              " elements beyond tolerance, lse error " + std::to_string(lse_err));
  }
}

/// Max over a shard's elements of max(0, |got − want| − atol − rtol·|want|) and the count beyond, rows of `got` in
/// shard order against the whole `want` (b, h, S, d).
struct shard_check {
  long long bad = 0;
  double worst = 0;
};
shard_check check_shard(const std::vector<bf16>& got, const std::vector<bf16>& want, fa::dims4 whole, dist::layout l,
                        int n, int r, double tol) {
  shard_check c;
  const std::vector<bf16> mine = shard(want, whole, l, n, r);
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double y = float(got[i]), w = float(mine[i]);
    const double err = std::abs(y - w);
    c.worst = std::max(c.worst, err);
    if (!(err <= tol + tol * std::abs(w))) ++c.bad;
  }
  return c;
}

/// dist::attend_backward on every GPU (one host thread each) against one GPU's fa::attend_backward(policy::cuda) on
/// the same inputs: the forward's O and lse and a random dO from one GPU, sharded; dQ, dK and dV of each rank's
/// shard within TransformerEngine's bf16 tolerance.
void sharded_backward(const std::vector<ncclComm_t>& comms, const fa::problem& p, const fa::any_mask& mask,
                      const dist::options& opt, const std::string& name) {
  const int n = int(comms.size());
  const std::uint64_t seed = 5000 + std::uint64_t(p.seq_q) + std::uint64_t(p.heads_kv);
  const whole_case w = one_gpu(p, mask, seed);
  std::mt19937_64 rng(seed + 1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<bf16> d_o(w.q.size());
  for (auto& x : d_o) x = bf16(u(rng));
  // One GPU's gradients.
  cudaSetDevice(0);
  bf16 *q = to_device(w.q), *k = to_device(w.k), *v = to_device(w.v), *o = to_device(w.o), *dout = to_device(d_o);
  float* l = to_device(w.lse);
  bf16 *dq = nullptr, *dk = nullptr, *dv = nullptr;
  cudaMalloc(&dq, w.q.size() * sizeof(bf16));
  cudaMalloc(&dk, w.k.size() * sizeof(bf16));
  cudaMalloc(&dv, w.v.size() * sizeof(bf16));
  const fa::status st1 = fa::attend_backward(
      fa::policy::cuda{}, p, fa::bhsd<const bf16>(q, p.q_dims()), fa::bhsd<const bf16>(k, p.kv_dims()),
      fa::bhsd<const bf16>(v, p.kv_dims()), fa::bhsd<const bf16>(o, p.o_dims()), fa::bhsd<const bf16>(dout, p.o_dims()),
      l, fa::bhsd(dq, p.q_dims()), fa::bhsd(dk, p.kv_dims()), fa::bhsd(dv, p.kv_dims()), mask);
  expect(st1.ok(), name + ": one GPU backward: " + st1.what());
  const std::vector<bf16> want_dq = to_host(dq, w.q.size()), want_dk = to_host(dk, w.k.size()),
                          want_dv = to_host(dv, w.v.size());
  for (void* x : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)dout, (void*)l, (void*)dq, (void*)dk, (void*)dv})
    cudaFree(x);
  std::vector<fa::status> result(static_cast<std::size_t>(n));
  std::vector<std::vector<bf16>> got(static_cast<std::size_t>(3 * n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      dist::nccl_comm comm(comms[std::size_t(r)]);
      if (!comm.ok()) {
        (void)(result[std::size_t(r)] = comm.ok());
        return;
      }
      fa::problem local = p;
      local.seq_q = dist::shard_rows(p.seq_q, n);
      local.seq_kv = dist::shard_rows(p.seq_kv, n);
      std::vector<float> lse_shard(std::size_t(local.lse_size()));
      for (fa::index_t bh = 0; bh < p.batch * p.heads; ++bh) {
        fa::index_t x = 0;
        for (int part = 0; part < 2; ++part) {
          const dist::row_range rr = dist::shard_piece(opt.layout, p.seq_q, n, r, part);
          for (fa::index_t g = rr.begin; g < rr.end; ++g) lse_shard[std::size_t(bh * local.seq_q + x++)] = w.lse[std::size_t(bh * p.seq_q + g)];
        }
      }
      bf16* sq = to_device(shard(w.q, p.q_dims(), opt.layout, n, r));
      bf16* sk = to_device(shard(w.k, p.kv_dims(), opt.layout, n, r));
      bf16* sv = to_device(shard(w.v, p.kv_dims(), opt.layout, n, r));
      bf16* so = to_device(shard(w.o, p.o_dims(), opt.layout, n, r));
      bf16* sdo = to_device(shard(d_o, p.o_dims(), opt.layout, n, r));
      float* sl = to_device(lse_shard);
      const std::size_t nq = std::size_t(local.batch * local.heads * local.seq_q * p.head_dim);
      const std::size_t nkv = std::size_t(local.batch * local.heads_kv * local.seq_kv * p.head_dim);
      bf16* gq = to_device(std::vector<bf16>(nq, bf16(7.f)));
      bf16* gk = to_device(std::vector<bf16>(nkv, bf16(7.f)));
      bf16* gv = to_device(std::vector<bf16>(nkv, bf16(7.f)));
      cudaStream_t stream;
      cudaStreamCreate(&stream);
      (void)(result[std::size_t(r)] = dist::attend_backward(
          comm, fa::policy::cuda{stream}, p, fa::bhsd<const bf16>(sq, local.q_dims()),
          fa::bhsd<const bf16>(sk, local.kv_dims()), fa::bhsd<const bf16>(sv, local.kv_dims()),
          fa::bhsd<const bf16>(so, local.o_dims()), fa::bhsd<const bf16>(sdo, local.o_dims()), sl,
          fa::bhsd(gq, local.q_dims()), fa::bhsd(gk, local.kv_dims()), fa::bhsd(gv, local.kv_dims()), mask, opt));
      cudaStreamSynchronize(stream);
      got[std::size_t(3 * r)] = to_host(gq, nq);
      got[std::size_t(3 * r + 1)] = to_host(gk, nkv);
      got[std::size_t(3 * r + 2)] = to_host(gv, nkv);
      cudaStreamDestroy(stream);
      for (void* x : {(void*)sq, (void*)sk, (void*)sv, (void*)so, (void*)sdo, (void*)sl, (void*)gq, (void*)gk, (void*)gv})
        cudaFree(x);
    });
  for (auto& t : threads) t.join();
  const double tol = 2.5e-2;
  for (int r = 0; r < n; ++r) {
    expect(result[std::size_t(r)].ok(), name + ": rank " + std::to_string(r) + ": " + result[std::size_t(r)].what());
    const char* names[3] = {"dq", "dk", "dv"};
    const std::vector<bf16>* want[3] = {&want_dq, &want_dk, &want_dv};
    const fa::dims4 dims[3] = {p.q_dims(), p.kv_dims(), p.kv_dims()};
    for (int x = 0; x < 3; ++x) {
      const shard_check c = check_shard(got[std::size_t(3 * r + x)], *want[x], dims[x], opt.layout, n, r, tol);
      std::printf("%s, rank %d: max |%s - one GPU| %.2e\n", name.c_str(), r, names[x], c.worst);
      expect(c.bad == 0, name + ": rank " + std::to_string(r) + ": " + names[x] + ": " + std::to_string(c.bad) +
                             " elements beyond atol = rtol = 2.5e-2 (max difference " + std::to_string(c.worst) + ")");
    }
  }
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device here: skipped\n");
    return 77;
  }
  merge_against_cpu(std::random_device{}());
  const int n = devices < 4 ? devices : 4;
  std::vector<ncclComm_t> comms(static_cast<std::size_t>(n));
  std::vector<int> ids(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) ids[std::size_t(i)] = i;
  if (ncclCommInitAll(comms.data(), n, ids.data()) != ncclSuccess) {
    std::printf("FAILED: ncclCommInitAll over %d GPUs\n", n);
    return 1;
  }
  const fa::index_t u = 2 * n;
  sharded(comms, {1, 8, 8, u * 300, u * 300, 128}, fa::causal{}, {dist::layout::zigzag, dist::strategy::ring, {}},
          -1, "causal ring zigzag");
  sharded(comms, {2, 16, 4, u * 130, u * 130, 64}, fa::causal{}, {dist::layout::zigzag, dist::strategy::all_gather, {}},
          -1, "causal GQA all-gather zigzag");
  sharded(comms, {1, 4, 4, u * 64, u * 200, 128}, fa::dense{}, {dist::layout::contiguous, dist::strategy::ring, {}},
          -1, "dense ring contiguous, seq_q != seq_kv");
  sharded(comms, {1, 4, 4, u * 64, u * 64, 128}, fa::causal{}, {}, n - 1, "null q on the last rank");
  sharded_backward(comms, {1, 8, 8, u * 300, u * 300, 128}, fa::causal{},
                   {dist::layout::zigzag, dist::strategy::ring, {}}, "backward: causal ring zigzag");
  sharded_backward(comms, {2, 4, 4, u * 96, u * 96, 64}, fa::dense{},
                   {dist::layout::contiguous, dist::strategy::ring, {}}, "backward: dense ring contiguous");
  sharded_backward(comms, {1, 16, 4, u * 130, u * 130, 128}, fa::causal{},
                   {dist::layout::zigzag, dist::strategy::all_gather, {}}, "backward: causal GQA all-gather zigzag");
  for (ncclComm_t c : comms) ncclCommDestroy(c);
  std::printf("%s (%d GPU%s)\n", failures == 0 ? "all passed" : "FAILED", n, n > 1 ? "s" : "");
  return failures == 0 ? 0 : 1;
}
