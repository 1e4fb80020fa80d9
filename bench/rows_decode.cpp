// Decode rows: one query row per sequence and head against a long KV cache, contiguous (attend) or paged
// (attend_paged), named decode/<type>/<contig|paged>/b{B}_h{H}_hkv{Hkv}_skv{S}_d{D}/threads:{T}. Bytes are the
// K and V the call reads (the memory-speed measure), B/s their rate; the roofline table sets them against triad.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <fusedattn/dispatch/serving.hpp>

#include "rows.hpp"

namespace fusedattn::bench {
namespace {

/// Storage of the decode rows' K/V (Q and O use the same type; bf16kv: bf16 K/V with f32 Q and O, mixed storage).
enum class decode_type { f32, f16, bf16, bf16kv };

struct decode_spec {
  index_t b = 1, h = 32, h_kv = 8, s_kv = 32768, d = 128;
  decode_type type = decode_type::f32;
  bool paged = false;
  index_t page_size = 16;
  int threads = 1;
};

const char* type_label(decode_type t) {
  switch (t) {
    case decode_type::f32: return "f32";
    case decode_type::f16: return "f16";
    case decode_type::bf16: return "bf16";
    default: return "bf16kv";
  }
}

std::string decode_name(const decode_spec& s) {
  return std::string("decode/") + type_label(s.type) + "/" + (s.paged ? "paged" : "contig") + "/b" +
         std::to_string(s.b) + "_h" + std::to_string(s.h) + "_hkv" + std::to_string(s.h_kv) + "_skv" +
         std::to_string(s.s_kv) + "_d" + std::to_string(s.d) + "/threads:" + std::to_string(s.threads);
}

template <class T, class KV = T>
void decode_row(benchmark::State& state, decode_spec s) {
  const problem p{s.b, s.h, s.h_kv, 1, s.s_kv, s.d};
  const index_t kv_elems = s.b * s.h_kv * s.s_kv * s.d;
  std::vector<float> tmp(static_cast<std::size_t>(std::max(kv_elems, p.batch * p.heads * p.head_dim)));
  auto make = [&](auto type, std::size_t n, std::uint64_t seed) {
    using X = decltype(type);
    fill_uniform(tmp.data(), n, seed);
    std::vector<X> x(n);
    for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<X>(tmp[i]);
    return x;
  };
  const std::vector<T> q = make(T{}, static_cast<std::size_t>(p.batch * p.heads * p.head_dim), 1);
  const std::vector<KV> k = make(KV{}, static_cast<std::size_t>(kv_elems), 2),
                        v = make(KV{}, static_cast<std::size_t>(kv_elems), 3);
  std::vector<T> o(q.size());
  // Paged: the same keys in pages of page_size tokens ([page][token][kv_head][d]), pages in shuffled order.
  const index_t blocks = (s.s_kv + s.page_size - 1) / s.page_size;
  std::vector<std::int32_t> table(static_cast<std::size_t>(s.b * blocks)), lens(static_cast<std::size_t>(s.b),
                                                                                 static_cast<std::int32_t>(s.s_kv));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937_64(4));
  std::vector<KV> k_pages, v_pages;
  const page_strides ps = page_strides_of(page_layout::nhd, s.page_size, s.h_kv, s.d);
  if (s.paged) {
    k_pages.resize(static_cast<std::size_t>(s.b * blocks * ps.page));
    v_pages.resize(k_pages.size());
    for (index_t b = 0; b < s.b; ++b)
      for (index_t h = 0; h < s.h_kv; ++h)
        for (index_t j = 0; j < s.s_kv; ++j) {
          const index_t src = ((b * s.h_kv + h) * s.s_kv + j) * s.d;
          const index_t dst = table[static_cast<std::size_t>(b * blocks + j / s.page_size)] * ps.page + h * ps.head +
                              (j % s.page_size) * ps.token;
          std::copy(k.begin() + src, k.begin() + src + s.d, k_pages.begin() + dst);
          std::copy(v.begin() + src, v.begin() + src + s.d, v_pages.begin() + dst);
        }
  }
  const policy::cpu<> pol{s.threads};
  const auto qv = bhsd<const T>(q.data(), p.q_dims());
  const auto ov = bhsd(o.data(), p.o_dims());
  const auto call = [&] {
    if (s.paged)
      return attend_paged(pol, p, qv,
                          paged<const KV>(k_pages.data(), v_pages.data(), s.b * blocks, s.page_size, s.h_kv, s.d,
                                         page_layout::nhd, table.data(), blocks, lens.data()),
                          ov, causal{align::bottom_right});
    return attend(pol, p, qv, bhsd<const KV>(k.data(), p.kv_dims()), bhsd<const KV>(v.data(), p.kv_dims()), ov,
                  causal{align::bottom_right});
  };
  if (!time_calls(state, call, o.data())) return;
  const double kv_bytes = 2.0 * static_cast<double>(kv_elems) * sizeof(KV);
  set_counters(state, p, s.threads, 1.0, cost::flops(p, 1.0), kv_bytes, kv_bytes);
  state.SetLabel(std::string(type_label(s.type)) + (s.paged ? " paged" : " contig") + " decode");
}

void register_decode(const decode_spec& s) {
  const std::string name = decode_name(s);
  benchmark::internal::Benchmark* b =
      s.type == decode_type::f32   ? benchmark::RegisterBenchmark(name.c_str(), decode_row<float>, s)
      : s.type == decode_type::f16  ? benchmark::RegisterBenchmark(name.c_str(), decode_row<Eigen::half>, s)
      : s.type == decode_type::bf16 ? benchmark::RegisterBenchmark(name.c_str(), decode_row<Eigen::bfloat16>, s)
                                    : benchmark::RegisterBenchmark(name.c_str(), decode_row<float, Eigen::bfloat16>, s);
  b->UseRealTime()->Unit(benchmark::kMicrosecond);
}

}  // namespace

/// Quick: S_kv 32768, 32/8 heads, d 128, batch 1, f32, f16 and bf16 K/V beside f32 Q/O (bf16kv), contiguous and
/// paged (16-token pages), 1 thread and all threads. Full: also S_kv 8192 and 131072, batch 8 at 8192, and bf16.
void register_decode_rows(const plan& pl) {
  std::vector<int> threads{1};
  if (pl.max_threads > 1) threads.push_back(pl.max_threads);
  std::vector<decode_spec> specs;
  const std::vector<decode_type> types =
      pl.full ? std::vector<decode_type>{decode_type::f32, decode_type::f16, decode_type::bf16, decode_type::bf16kv}
              : std::vector<decode_type>{decode_type::f32, decode_type::f16, decode_type::bf16kv};
  std::vector<std::pair<index_t, index_t>> shapes{{1, 32768}};  // (batch, s_kv)
  if (pl.full) shapes = {{1, 8192}, {1, 32768}, {1, 131072}, {8, 8192}};
  for (const auto& [b, s_kv] : shapes)
    for (decode_type t : types)
      for (int paged : {0, 1})
        for (int th : threads) {
          decode_spec s;
          s.b = b;
          s.s_kv = s_kv;
          s.type = t;
          s.paged = paged == 1;
          s.threads = th;
          specs.push_back(s);
        }
  for (const decode_spec& s : specs) register_decode(s);
}

}  // namespace fusedattn::bench
