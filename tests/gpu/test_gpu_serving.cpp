// Serving on CUDA: attend_paged against a paged cache (pages of 16 and 64 tokens, both layouts, shuffled block
// tables, unowned pool slots holding NaN), attend_ragged (decode over mixed lengths including 0 and 1 on cuda.decode;
// prefill in one launch of the Hopper kernel, or sequence by sequence), plain attend on decode shapes (fa::plan names
// cuda.decode), GQA 32/8, 8/8 and 8/1, head_dim 64/128/256, f16 and bf16, every tail — against the float64 oracle;
// batches whose keys split over the SMs (partial tiles, idle warps, short last splits) rerun bitwise; the NaN
// contract on a masked key; bad tables and offsets refused with nothing written; score modifiers (softcap, ALiBi of
// both alignments, sinks, all three) on paged and ragged calls, with a sequence of no keys (lse = the sink) and a
// split sequence (the sink counted once); ragged prefill in one launch (tails around the q-block, head_dims 64–256
// and padded ones, GQA, every alignment, an inf or NaN in one sequence's V kept out of its neighbour's rows); host
// mirrors of the tables and offsets (bitwise the result of reading them back, bad mirrors refused by name) and the
// refusal of a stream being captured into a CUDA graph.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include "serving_entry.hpp"
#include "support/data.hpp"
#include "support/oracle.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;
using fusedattn::testing::gpu::serving_mask;

namespace {

bool have_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    WARN("skipped: no usable CUDA device");
    return false;
  }
  return true;
}

/// A device copy of a host vector (copied back on request).
template <class T>
struct dev {
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit dev(const std::vector<T>& h) : n(h.size()) {
    if (cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<std::size_t>(n, 1) * sizeof(T)) != cudaSuccess) ptr = nullptr;
    if (ptr != nullptr && n > 0) cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice);
  }
  dev(const dev&) = delete;
  dev& operator=(const dev&) = delete;
  ~dev() { cudaFree(ptr); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    if (n > 0) cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
  /// Overwrites the device copy with `h` (of the same size).
  void put(const std::vector<T>& h) const {
    if (n > 0) cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice);
  }
};

/// The host mirrors a serving call passes: of the block table or cu_seqlens_q (`first`), of the lengths or
/// cu_seqlens_kv (`second`). With any, the call runs twice, without and with them, and must give the same bits.
struct mirror_set {
  bool first = false, second = false;
  bool any() const { return first || second; }
};

std::string mask_label(const serving_mask& m) {
  return std::visit([](const auto& x) { return std::string(mask_name(x)); }, m);
}

/// Uniform values in [−1, 1) of type T.
template <class T>
std::vector<T> uniform_values(std::mt19937_64& rng, index_t count) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> x(static_cast<std::size_t>(count));
  for (auto& e : x) e = T(float(u(rng)));
  return x;
}

/// A decode call's inputs: fresh random Q, K, V (bhsd) on the host and the device, O filled with 7 and lse with 123
/// (so a row left unwritten shows), and their views.
template <class T>
struct decode_case {
  decode_case(const problem& p, std::mt19937_64& rng)
      : q(uniform_values<T>(rng, p.batch * p.heads * p.seq_q * p.head_dim)),
        k(uniform_values<T>(rng, p.batch * p.heads_kv * p.seq_kv * p.head_dim)),
        v(uniform_values<T>(rng, p.batch * p.heads_kv * p.seq_kv * p.head_dim)),
        dq(q),
        dk(k),
        dv(v),
        d_o(std::vector<T>(q.size(), T(7.0f))),
        dlse(std::vector<float>(std::size_t(p.lse_size()), 123.0f)),
        qv(bhsd<const T>(dq.ptr, p.q_dims())),
        kv(bhsd<const T>(dk.ptr, p.kv_dims())),
        vv(bhsd<const T>(dv.ptr, p.kv_dims())),
        ov(bhsd(d_o.ptr, p.o_dims())) {}
  std::vector<T> q, k, v;
  dev<T> dq, dk, dv, d_o;
  dev<float> dlse;
  tensor_ref<const T> qv, kv, vv;
  tensor_ref<T> ov;
};

/// Checks rows of O (a (heads, rows, d) block at `o`) and their lse against the oracle on (q, k, v) of one sequence:
/// error within the tolerance a plain same-precision implementation gives.
template <class T>
void check_sequence(const problem& pb, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                    const tensor_ref<const T>& v, const serving_mask& mask, const T* o, index_t o_row_stride,
                    index_t o_head_stride, const float* lse, index_t lse_head_stride) {
  const band_mask bound = std::visit([&](const auto& m) { return bind(m, pb); }, mask);
  const reference ref = reference_attention<double>(pb, q, k, v, bound);
  const reference plain = reference_attention<accum_t<T>>(pb, q, k, v, bound);
  double plain_err = 0, err = 0, lse_err = 0;
  for (index_t h = 0; h < pb.heads; ++h)
    for (index_t i = 0; i < pb.seq_q; ++i) {
      const std::size_t row = static_cast<std::size_t>(h * pb.seq_q + i);
      for (index_t c = 0; c < pb.head_dim; ++c) {
        const double want = ref.o[row * std::size_t(pb.head_dim) + std::size_t(c)];
        plain_err = std::max(plain_err, std::abs(double(T(float(plain.o[row * std::size_t(pb.head_dim) + std::size_t(c)]))) - want));
        const double got = double(float(o[h * o_head_stride + i * o_row_stride + c]));
        err = std::max(err, std::isnan(got) ? std::numeric_limits<double>::infinity() : std::abs(got - want));
      }
      const double l = lse[h * lse_head_stride + i], lw = ref.lse[row];
      if (std::isinf(lw)) lse_err = std::max(lse_err, l == lw ? 0.0 : std::numeric_limits<double>::infinity());
      else lse_err = std::max(lse_err, std::isnan(l) ? std::numeric_limits<double>::infinity() : std::abs(l - lw));
    }
  INFO("error " << err << " plain " << plain_err << " lse error " << lse_err);
  CHECK(err <= output_tolerance<T>(plain_err));
  CHECK(lse_err <= 1e-3);
}

