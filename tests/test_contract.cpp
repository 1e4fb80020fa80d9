// The numerical contract of attend() (dispatch/attend.hpp; docs/design.md "Numerics") on every CPU kernel: the
// naive pipeline, the flash kernel on every SIMD arch this binary has, and its scalar path, under every mask.
//   NaN and inf reach only the outputs that depend on them; masked probabilities never multiply V;
//   a row that sees no key gives O = 0 and lse = −inf; a NaN in a row's logits makes its O and lse NaN.
// Also: zero extents (nothing written; seq_kv = 0 means no row sees a key) and fa::plan (the kernel, its scratch,
// and the same status as attend on bad input, with nothing written).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "support/check.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;

namespace {

/// Every CPU kernel of this binary: naive, scalar flash, flash on each SIMD arch compiled in and on fusedattn's own
/// x86 kernel sets (cpu::avx512bf16: vdpbf16ps for bf16, the AVX-512 f32 kernels otherwise). Under
/// FUSEDATTN_TEST_SUBSET (CI's sanitizer stage) avx2 is left out where avx512 is compiled in: sse4_2 and avx512
/// keep the narrowest and the widest vector tails.
using contract_policies = std::tuple<policy::cpu_naive, policy::cpu_scalar
#if XSIMD_WITH_SSE4_2
                                     ,
                                     policy::cpu_sse4_2
#endif
#if XSIMD_WITH_FMA3_AVX2 && !(FUSEDATTN_TEST_SUBSET && XSIMD_WITH_AVX512F)
                                     ,
                                     policy::cpu_avx2
#endif
#if XSIMD_WITH_AVX512F
                                     ,
                                     policy::cpu_avx512
#endif
#if XSIMD_WITH_NEON64
                                     ,
                                     policy::cpu_neon
#endif
#if FUSEDATTN_X86_KERNELS
                                     ,
                                     policy::cpu_avx512bf16  // fusedattn's own AVX-512 sets, run-time checked
#endif
                                     >;

template <class Policy>
bool runs_here(const Policy&) {
  return true;
}
template <class Arch>
bool runs_here(const policy::cpu<Arch>&) {
  return cpu::arch_available<Arch>();
}

template <class Policy>
Policy with_threads(int threads, tile_sizes tiles = {}) {
  Policy pol{};
  pol.threads = threads;
  if constexpr (!std::is_same_v<Policy, policy::cpu_naive>) pol.tiles = tiles;
  return pol;
}

const float inf_f = std::numeric_limits<float>::infinity();

/// What is injected and where: Q row (b, h, i), K row (b, g, j) or V element (b, g, j, c).
enum class site { q_nan, k_nan, v_nan, v_inf, v_neg_inf };
const char* site_name(site s) {
  const char* n[] = {"NaN in q", "NaN in k", "NaN in v", "+inf in v", "-inf in v"};
  return n[static_cast<int>(s)];
}

/// Runs `pol` on a case with one non-finite input and checks every output against the contract: rows the input
/// cannot reach match the oracle of the clean inputs; reached outputs are non-finite as specified; rows that see
/// no key are exactly O = 0, lse = −inf.
template <class T, class Policy>
void check_contract(const Policy& pol, const problem& p, const any_mask& mask, site where, index_t b, index_t h,
                    index_t i, index_t j, index_t c, layout l) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  attention_case<T> cs(p, l, rng);
  const std::string what = std::string(scalar_name<T>()) + " " + describe(p) + " " + describe(mask) + " " +
                           site_name(where) + " " + layout_name(l) + " seed=" + std::to_string(seed);
  INFO(what);
  const expected e = std::visit([&](const auto& m) { return expect(cs, bind(m, p)); }, mask);  // clean inputs
  const index_t g = p.kv_head(h);
  const T nan = static_cast<T>(std::numeric_limits<float>::quiet_NaN());
  const T inf = static_cast<T>(inf_f);
  switch (where) {
    case site::q_nan: cs.q.view.row(b, h, i)[c] = nan; break;
    case site::k_nan: cs.k.view.row(b, g, j)[c] = nan; break;
    case site::v_nan: cs.v.view.row(b, g, j)[c] = nan; break;
    case site::v_inf: cs.v.view.row(b, g, j)[c] = inf; break;
    case site::v_neg_inf: cs.v.view.row(b, g, j)[c] = -inf; break;
  }
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()), 123.0f);
  const status st = attend(pol, p, cs.q.cview(), cs.k.cview(), cs.v.cview(), cs.o.view, mask, lse.data());
  INFO(st.what());
  REQUIRE(st.ok());

  index_t reached_rows = 0, no_key_rows = 0, wrong = 0;
  double err = 0, lse_err = 0;
  std::string first_wrong;
  const auto fail = [&](const std::string& why) {
    if (wrong++ == 0) first_wrong = why;
  };
  std::visit(
      [&](const auto& m) {
        const auto bound = bind(m, p);
        for (index_t bb = 0; bb < p.batch; ++bb)
          for (index_t hh = 0; hh < p.heads; ++hh) {
            const auto hm = for_head(bound, bb, hh);
            for (index_t ii = 0; ii < p.seq_q; ++ii) {
              bool sees_any = false;
              for (index_t jj = 0; jj < p.seq_kv && !sees_any; ++jj) sees_any = hm.allowed(ii, jj);
              const bool same_kv = bb == b && p.kv_head(hh) == g;
              const bool reached = where == site::q_nan ? (bb == b && hh == h && ii == i && sees_any)
                                                        : (same_kv && hm.allowed(ii, j));
              const std::size_t row = static_cast<std::size_t>((bb * p.heads + hh) * p.seq_q + ii);
              const std::string at = "(" + std::to_string(bb) + "," + std::to_string(hh) + "," + std::to_string(ii) + ")";
              const float l_out = lse[row];
              reached_rows += reached;
              if (!sees_any) {
                ++no_key_rows;
                if (l_out != -inf_f) fail("row " + at + " sees no key but lse is " + std::to_string(l_out));
                for (index_t col = 0; col < p.head_dim; ++col)
                  if (static_cast<double>(cs.o.view.row(bb, hh, ii)[col]) != 0.0) fail("row " + at + " sees no key but O != 0");
                continue;
              }
              const bool logits_hit = reached && where != site::v_nan && where != site::v_inf && where != site::v_neg_inf;
              if (logits_hit) {
                if (!std::isnan(l_out)) fail("row " + at + ": a NaN logit but lse " + std::to_string(l_out));
              } else if (!std::isfinite(l_out)) {
                fail("row " + at + ": lse " + std::to_string(l_out) + " should be finite");
              } else {
                lse_err = std::max(lse_err, std::abs(static_cast<double>(l_out) - e.ref.lse[row]));
              }
              for (index_t col = 0; col < p.head_dim; ++col) {
                const double x = static_cast<double>(cs.o.view.row(bb, hh, ii)[col]);
                const bool elem_hit = logits_hit || (reached && col == c);
                if (elem_hit) {
                  // NaN logits and NaN values give NaN; an infinite value gives ±inf (or NaN when ∞ − ∞ meets).
                  const bool ok = where == site::v_inf || where == site::v_neg_inf ? !std::isfinite(x) : std::isnan(x);
                  if (!ok) fail("O" + at + "[" + std::to_string(col) + "] is " + std::to_string(x));
                } else if (!std::isfinite(x)) {
                  fail("O" + at + "[" + std::to_string(col) + "] is " + std::to_string(x) + " but depends on no " +
                       "non-finite input");
                } else {
                  err = std::max(err, std::abs(x - e.ref.o[row * static_cast<std::size_t>(p.head_dim) +
                                                          static_cast<std::size_t>(col)]));
                }
              }
            }
          }
      },
      mask);
  INFO("reached rows " << reached_rows << ", rows without keys " << no_key_rows << "; wrong outputs " << wrong
                       << " (first: " << first_wrong << "); max error " << err << " tolerance " << e.tolerance
                       << "; lse error " << lse_err << " tolerance " << e.lse_tolerance);
  CHECK(reached_rows > 0);
  CHECK(wrong == 0);
  CHECK(err <= e.tolerance);
  CHECK(lse_err <= e.lse_tolerance);
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("contract: non-finite inputs reach only the outputs that depend on them, every mask",
                        "[contract][numerics]", contract_policies) {
  const TestType probe{};
  if (!runs_here(probe)) {
    WARN("this CPU cannot run the arch: skipped");
    return;
  }
  // seq_q > seq_kv: under the bottom-right masks the first rows see no key. GQA 4 / 2.
  const problem p{2, 4, 2, 13, 9, 19};
  const block_layout blocks = random_layout(block_geometry{p.seq_q, p.seq_kv, 3, 2, 1, p.heads}, 0.4, 11);
  std::vector<any_mask> masks = all_masks();
  masks.push_back(window{2, 1, align::bottom_right});
  masks.push_back(block_sparse{blocks});
  masks.push_back(block_sparse{blocks, causal{align::bottom_right}});
  // The NaN / inf at key j = 5 of kv head 1 of batch 1; Q's at row 10 of head 3 (kv head 1).
  const site sites[] = {site::q_nan, site::k_nan, site::v_nan, site::v_inf, site::v_neg_inf};
  for (const any_mask& m : masks)
    for (site s : sites) {
      // Default tiles, then 4 x 4 tiles (the key inside a partial tile of rows that skip it) and the decode split.
      check_contract<float>(with_threads<TestType>(2), p, m, s, 1, 3, 10, 5, 7, layout::bhsd);
      check_contract<float>(with_threads<TestType>(3, {4, 4, 0}), p, m, s, 1, 3, 10, 5, 7, layout::padded);
      check_contract<double>(with_threads<TestType>(1, {4, 4, 2}), p, m, s, 1, 3, 10, 5, 7, layout::bshd);
      check_contract<Eigen::bfloat16>(with_threads<TestType>(2, {8, 4, 0}), p, m, s, 1, 3, 10, 5, 7, layout::bhsd);
    }
}