/// Checks sequence b of a ragged call against the oracle: its rows cu_q[b] to cu_q[b + 1] of O and lse (read back),
/// from the same rows of the packed (bshd) host q and keys cu_kv[b] to cu_kv[b + 1] of k and v.
template <class T>
void check_ragged_sequence(const problem& p, const std::vector<T>& q, const std::vector<T>& k, const std::vector<T>& v,
                           const std::vector<std::int32_t>& cu_q, const std::vector<std::int32_t>& cu_kv, index_t b,
                           const serving_mask& mask, const std::vector<T>& o, const std::vector<float>& lse) {
  const index_t q0 = cu_q[std::size_t(b)], k0 = cu_kv[std::size_t(b)];
  problem pb = p;
  pb.seq_q = cu_q[std::size_t(b + 1)] - q0;
  pb.seq_kv = cu_kv[std::size_t(b + 1)] - k0;
  const tensor_ref<const T> qa = bshd<const T>(q.data(), p.q_dims()), ka = bshd<const T>(k.data(), p.kv_dims()),
                            va = bshd<const T>(v.data(), p.kv_dims());
  const tensor_ref<const T> qb{qa.row(0, 0, q0), pb.q_dims(), qa.stride};
  const tensor_ref<const T> kb{pb.seq_kv > 0 ? ka.row(0, 0, k0) : k.data(), pb.kv_dims(), ka.stride};
  const tensor_ref<const T> vb{pb.seq_kv > 0 ? va.row(0, 0, k0) : v.data(), pb.kv_dims(), va.stride};
  check_sequence<T>(pb, qb, kb, vb, mask, o.data() + q0 * p.heads * p.head_dim, p.heads * p.head_dim, p.head_dim,
                    lse.data() + q0, p.seq_q);
}

/// O and lse of a call, read back from the device.
template <class T>
struct outputs {
  std::vector<T> o;
  std::vector<float> lse;
};

/// Requires that the call that returned `st` ran, and reads back the O and lse it wrote.
template <class T>
outputs<T> read_back(const status& st, const dev<T>& d_o, const dev<float>& dlse) {
  INFO(st.what());
  REQUIRE(st.ok());
  return {d_o.get(), dlse.get()};
}

/// Puts the sentinels back in O (7) and lse (123), so that a row a call leaves unwritten shows.
template <class T>
void refill(const dev<T>& d_o, const dev<float>& dlse) {
  d_o.put(std::vector<T>(d_o.n, T(7.0f)));
  dlse.put(std::vector<float>(dlse.n, 123.0f));
}

/// Checks that two runs wrote the same bits to O and to lse.
template <class T>
void check_same_bits(const outputs<T>& a, const outputs<T>& b) {
  CHECK(std::memcmp(a.o.data(), b.o.data(), a.o.size() * sizeof(T)) == 0);
  CHECK(std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0);
}

/// Checks that a call was refused as an invalid argument, its message naming `field`.
void check_refused(const status& st, const std::string& field) {
  CHECK(st.code() == errc::invalid_argument);
  CHECK(std::string(st.what()).find(field) != std::string::npos);
}

/// Checks that O and lse still hold their sentinels (7, 123) everywhere: one check for each.
template <class T>
void check_unwritten(const dev<T>& d_o, const dev<float>& dlse) {
  const std::vector<T> o = d_o.get();
  const std::vector<float> lse = dlse.get();
  CHECK(std::all_of(o.begin(), o.end(), [](T x) { return float(x) == 7.0f; }));
  CHECK(std::all_of(lse.begin(), lse.end(), [](float x) { return x == 123.0f; }));
}

/// Checks that O and lse still hold their sentinels (7, 123): one check for every element.
template <class T>
void check_each_unwritten(const dev<T>& d_o, const dev<float>& dlse) {
  for (const T x : d_o.get()) CHECK(static_cast<float>(x) == 7.0f);
  for (const float x : dlse.get()) CHECK(x == 123.0f);
}

/// A paged cache of sequences of lengths `lens`, pages in shuffled order, every slot no sequence owns NaN.
template <class T>
struct paged_case {
  problem p;
  index_t page_size;
  page_layout layout;
  std::vector<std::int32_t> lens, table;
  index_t blocks_per_seq = 0, pages = 0;
  std::vector<T> k, v, q;

  paged_case(problem pr, index_t ps, page_layout l, std::vector<std::int32_t> seq_lens, std::mt19937_64& rng)
      : p(pr), page_size(ps), layout(l), lens(std::move(seq_lens)) {
    index_t longest = 1;
    for (auto x : lens) longest = std::max<index_t>(longest, x);
    p.batch = static_cast<index_t>(lens.size());
    p.seq_kv = longest;
    blocks_per_seq = (longest + ps - 1) / ps + 1;
    pages = p.batch * blocks_per_seq + 3;
    std::vector<std::int32_t> ids(static_cast<std::size_t>(pages));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    table.assign(ids.begin(), ids.begin() + p.batch * blocks_per_seq);
    const auto pool = static_cast<std::size_t>(pages * ps * p.heads_kv * p.head_dim);
    k.assign(pool, T(std::numeric_limits<float>::quiet_NaN()));
    v.assign(pool, T(std::numeric_limits<float>::quiet_NaN()));
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (index_t b = 0; b < p.batch; ++b)
      for (index_t h = 0; h < p.heads_kv; ++h)
        for (index_t j = 0; j < lens[std::size_t(b)]; ++j)
          for (index_t c = 0; c < p.head_dim; ++c) {
            k[std::size_t(at(b, h, j) + c)] = T(float(u(rng)));
            v[std::size_t(at(b, h, j) + c)] = T(float(u(rng)));
          }
    q.resize(static_cast<std::size_t>(p.batch * p.heads * p.seq_q * p.head_dim));
    for (auto& x : q) x = T(float(u(rng)));
  }
  index_t at(index_t b, index_t h, index_t j) const {
    const page_strides st = page_strides_of(layout, page_size, p.heads_kv, p.head_dim);
    return table[std::size_t(b * blocks_per_seq + j / page_size)] * st.page + h * st.head + (j % page_size) * st.token;
  }
  std::vector<T> gather(const std::vector<T>& pool, index_t b) const {
    const index_t len = lens[std::size_t(b)];
    std::vector<T> out(static_cast<std::size_t>(p.heads_kv * len * p.head_dim));
    for (index_t h = 0; h < p.heads_kv; ++h)
      for (index_t j = 0; j < len; ++j)
        for (index_t c = 0; c < p.head_dim; ++c)
          out[std::size_t((h * len + j) * p.head_dim + c)] = pool[std::size_t(at(b, h, j) + c)];
    return out;
  }
};

/// `oracle_mask`, when given, is `mask` with its modifiers' arrays on the host (the call's are on the device).
/// With `mirrors`, the call is made again with host mirrors of the block table and / or the lengths: the same bits.
template <class T>
void run_paged(const problem& shape, index_t page_size, page_layout layout, const std::vector<std::int32_t>& lens,
               const serving_mask& mask, const serving_mask* oracle_mask = nullptr, mirror_set mirrors = {}) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  paged_case<T> c(shape, page_size, layout, lens, rng);
  const problem& p = c.p;
  INFO(scalar_name<T>() << " h=" << p.heads << " h_kv=" << p.heads_kv << " s_q=" << p.seq_q << " d=" << p.head_dim
                        << " page " << page_size << (layout == page_layout::hnd ? " hnd " : " nhd ") << mask_label(mask)
                        << " seed=" << seed);
  dev<T> dk(c.k), dv(c.v), dq(c.q), d_o(std::vector<T>(c.q.size(), T(7.0f)));
  dev<std::int32_t> dt(c.table), dl(c.lens);
  dev<float> dlse(std::vector<float>(std::size_t(p.lse_size()), 123.0f));
  REQUIRE((dk.ptr && dv.ptr && dq.ptr && d_o.ptr && dt.ptr && dl.ptr && dlse.ptr));
  const paged_kv<const T> kv =
      paged<const T>(dk.ptr, dv.ptr, c.pages, page_size, p.heads_kv, p.head_dim, layout, dt.ptr, c.blocks_per_seq, dl.ptr);
  // Runs the call on the cache view `view` and reads O and lse back.
  auto call = [&](const paged_kv<const T>& view) {
    return read_back(gpu::attend_paged_cuda<T>(p, bhsd<const T>(dq.ptr, p.q_dims()), view, bhsd(d_o.ptr, p.o_dims()),
                                               mask, dlse.ptr),
                     d_o, dlse);
  };
  const outputs<T> r = call(kv);
  if (mirrors.any()) {
    INFO("host mirrors of" << (mirrors.first ? " the block table" : "") << (mirrors.second ? " the lengths" : ""));
    refill(d_o, dlse);
    check_same_bits(r, call(kv.with_host_tables(mirrors.first ? c.table.data() : nullptr,
                                                mirrors.second ? c.lens.data() : nullptr)));
  }
  const index_t rows = p.heads * p.seq_q * p.head_dim;
  for (index_t b = 0; b < p.batch; ++b) {
    const index_t len = c.lens[std::size_t(b)];
    INFO("sequence " << b << " of " << len << " keys");
    problem pb = p;
    pb.batch = 1;
    pb.seq_kv = len;
    const std::vector<T> kb = c.gather(c.k, b), vb = c.gather(c.v, b);
    check_sequence<T>(pb, bhsd<const T>(c.q.data() + b * rows, pb.q_dims()), bhsd<const T>(kb.data(), pb.kv_dims()),
                      bhsd<const T>(vb.data(), pb.kv_dims()), oracle_mask != nullptr ? *oracle_mask : mask,
                      r.o.data() + b * rows, p.head_dim, p.seq_q * p.head_dim, r.lse.data() + b * p.heads * p.seq_q,
                      p.seq_q);
  }
}

/// attend_ragged on sequences of nq[b] queries and nk[b] keys (packed bshd) against one oracle call per sequence;
/// `oracle_mask` as in run_paged; with `mirrors`, again with host mirrors of cu_seqlens_q and / or cu_seqlens_kv.
template <class T>
void run_ragged(const std::vector<std::int32_t>& nq_of, const std::vector<std::int32_t>& nk_of, index_t heads,
                index_t heads_kv, index_t d, const serving_mask& mask, const serving_mask* oracle_mask = nullptr,
                mirror_set mirrors = {}) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const index_t n = static_cast<index_t>(nq_of.size());
  std::vector<std::int32_t> cu_q(std::size_t(n + 1), 0), cu_kv(std::size_t(n + 1), 0);
  for (index_t b = 0; b < n; ++b) {
    cu_q[std::size_t(b + 1)] = cu_q[std::size_t(b)] + nq_of[std::size_t(b)];
    cu_kv[std::size_t(b + 1)] = cu_kv[std::size_t(b)] + nk_of[std::size_t(b)];
  }
  const problem p{1, heads, heads_kv, cu_q.back(), cu_kv.back(), d};
  INFO(scalar_name<T>() << " sequences " << n << " " << mask_label(mask) << " seed=" << seed);
  const std::vector<T> q = uniform_values<T>(rng, p.seq_q * p.heads * p.head_dim),
                       k = uniform_values<T>(rng, p.seq_kv * p.heads_kv * p.head_dim),
                       v = uniform_values<T>(rng, p.seq_kv * p.heads_kv * p.head_dim);
  dev<T> dq(q), dk(k), dv(v), d_o(std::vector<T>(q.size(), T(7.0f)));
  dev<std::int32_t> dcq(cu_q), dck(cu_kv);
  dev<float> dlse(std::vector<float>(std::size_t(p.lse_size()), 123.0f));
  // Runs the call on offsets `rb` and reads O and lse back.
  auto call = [&](const ragged_batch& rb) {
    return read_back(gpu::attend_ragged_cuda<T>(p, rb, bshd<const T>(dq.ptr, p.q_dims()),
                                                bshd<const T>(dk.ptr, p.kv_dims()), bshd<const T>(dv.ptr, p.kv_dims()),
                                                bshd(d_o.ptr, p.o_dims()), mask, dlse.ptr),
                     d_o, dlse);
  };
  const outputs<T> r = call(ragged_batch{n, dcq.ptr, dck.ptr});
  if (mirrors.any()) {
    INFO("host mirrors of" << (mirrors.first ? " cu_seqlens_q" : "") << (mirrors.second ? " cu_seqlens_kv" : ""));
    refill(d_o, dlse);
    check_same_bits(r, call(ragged_batch{n, dcq.ptr, dck.ptr}.with_host_offsets(
                           mirrors.first ? cu_q.data() : nullptr, mirrors.second ? cu_kv.data() : nullptr)));
  }
  for (index_t b = 0; b < n; ++b) {
    const index_t nq = nq_of[std::size_t(b)], nk = nk_of[std::size_t(b)];
    if (nq == 0) continue;
    INFO("sequence " << b << ": " << nq << " rows, " << nk << " keys");
    check_ragged_sequence<T>(p, q, k, v, cu_q, cu_kv, b, oracle_mask != nullptr ? *oracle_mask : mask, r.o, r.lse);
  }
}

/// Uniform floats in [lo, hi).
std::vector<float> uniform_floats(std::mt19937_64& rng, index_t count, double lo, double hi) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<float> x(static_cast<std::size_t>(count));
  for (auto& e : x) e = float(u(rng));
  return x;
}

/// One set of score modifiers on a causal mask: softcap 0.3 (scaled scores here reach about ±1), ALiBi of the given
/// alignment, sinks; `slopes` and `sink_logits` in the memory of the call that uses the mask.
struct mod_set {
  bool cap, alibi, sinks;
  align alibi_align;
  const char* name;
};
serving_mask with_mods(causal c, const mod_set& s, const float* slopes, const float* sink_logits) {
  modified<causal> m{c, {}};
  if (s.cap) m = m | softcap{0.3f};
  if (s.alibi) m = m | alibi{slopes, s.alibi_align};
  if (s.sinks) m = m | sinks{sink_logits};
  return m;
}

}  // namespace