TEMPLATE_LIST_TEST_CASE("contract: zero extents are valid, nothing is written or rows see no key",
                        "[contract][zero]", contract_policies) {
  const TestType pol = with_threads<TestType>(2);
  if (!runs_here(pol)) return;
  std::mt19937_64 rng(fresh_seed());
  // batch, heads or seq_q 0: ok, nothing written; the empty views may be null.
  for (const problem& p : {problem{0, 2, 1, 5, 6, 8}, problem{2, 0, 0, 5, 6, 8}, problem{2, 0, 1, 5, 6, 8},
                           problem{2, 2, 1, 0, 6, 8}, problem{2, 2, 1, 0, 0, 8}}) {
    INFO(describe(p));
    std::vector<float> arena(256, 3.0f);
    const std::vector<float> before = arena;
    const auto q = bhsd<const float>(nullptr, p.q_dims());
    const bool kv_empty = p.batch * p.heads_kv * p.seq_kv == 0;
    const auto kv = bhsd<const float>(kv_empty ? nullptr : arena.data(), p.kv_dims());
    const auto o = bhsd<float>(nullptr, p.o_dims());
    float* lse = arena.data() + 200;
    for (const any_mask& m : {any_mask{dense{}}, any_mask{causal{align::bottom_right}}, any_mask{window{1, 1}}}) {
      const status st = attend(pol, p, q, kv, kv, o, m, lse);
      INFO(st.what());
      CHECK(st.ok());
      const kernel_plan pl = plan(pol, p, q, kv, kv, o, m, lse);
      CHECK(pl.st.ok());
      CHECK(pl.kernel == "cpu.none");
      CHECK(pl.scratch_bytes == 0);
    }
    CHECK(arena == before);
  }
  // seq_kv 0: every row sees no key, under every mask, K and V null.
  const problem p{2, 3, 1, 7, 0, 5};
  const block_layout no_keys = dense_layout(block_geometry{7, 0, 4, 4, 1, 1});
  std::vector<any_mask> masks = all_masks();
  masks.push_back(block_sparse{no_keys});
  for (const any_mask& m : masks) {
    INFO(describe(m));
    attention_case<float> c(p, layout::padded, rng);
    std::vector<float> lse(static_cast<std::size_t>(p.lse_size()), 4.0f);
    const auto kv = bhsd<const float>(nullptr, p.kv_dims());
    const std::vector<float> o_before = c.o.buf;
    const status st = attend(pol, p, c.q.cview(), kv, kv, c.o.view, m, lse.data());
    INFO(st.what());
    REQUIRE(st.ok());
    for (index_t b = 0; b < p.batch; ++b)
      for (index_t h = 0; h < p.heads; ++h)
        for (index_t i = 0; i < p.seq_q; ++i)
          for (index_t d = 0; d < p.head_dim; ++d) CHECK(c.o.view.row(b, h, i)[d] == 0.0f);
    CHECK(std::all_of(lse.begin(), lse.end(), [](float x) { return x == -inf_f; }));
    // The gaps of the padded O are untouched.
    index_t changed = 0;
    for (std::size_t n = 0; n < c.o.buf.size(); ++n) changed += c.o.buf[n] != o_before[n];
    CHECK(changed <= p.batch * p.heads * p.seq_q * p.head_dim);
    const kernel_plan pl = plan(pol, p, c.q.cview(), kv, kv, c.o.view, m, lse.data());
    CHECK(pl.kernel == "cpu.no_keys");
    CHECK(pl.scratch_bytes == 0);
  }
  // heads_kv 0 with heads > 0, and head_dim 0, stay errors.
  const auto none = bhsd<const float>(nullptr, dims4{1, 0, 4, 4});
  const status st = attend(pol, problem{1, 2, 0, 4, 4, 4}, none, none, none, bhsd<float>(nullptr, dims4{1, 0, 4, 4}));
  CHECK(st.code() == errc::invalid_argument);
}