TEMPLATE_TEST_CASE("cuda paged decode matches the float64 oracle", "[gpu][serving]", Eigen::half, Eigen::bfloat16) {
  if (!have_device()) return;
  const std::vector<std::int32_t> lens = {1, 17, 300, 0, 1000, 64};
  for (index_t page : {16, 64})
    for (page_layout layout : {page_layout::hnd, page_layout::nhd})
      for (const serving_mask& mask : {serving_mask{dense{}}, serving_mask{causal{align::bottom_right}},
                                       serving_mask{window{100, 0, align::bottom_right}}})
        run_paged<TestType>({1, 32, 8, 1, 1, 128}, page, layout, lens, mask);
  // Speculative decode (3 rows per sequence, 12 rows per kv head), GQA 8/8 and 8/1, head_dim 64 and 256, page 8, 24, 256.
  run_paged<TestType>({1, 32, 8, 3, 1, 128}, 16, page_layout::nhd, {5, 700, 2, 129}, causal{align::bottom_right});
  run_paged<TestType>({1, 8, 8, 1, 1, 64}, 8, page_layout::hnd, {33, 1, 250}, dense{});
  run_paged<TestType>({1, 8, 1, 2, 1, 256}, 24, page_layout::nhd, {71, 400}, causal{align::bottom_right});
  run_paged<TestType>({1, 16, 4, 4, 1, 64}, 256, page_layout::hnd, {1000, 3}, window{20, 0, align::bottom_right});
  // One long sequence: the keys split over many blocks and merged.
  run_paged<TestType>({1, 32, 8, 1, 1, 128}, 64, page_layout::nhd, {20000}, causal{align::bottom_right});
}

TEMPLATE_TEST_CASE("cuda ragged batches match the float64 oracle", "[gpu][serving]", Eigen::half, Eigen::bfloat16) {
  if (!have_device()) return;
  for (const serving_mask& mask : {serving_mask{dense{}}, serving_mask{causal{align::bottom_right}}}) {
    run_ragged<TestType>({1, 1, 1, 1, 1}, {0, 1, 37, 512, 129}, 32, 8, 128, mask);  // decode, one launch
    run_ragged<TestType>({2, 2, 2}, {5, 300, 2}, 16, 2, 64, mask);  // speculative decode, 16 rows per kv head
    run_ragged<TestType>({3, 0, 50, 1}, {3, 5, 50, 70}, 8, 2, 128, mask);  // prefill, sequence by sequence
  }
}

TEMPLATE_TEST_CASE("cuda paged and ragged calls apply score modifiers like the float64 oracle", "[gpu][serving][modifiers]",
                   Eigen::half, Eigen::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  INFO("modifier seed=" << seed);
  const std::vector<float> slopes = uniform_floats(rng, 32, 0.002, 0.05), sink_logits = uniform_floats(rng, 32, -1.0, 2.0);
  dev<float> d_slopes(slopes), d_sinks(sink_logits);
  REQUIRE((d_slopes.ptr && d_sinks.ptr));
  const mod_set sets[] = {{true, false, false, align::top_left, "softcap"},
                          {false, true, false, align::bottom_right, "alibi bottom_right"},
                          {false, true, false, align::top_left, "alibi top_left"},
                          {false, false, true, align::top_left, "sinks"},
                          {true, true, true, align::bottom_right, "softcap + alibi + sinks"}};
  for (const mod_set& set : sets)
    for (align a : {align::bottom_right, align::top_left}) {
      INFO(set.name << ", causal " << (a == align::bottom_right ? "bottom_right" : "top_left"));
      const serving_mask call = with_mods(causal{a}, set, d_slopes.ptr, d_sinks.ptr);
      const serving_mask oracle = with_mods(causal{a}, set, slopes.data(), sink_logits.data());
      // Decode, GQA 32/8, pages of 16, tails, a sequence of no keys (O = 0, lse = the sink).
      run_paged<T>({1, 32, 8, 1, 1, 128}, 16, page_layout::nhd, {1, 17, 300, 0, 1000}, call, &oracle);
      // Speculative decode: 12 rows per kv head, so a thread's rows g and g + 8 belong to different heads.
      run_paged<T>({1, 32, 8, 3, 1, 64}, 16, page_layout::hnd, {5, 700, 2, 129}, call, &oracle);
      // Ragged decode in one launch, and ragged prefill sequence by sequence.
      run_ragged<T>({1, 1, 1, 1}, {0, 37, 512, 129}, 32, 8, 128, call, &oracle);
      run_ragged<T>({3, 0, 50, 1}, {3, 5, 50, 70}, 32, 8, 128, call, &oracle);
      // Ragged prefill in one launch (the Hopper kernel), keys past a sequence's own in its last tile.
      run_ragged<T>({130, 7, 0, 260}, {130, 300, 9, 200}, 32, 8, 128, call, &oracle);
    }
  // One long sequence split over many blocks: the sink joins split 0 only and the merge counts it once.
  const mod_set all = sets[4];
  const serving_mask call = with_mods(causal{align::bottom_right}, all, d_slopes.ptr, d_sinks.ptr);
  const serving_mask oracle = with_mods(causal{align::bottom_right}, all, slopes.data(), sink_logits.data());
  run_paged<T>({1, 32, 8, 1, 1, 128}, 16, page_layout::nhd, {20000, 4099}, call, &oracle);
}

TEMPLATE_TEST_CASE("cuda ragged prefill in one launch matches the float64 oracle: tails, masks, head_dims, GQA",
                   "[gpu][serving][ragged]", Eigen::half, Eigen::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  // Query counts around the 128-row q-block and a 1-row one, a sequence of no rows; keys equal to the rows (prefill),
  // or more (chunked prefill against a longer cache) with one sequence of no keys (O = 0, lse = −inf), or fewer
  // (bottom-right rows that see no key). The Hopper kernel takes these in one launch (head_dim 64, 72–256); the
  // checks hold on any kernel.
  const std::vector<std::int32_t> rows = {127, 1, 0, 129, 300, 64, 5};
  const std::vector<std::int32_t> longer = {327, 9, 4, 0, 310, 1000, 5};
  const std::vector<std::int32_t> fewer = {100, 1, 0, 129, 250, 3, 5};
  struct shape {
    index_t heads, heads_kv, d;
  };
  for (const shape& s : {shape{8, 2, 128}, shape{8, 8, 64}, shape{4, 1, 96}, shape{4, 2, 192}, shape{4, 4, 256},
                         shape{4, 2, 200}}) {
    INFO("h=" << s.heads << " h_kv=" << s.heads_kv << " d=" << s.d);
    run_ragged<T>(rows, rows, s.heads, s.heads_kv, s.d, causal{align::bottom_right});
    run_ragged<T>(rows, longer, s.heads, s.heads_kv, s.d, dense{});
    if (s.d == 128 || s.d == 64) {
      run_ragged<T>(rows, longer, s.heads, s.heads_kv, s.d, causal{align::bottom_right});
      run_ragged<T>(rows, fewer, s.heads, s.heads_kv, s.d, causal{align::bottom_right});
      run_ragged<T>(rows, longer, s.heads, s.heads_kv, s.d, causal{align::top_left});
      run_ragged<T>(rows, longer, s.heads, s.heads_kv, s.d, window{50, 3, align::bottom_right}, nullptr, {true, true});
    }
  }
}

TEST_CASE("cuda ragged prefill keeps an inf or NaN in one sequence's V out of the rows that do not see it",
          "[gpu][serving][ragged]") {
  if (!have_device()) return;
  using T = Eigen::bfloat16;
  // Three sequences of 100, 150 and 70 tokens, a window of 20 keys back: sequence 1's key 0 holds NaN in V,
  // sequence 2's key 0 inf. Sequence 0's last key tile reaches into sequence 1's keys (masked: its rows stay
  // finite); in sequences 1 and 2 rows 0–20 see their key 0 (O not finite), rows 21– do not (finite).
  const std::vector<std::int32_t> lens = {100, 150, 70}, cu = {0, 100, 250, 320};
  const index_t heads = 8, heads_kv = 2, d = 128, total = cu.back();
  const problem p{1, heads, heads_kv, total, total, d};
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  INFO("seed=" << seed);
  std::vector<T> q = uniform_values<T>(rng, total * heads * d), k = uniform_values<T>(rng, total * heads_kv * d),
                 v = uniform_values<T>(rng, total * heads_kv * d);
  for (index_t h = 0; h < heads_kv; ++h)
    for (index_t c = 0; c < d; ++c) {
      v[std::size_t((cu[1] * heads_kv + h) * d + c)] = T(std::numeric_limits<float>::quiet_NaN());
      v[std::size_t((cu[2] * heads_kv + h) * d + c)] = T(std::numeric_limits<float>::infinity());
    }
  dev<T> dq(q), dk(k), dv(v), d_o(std::vector<T>(q.size(), T(7.0f)));
  dev<std::int32_t> dcu(cu);
  dev<float> dlse(std::vector<float>(std::size_t(p.lse_size()), 123.0f));
  const window mask{20, 0, align::bottom_right};
  const auto [o, lse] = read_back(gpu::attend_ragged_cuda<T>(p, ragged_batch{3, dcu.ptr, dcu.ptr},
                                                             bshd<const T>(dq.ptr, p.q_dims()),
                                                             bshd<const T>(dk.ptr, p.kv_dims()),
                                                             bshd<const T>(dv.ptr, p.kv_dims()),
                                                             bshd(d_o.ptr, p.o_dims()), mask, dlse.ptr),
                                  d_o, dlse);
  for (index_t b = 0; b < 3; ++b)
    for (index_t i = 0; i < lens[std::size_t(b)]; ++i) {
      const index_t token = cu[std::size_t(b)] + i;
      const bool sees_bad = b > 0 && i <= 20;
      INFO("sequence " << b << " row " << i);
      for (index_t h = 0; h < heads; ++h) {
        bool finite = true;
        for (index_t c = 0; c < d; ++c) finite = finite && std::isfinite(float(o[std::size_t((token * heads + h) * d + c)]));
        CHECK(finite == !sees_bad);
        CHECK(std::isfinite(lse[std::size_t(h * total + token)]));  // V does not reach lse
      }
    }
  // Sequence 0's values against the oracle (its own inputs are finite).
  check_ragged_sequence<T>(p, q, k, v, cu, cu, 0, mask, o, lse);
}

/// Checks every sequence of a decode_case's O and lse (read back) against the oracle.
template <class T>
void check_batch(const problem& p, const decode_case<T>& c, const serving_mask& mask, const std::vector<T>& o,
                 const std::vector<float>& lse) {
  const index_t rows = p.heads * p.seq_q * p.head_dim, keys = p.heads_kv * p.seq_kv * p.head_dim;
  for (index_t b = 0; b < p.batch; ++b) {
    problem pb = p;
    pb.batch = 1;
    check_sequence<T>(pb, bhsd<const T>(c.q.data() + b * rows, pb.q_dims()),
                      bhsd<const T>(c.k.data() + b * keys, pb.kv_dims()),
                      bhsd<const T>(c.v.data() + b * keys, pb.kv_dims()), mask, o.data() + b * rows, p.head_dim,
                      p.seq_q * p.head_dim, lse.data() + b * p.heads * p.seq_q, p.seq_q);
  }
}

TEMPLATE_TEST_CASE("cuda attend on decode shapes runs cuda.decode", "[gpu][serving]", Eigen::half, Eigen::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  for (const problem& p : {problem{2, 32, 8, 1, 3001, 128}, problem{3, 16, 4, 4, 77, 64}, problem{1, 8, 8, 1, 9000, 256},
                           problem{1, 4, 4, 16, 200, 128}})
    for (const serving_mask& mask : {serving_mask{dense{}}, serving_mask{causal{align::bottom_right}},
                                     serving_mask{causal{align::top_left}}, serving_mask{window{30, 2, align::bottom_right}}}) {
      const std::uint64_t seed = fresh_seed();
      std::mt19937_64 rng(seed);
      INFO(scalar_name<T>() << " b=" << p.batch << " h=" << p.heads << " h_kv=" << p.heads_kv << " s_q=" << p.seq_q
                            << " s_kv=" << p.seq_kv << " d=" << p.head_dim << " " << mask_label(mask) << " seed=" << seed);
      decode_case<T> c(p, rng);
      const kernel_plan pl = gpu::plan_decode_cuda<T>(p, c.qv, c.kv, c.vv, c.ov, mask, c.dlse.ptr);
      INFO(pl.st.what());
      REQUIRE(pl.st.ok());
      CHECK(pl.kernel == "cuda.decode");
      const auto [o, lse] =
          read_back(gpu::attend_decode_cuda<T>(p, c.qv, c.kv, c.vv, c.ov, mask, c.dlse.ptr), c.d_o, c.dlse);
      check_batch(p, c, mask, o, lse);
    }
}