TEMPLATE_LIST_TEST_CASE("plan: the kernel, its scratch and attend's status, with nothing written", "[contract][plan]",
                        contract_policies) {
  const TestType pol = with_threads<TestType>(3, {0, 0, 0});
  if (!runs_here(pol)) return;
  constexpr bool naive = std::is_same_v<TestType, policy::cpu_naive>;
  std::mt19937_64 rng(fresh_seed());
  for (const problem& p : {problem{2, 4, 2, 37, 53, 24}, problem{1, 2, 1, 1, 3000, 64}, problem{1, 1, 1, 300, 2, 512}}) {
    INFO(describe(p));
    attention_case<float> c(p, layout::bhsd, rng);
    std::vector<float> lse(static_cast<std::size_t>(p.lse_size()), 4.0f);
    const std::vector<float> o_before = c.o.buf;
    for (const any_mask& m : all_masks()) {
      const kernel_plan pl = plan(pol, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, m, lse.data());
      INFO(describe(m) << ": " << pl.st.what());
      REQUIRE(pl);
      CHECK(c.o.buf == o_before);
      CHECK(std::all_of(lse.begin(), lse.end(), [](float x) { return x == 4.0f; }));
      if constexpr (naive) {
        CHECK(pl.kernel == "cpu.naive");
        CHECK(!pl.fused);
        CHECK(!pl.why.empty());
        const index_t threads = std::min<index_t>(3, p.batch * p.heads);
        CHECK(pl.scratch_bytes == static_cast<std::size_t>(kernels::naive_workspace_bytes<float>(p) * threads));
      } else {
        using arch = typename TestType::arch;
        CHECK(pl.kernel == std::string("cpu.flash<") + arch::name() + ">");
        CHECK(pl.fused);
        CHECK(pl.why.empty());
        const index_t want = std::visit(
            [&](const auto& mm) { return kernels::flash_scratch_bytes<float, arch>(p, bind(mm, p), pol.tiles, 3); }, m);
        CHECK(pl.scratch_bytes == static_cast<std::size_t>(want));
        CHECK(pl.scratch_bytes > 0);
      }
    }
  }
  // Bad input: the same status as attend, nothing written.
  const problem p{1, 2, 2, 5, 6, 8};
  attention_case<float> c(p, layout::bhsd, rng);
  const std::vector<float> o_before = c.o.buf;
  auto q = c.q.cview(), k = c.k.cview(), v = c.v.cview();
  auto o = c.o.view;
  auto o_shared = o;
  o_shared.stride.s = 4;
  auto k_wrong = k;
  k_wrong.dims.s = 7;
  problem bad_scale = p;
  bad_scale.scale = -1e-300;
  const auto same = [&](const TestType& pl_pol, const problem& pr, tensor_ref<const float> qq, tensor_ref<const float> kk,
                        tensor_ref<float> oo, const any_mask& m) {
    const kernel_plan pl = plan(pl_pol, pr, qq, kk, v, oo, m);
    const status st = attend(pl_pol, pr, qq, kk, v, oo, m);
    INFO(st.what());
    CHECK(!st.ok());
    CHECK(pl.st.code() == st.code());
    CHECK(pl.st.message() == st.message());
    CHECK(pl.kernel.empty());
    CHECK(c.o.buf == o_before);
  };
  same(pol, p, q, k, o_shared, dense{});
  same(pol, p, q, k_wrong, o, causal{});
  same(pol, bad_scale, q, k, o, dense{});
  same(with_threads<TestType>(0), p, q, k, o, dense{});
  same(pol, p, q, k, o, window{-1, 0});
  if constexpr (!naive) same(with_threads<TestType>(1, {-2, 0, 0}), p, q, k, o, dense{});
  // Sizes whose scratch cannot be counted in 64 bits: refused by both, before any allocation. Q, K, V and O
  // broadcast one element (stride 0): no memory of that size exists.
  const problem huge = naive ? problem{1, 1, 1, index_t(1) << 40, index_t(1) << 40, 1}
                             : problem{256, 1, 1, 1, index_t(1) << 47, 64};
  std::vector<float> arena(128, 0.5f);  // the inputs span at most 64 elements; O starts past them (never written)
  const auto hq = strided<const float>(arena.data(), huge.q_dims(), {0, 0, 0, 1});
  const auto hkv = strided<const float>(arena.data(), huge.kv_dims(), {0, 0, 0, 1});
  const auto ho = strided<float>(arena.data() + 64, huge.o_dims(), {naive ? 0 : 64, 0, naive ? 1 : 0, 1});
  const TestType many = with_threads<TestType>(naive ? 1 : 256);
  const kernel_plan pl = plan(many, huge, hq, hkv, hkv, ho);
  const status st_huge = attend(many, huge, hq, hkv, hkv, ho);
  CHECK(st_huge.message() == pl.st.message());
  INFO(pl.st.what());
  CHECK(pl.st.code() == errc::invalid_argument);
  CHECK(pl.st.message().find(naive ? "need more than 2^63 bytes" : "need more than 2^62 bytes") != std::string::npos);
#if !FUSEDATTN_WITH_CUDA
  const kernel_plan cu = plan(policy::cuda{}, p, q, k, v, o);
  CHECK(cu.st.code() == errc::unsupported);
  CHECK(cu.st.message() == attend(policy::cuda{}, p, q, k, v, o).message());
#endif
}