TEMPLATE_TEST_CASE("cuda decode splits a batch's keys over the SMs: tails, split counts, bitwise reruns",
                   "[gpu][serving]", Eigen::half, Eigen::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  // Batch 8 × 8 kv heads: the keys of each (sequence, kv head) split into a few blocks of 4 warps × 16-key tiles;
  // S_kv 4099 and 4033 leave a partial tile, a partial round of warps and a short last split; S_kv 5 leaves warps idle.
  for (const problem& p : {problem{8, 32, 8, 1, 4099, 128}, problem{8, 32, 8, 1, 5, 128}, problem{3, 16, 4, 2, 4033, 64}})
    for (const serving_mask& mask : {serving_mask{dense{}}, serving_mask{causal{align::bottom_right}},
                                     serving_mask{window{700, 0, align::bottom_right}}}) {
      const std::uint64_t seed = fresh_seed();
      std::mt19937_64 rng(seed);
      INFO(scalar_name<T>() << " b=" << p.batch << " h=" << p.heads << " h_kv=" << p.heads_kv << " s_q=" << p.seq_q
                            << " s_kv=" << p.seq_kv << " d=" << p.head_dim << " " << mask_label(mask) << " seed=" << seed);
      decode_case<T> c(p, rng);
      auto call = [&] {
        return read_back(gpu::attend_decode_cuda<T>(p, c.qv, c.kv, c.vv, c.ov, mask, c.dlse.ptr), c.d_o, c.dlse);
      };
      const outputs<T> r = call();
      check_batch(p, c, mask, r.o, r.lse);
      // The same call again: bitwise the same O and lse (fixed split count, fixed merge order).
      check_same_bits(r, call());
    }
  // Paged, the same batch shape with ragged lengths: pages of 16, each sequence its own split tails.
  run_paged<T>({1, 32, 8, 1, 1, 128}, 16, page_layout::nhd, {4099, 4033, 1, 4100, 63, 4096, 17, 2000},
               causal{align::bottom_right});
  run_paged<T>({1, 32, 8, 1, 1, 128}, 64, page_layout::hnd, {4099, 4033, 1, 4100, 63, 4096, 17, 2000}, dense{});
}

TEST_CASE("cuda decode keeps a masked key's inf and NaN out of the rows that do not see it", "[gpu][serving]") {
  if (!have_device()) return;
  using T = Eigen::bfloat16;
  // 4 rows per sequence, bottom-right causal: the last key is seen by row 3 only; its V holds inf, its K NaN.
  const problem p{1, 8, 2, 4, 500, 128};
  std::mt19937_64 rng(fresh_seed());
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> q(std::size_t(p.heads * p.seq_q * p.head_dim)), k(std::size_t(p.heads_kv * p.seq_kv * p.head_dim)), v(k.size());
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = T(float(u(rng)));
  for (index_t h = 0; h < p.heads_kv; ++h)
    for (index_t c = 0; c < p.head_dim; ++c) {
      v[std::size_t((h * p.seq_kv + p.seq_kv - 1) * p.head_dim + c)] = T(std::numeric_limits<float>::infinity());
      k[std::size_t((h * p.seq_kv + p.seq_kv - 1) * p.head_dim + c)] = T(std::numeric_limits<float>::quiet_NaN());
    }
  dev<T> dq(q), dk(k), dv(v), d_o(std::vector<T>(q.size(), T(7.0f)));
  dev<float> dlse(std::vector<float>(std::size_t(p.lse_size()), 123.0f));
  REQUIRE(gpu::attend_decode_cuda<T>(p, bhsd<const T>(dq.ptr, p.q_dims()), bhsd<const T>(dk.ptr, p.kv_dims()),
                                     bhsd<const T>(dv.ptr, p.kv_dims()), bhsd(d_o.ptr, p.o_dims()),
                                     causal{align::bottom_right}, dlse.ptr)
              .ok());
  const std::vector<T> o = d_o.get();
  const std::vector<float> lse = dlse.get();
  for (index_t h = 0; h < p.heads; ++h) {
    for (index_t i = 0; i < 3; ++i) {
      CHECK(std::isfinite(lse[std::size_t(h * p.seq_q + i)]));
      for (index_t c = 0; c < p.head_dim; ++c) CHECK(std::isfinite(float(o[std::size_t((h * p.seq_q + i) * p.head_dim + c)])));
    }
    CHECK(std::isnan(lse[std::size_t(h * p.seq_q + 3)]));  // row 3 sees the NaN logit
    CHECK(std::isnan(float(o[std::size_t((h * p.seq_q + 3) * p.head_dim)])));
  }
}

TEST_CASE("cuda serving calls refuse bad tables and offsets with nothing written", "[gpu][serving]") {
  if (!have_device()) return;
  using T = Eigen::half;
  std::mt19937_64 rng(fresh_seed());
  paged_case<T> c({1, 8, 2, 1, 1, 64}, 16, page_layout::nhd, {40, 7}, rng);
  const problem& p = c.p;
  const std::vector<T> sentinel(c.q.size(), T(7.0f));
  dev<T> dk(c.k), dv(c.v), dq(c.q), d_o(sentinel);
  dev<float> dlse(std::vector<float>(std::size_t(p.lse_size()), 123.0f));
  auto call = [&](std::vector<std::int32_t> table, std::vector<std::int32_t> lens) {
    dev<std::int32_t> dt(table), dl(lens);
    const paged_kv<const T> kv = paged<const T>(dk.ptr, dv.ptr, c.pages, 16, p.heads_kv, p.head_dim, page_layout::nhd,
                                                dt.ptr, c.blocks_per_seq, dl.ptr);
    return gpu::attend_paged_cuda<T>(p, bhsd<const T>(dq.ptr, p.q_dims()), kv, bhsd(d_o.ptr, p.o_dims()), dense{}, dlse.ptr);
  };
  {  // a page id out of range
    std::vector<std::int32_t> table = c.table;
    table[1] = std::int32_t(c.pages);
    check_refused(call(table, c.lens), "kv.block_table[0][1]");
    check_unwritten(d_o, dlse);
  }
  {  // a length beyond the sequence's pages
    std::vector<std::int32_t> lens = c.lens;
    lens[1] = std::int32_t(c.blocks_per_seq * 16 + 1);
    check_refused(call(c.table, lens), "kv.seq_lens[1]");
    check_unwritten(d_o, dlse);
  }
  {  // a host block table
    const paged_kv<const T> kv = paged<const T>(dk.ptr, dv.ptr, c.pages, 16, p.heads_kv, p.head_dim, page_layout::nhd,
                                                c.table.data(), c.blocks_per_seq, c.lens.data());
    const status st = gpu::attend_paged_cuda<T>(p, bhsd<const T>(dq.ptr, p.q_dims()), kv, bhsd(d_o.ptr, p.o_dims()),
                                                dense{}, dlse.ptr);
    CHECK(st.code() == errc::invalid_argument);
    check_unwritten(d_o, dlse);
  }
  {  // non-monotonic cu_seqlens
    const problem pr{1, 8, 2, 3, 40, 64};
    dev<std::int32_t> cq(std::vector<std::int32_t>{0, 1, 2, 3}), ck(std::vector<std::int32_t>{0, 30, 20, 40});
    // buffers of this problem's own size, so that only the offsets are wrong
    const std::size_t n_q = std::size_t(pr.heads * pr.seq_q * pr.head_dim), n_kv = std::size_t(pr.heads_kv * pr.seq_kv * pr.head_dim);
    dev<T> rq(std::vector<T>(n_q, T(0.5f))), rk(std::vector<T>(n_kv, T(0.5f))), rv(std::vector<T>(n_kv, T(0.5f)));
    dev<T> ro(std::vector<T>(n_q, T(7.0f)));
    dev<float> rlse(std::vector<float>(std::size_t(pr.heads * pr.seq_q), 123.0f));
    const status st = gpu::attend_ragged_cuda<T>(pr, ragged_batch{3, cq.ptr, ck.ptr}, bshd<const T>(rq.ptr, pr.q_dims()),
                                                 bshd<const T>(rk.ptr, pr.kv_dims()), bshd<const T>(rv.ptr, pr.kv_dims()),
                                                 bshd(ro.ptr, pr.o_dims()), dense{}, rlse.ptr);
    INFO(st.what());
    check_refused(st, "ragged.");
    check_each_unwritten(ro, rlse);
    check_unwritten(d_o, dlse);
  }
}

TEMPLATE_TEST_CASE("cuda paged and ragged calls plan from host mirrors: the same bits as reading the tables back",
                   "[gpu][serving][mirror]", Eigen::half, Eigen::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  const std::vector<std::int32_t> lens = {1, 17, 300, 0, 1000, 64};
  for (const mirror_set m : {mirror_set{true, true}, mirror_set{true, false}, mirror_set{false, true}}) {
    run_paged<T>({1, 32, 8, 1, 1, 128}, 16, page_layout::nhd, lens, causal{align::bottom_right}, nullptr, m);
    run_paged<T>({1, 32, 8, 1, 1, 128}, 64, page_layout::hnd, lens, dense{}, nullptr, m);
    // Ragged decode in one launch (a sequence of no keys), and ragged prefill sequence by sequence.
    run_ragged<T>({1, 1, 1, 1, 1}, {0, 1, 37, 512, 129}, 32, 8, 128, causal{align::bottom_right}, nullptr, m);
    run_ragged<T>({3, 0, 50, 1}, {3, 5, 50, 70}, 8, 2, 128, causal{align::bottom_right}, nullptr, m);
  }
  // Keys split over many blocks (the split count planned from the mirrored lengths), and speculative decode.
  run_paged<T>({1, 32, 8, 1, 1, 128}, 64, page_layout::nhd, {20000, 4099}, causal{align::bottom_right}, nullptr,
               {true, true});
  run_paged<T>({1, 32, 8, 3, 1, 128}, 16, page_layout::hnd, {5, 700, 2, 129}, window{100, 0, align::bottom_right},
               nullptr, {true, true});
}

TEST_CASE("cuda serving calls refuse bad host mirrors by name, nothing written", "[gpu][serving][mirror]") {
  if (!have_device()) return;
  using T = Eigen::half;
  std::mt19937_64 rng(fresh_seed());
  paged_case<T> c({1, 8, 2, 1, 1, 64}, 16, page_layout::nhd, {40, 7}, rng);
  const problem& p = c.p;
  dev<T> dk(c.k), dv(c.v), dq(c.q), d_o(std::vector<T>(c.q.size(), T(7.0f)));
  dev<float> dlse(std::vector<float>(std::size_t(p.lse_size()), 123.0f));
  dev<std::int32_t> dt(c.table), dl(c.lens);
  REQUIRE((dk.ptr && dv.ptr && dq.ptr && d_o.ptr && dlse.ptr && dt.ptr && dl.ptr));
  const paged_kv<const T> kv = paged<const T>(dk.ptr, dv.ptr, c.pages, 16, p.heads_kv, p.head_dim, page_layout::nhd,
                                              dt.ptr, c.blocks_per_seq, dl.ptr);
  auto call = [&](const paged_kv<const T>& view) {
    return gpu::attend_paged_cuda<T>(p, bhsd<const T>(dq.ptr, p.q_dims()), view, bhsd(d_o.ptr, p.o_dims()), dense{},
                                     dlse.ptr);
  };
  auto refused = [&](const status& st, const std::string& field) {
    INFO(st.what());
    check_refused(st, field);
    check_unwritten(d_o, dlse);
  };
  {  // a page id out of range in the mirror (the device table is right: the call validates the mirror)
    std::vector<std::int32_t> table = c.table;
    table[1] = std::int32_t(c.pages);
    refused(call(kv.with_host_tables(table.data(), nullptr)),
            "kv.host_block_table[0][1] is " + std::to_string(c.pages));
    table[1] = -1;
    refused(call(kv.with_host_tables(table.data(), c.lens.data())), "kv.host_block_table[0][1] is -1");
  }
  {  // a length beyond the sequence's pages in the mirror
    std::vector<std::int32_t> lens = c.lens;
    lens[1] = std::int32_t(c.blocks_per_seq * 16 + 1);
    refused(call(kv.with_host_tables(nullptr, lens.data())), "kv.host_seq_lens[1] is " + std::to_string(lens[1]));
  }
  // A mirror in device memory; a mirror without its device table; a host array as the device table.
  refused(call(kv.with_host_tables(dt.ptr, nullptr)), "kv.host_block_table is device memory");
  {
    paged_kv<const T> no_table = kv.with_host_tables(c.table.data(), c.lens.data());
    no_table.block_table = nullptr;
    refused(call(no_table), "kv.block_table is null");
    paged_kv<const T> host_lens = kv.with_host_tables(c.table.data(), c.lens.data());
    host_lens.seq_lens = c.lens.data();
    refused(call(host_lens), "kv.seq_lens");
  }
  // Ragged: a decreasing offset in the mirror of cu_seqlens_kv, the device arrays right.
  const problem pr{1, 8, 2, 3, 40, 64};
  const std::vector<std::int32_t> cu_q = {0, 1, 2, 3}, cu_kv = {0, 20, 30, 40};
  dev<std::int32_t> cq(cu_q), ck(cu_kv);
  const std::size_t n_q = std::size_t(pr.heads * pr.seq_q * pr.head_dim),
                    n_kv = std::size_t(pr.heads_kv * pr.seq_kv * pr.head_dim);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> hq(n_q), hk(n_kv), hv(n_kv);
  for (auto* x : {&hq, &hk, &hv})
    for (auto& e : *x) e = T(float(u(rng)));
  dev<T> rq(hq), rk(hk), rv(hv), ro(std::vector<T>(n_q, T(7.0f)));
  dev<float> rlse(std::vector<float>(std::size_t(pr.heads * pr.seq_q), 123.0f));
  auto ragged_call = [&](const ragged_batch& rb) {
    return gpu::attend_ragged_cuda<T>(pr, rb, bshd<const T>(rq.ptr, pr.q_dims()), bshd<const T>(rk.ptr, pr.kv_dims()),
                                      bshd<const T>(rv.ptr, pr.kv_dims()), bshd(ro.ptr, pr.o_dims()), dense{},
                                      rlse.ptr);
  };
  {
    const std::vector<std::int32_t> bad = {0, 30, 20, 40};
    const status st = ragged_call(ragged_batch{3, cq.ptr, ck.ptr}.with_host_offsets(nullptr, bad.data()));
    INFO(st.what());
    check_refused(st, "ragged.host_cu_seqlens_kv[2] is 20");
    check_each_unwritten(ro, rlse);
  }
  {  // Nothing read back: no kernel reads cu_seqlens_q's device array, so with its mirror the call neither validates
     // nor reads it (here it is deliberately wrong, which the call without the mirror refuses).
    dev<std::int32_t> wrong_q(std::vector<std::int32_t>{0, 2, 1, 3});
    check_refused(ragged_call(ragged_batch{3, wrong_q.ptr, ck.ptr}), "ragged.cu_seqlens_q[2] is 1");
    const outputs<T> plain = read_back(ragged_call(ragged_batch{3, cq.ptr, ck.ptr}), ro, rlse);
    refill(ro, rlse);
    const outputs<T> mirrored =
        read_back(ragged_call(ragged_batch{3, wrong_q.ptr, ck.ptr}.with_host_offsets(cu_q.data(), cu_kv.data())), ro,
                  rlse);
    CHECK(std::memcmp(mirrored.o.data(), plain.o.data(), mirrored.o.size() * sizeof(T)) == 0);
    CHECK(mirrored.lse == plain.lse);
  }
}

TEST_CASE("cuda serving calls refuse a stream being captured into a CUDA graph, with or without mirrors",
          "[gpu][serving][mirror]") {
  if (!have_device()) return;
  using T = Eigen::bfloat16;
  std::mt19937_64 rng(fresh_seed());
  paged_case<T> c({1, 8, 2, 1, 1, 64}, 16, page_layout::nhd, {40, 7}, rng);
  const problem& p = c.p;
  dev<T> dk(c.k), dv(c.v), dq(c.q), d_o(std::vector<T>(c.q.size(), T(7.0f)));
  dev<float> dlse(std::vector<float>(std::size_t(p.lse_size()), 123.0f));
  dev<std::int32_t> dt(c.table), dl(c.lens);
  REQUIRE((dk.ptr && dv.ptr && dq.ptr && d_o.ptr && dlse.ptr && dt.ptr && dl.ptr));
  const paged_kv<const T> kv = paged<const T>(dk.ptr, dv.ptr, c.pages, 16, p.heads_kv, p.head_dim, page_layout::nhd,
                                              dt.ptr, c.blocks_per_seq, dl.ptr);
  // A small ragged decode batch (one query row per sequence).
  const problem pr{1, 8, 2, 2, 30, 64};
  const std::vector<std::int32_t> cu_q = {0, 1, 2}, cu_kv = {0, 10, 30};
  dev<std::int32_t> cq(cu_q), ck(cu_kv);
  const std::size_t n_q = std::size_t(pr.heads * pr.seq_q * pr.head_dim),
                    n_kv = std::size_t(pr.heads_kv * pr.seq_kv * pr.head_dim);
  const std::vector<T> hk = uniform_values<T>(rng, index_t(n_kv));
  dev<T> rq(uniform_values<T>(rng, index_t(n_q))), rk(hk), rv(hk), ro(std::vector<T>(n_q, T(7.0f)));
  dev<float> rlse(std::vector<float>(std::size_t(pr.heads * pr.seq_q), 123.0f));
  REQUIRE((rq.ptr && rk.ptr && rv.ptr && ro.ptr && rlse.ptr && cq.ptr && ck.ptr));
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  // Runs `call` while `stream` is being captured, ends the capture, and checks the refusal.
  auto captured = [&](auto&& call) {
    REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
    const status st = call();
    cudaGraph_t graph = nullptr;
    const cudaError_t e = cudaStreamEndCapture(stream, &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    CHECK(e == cudaSuccess);
    INFO(st.what());
    CHECK(st.code() == errc::unsupported);
    CHECK(std::string(st.what()).find("CUDA graph") != std::string::npos);
  };
  for (const bool mirrored : {false, true}) {
    INFO((mirrored ? "with" : "without") << " host mirrors");
    captured([&] {
      return gpu::attend_paged_cuda_on<T>(stream, p, bhsd<const T>(dq.ptr, p.q_dims()),
                                          mirrored ? kv.with_host_tables(c.table.data(), c.lens.data()) : kv,
                                          bhsd(d_o.ptr, p.o_dims()), causal{align::bottom_right}, dlse.ptr);
    });
    captured([&] {
      const ragged_batch rb{2, cq.ptr, ck.ptr};
      return gpu::attend_ragged_cuda_on<T>(
          stream, pr, mirrored ? rb.with_host_offsets(cu_q.data(), cu_kv.data()) : rb,
          bshd<const T>(rq.ptr, pr.q_dims()), bshd<const T>(rk.ptr, pr.kv_dims()), bshd<const T>(rv.ptr, pr.kv_dims()),
          bshd(ro.ptr, pr.o_dims()), causal{align::bottom_right}, rlse.ptr);
    });
  }
  CHECK(cudaStreamSynchronize(stream) == cudaSuccess);
  check_each_unwritten(d_o, dlse);
  check_each_unwritten(ro, rlse);
  // Off capture, the same call on the same stream runs.
  const status st = gpu::attend_paged_cuda_on<T>(stream, p, bhsd<const T>(dq.ptr, p.q_dims()),
                                                 kv.with_host_tables(c.table.data(), c.lens.data()),
                                                 bhsd(d_o.ptr, p.o_dims()), causal{align::bottom_right}, dlse.ptr);
  INFO(st.what());
  CHECK(st.ok());
  CHECK(cudaStreamSynchronize(stream) == cudaSuccess);
  cudaStreamDestroy(stream);
  const std::vector<T> o = d_o.get();
  CHECK(std::none_of(o.begin(), o.end(), [](T x) { return float(x) == 7.0f; }));
}
