// fusedattn's own x86 kernel sets (cpu::avx512, cpu::avx512bf16: vdpbf16ps on bf16 pairs), the run-time choice
// cpu::best (policy::cpu_auto) and mixed storage (f32 Q and O, bf16 or f16 K and V) against the float64 oracle.
// The accuracy rule: max error <= 2 x the error of a plain implementation that takes the same inputs and
// accumulates in f32 (its output rounded to the output type). Built twice: with the tree's flags and for generic
// x86-64 (test_lowp_generic), where only the run-time checked kernels can reach AVX-512.
#include <cmath>
#include <string>

#include "support/check.hpp"
#include "support/lowp_check.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;

namespace {

using bf16 = Eigen::bfloat16;
using f16 = Eigen::half;

/// The lse slack: lse is f32 in every kernel; a plain f32 error can be 0 by luck.
constexpr double lse_floor = 64.0 * 1.1920928955078125e-07;

/// The shapes of this file: tails in every dimension (odd head_dim, seq not a multiple of 64 or 256), GQA, MQA,
/// seq_q != seq_kv both ways, one row, one key.
std::vector<problem> lowp_shapes() {
  return {{1, 1, 1, 1, 1, 2},       {1, 1, 1, 7, 9, 3},       {2, 4, 2, 127, 129, 64}, {1, 2, 1, 300, 257, 80},
          {1, 8, 2, 65, 513, 128},  {1, 2, 2, 1000, 31, 96},  {1, 4, 1, 33, 65, 65},   {1, 1, 1, 1, 300, 256},
          {1, 3, 3, 64, 64, 17}};
}

std::vector<any_mask> lowp_masks() {
  return {dense{}, causal{align::top_left}, causal{align::bottom_right}, window{5, 3, align::top_left},
          window{33, 0, align::bottom_right}};
}

/// Runs `pol` on fresh random same-type inputs and checks O and lse against the oracle with the 2x-plain rule.
template <class T, class Policy>
void check_same_type(const Policy& pol, const problem& p, const any_mask& mask, layout l, double lo, double hi) {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed, describe(p), describe(mask), layout_name(l), pol.threads, lo, hi);
  std::mt19937_64 rng(seed);
  attention_case<T> c(p, l, rng);
  c.q.fill(rng, lo, hi);
  c.k.fill(rng, lo, hi);
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
  const status st = attend(pol, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse.data());
  REQUIRE(st.ok());
  const band_mask bound = bind_band(mask, p);
  const reference exact = reference_attention<double>(p, c.q.cview(), c.k.cview(), c.v.cview(), bound);
  const reference plain = reference_attention<float>(p, c.q.cview(), c.k.cview(), c.v.cview(), bound);
  const double bf16_err = std::is_same<T, bf16>::value
                              ? bf16_plain_error(p, c.q.cview(), c.k.cview(), c.v.cview(), bound, plain, exact)
                              : 0.0;
  check_lowp_rule(c.o.view, lse, exact, plain, lse_floor, bf16_err);
}

/// Mixed storage: f32 Q and O, K and V of type TKV. The oracle and the plain implementation read K and V widened
/// to f32 (exactly the values the kernel sees).
template <class TKV, class Policy>
void check_mixed(const Policy& pol, const problem& p, const any_mask& mask, layout l) {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed, describe(p), describe(mask), layout_name(l), pol.threads);
  std::mt19937_64 rng(seed);
  operand<float> q(p.q_dims(), l), o(p.o_dims(), l), k32(p.kv_dims(), layout::bhsd), v32(p.kv_dims(), layout::bhsd);
  operand<TKV> k(p.kv_dims(), l), v(p.kv_dims(), l);
  q.fill(rng, -2.0, 2.0);
  k.fill(rng, -2.0, 2.0);
  v.fill(rng);
  o.fill(rng, 7.0, 9.0);
  convert(k, k32);
  convert(v, v32);
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
  const status st = attend(pol, p, q.cview(), k.cview(), v.cview(), o.view, mask, lse.data());
  REQUIRE(st.ok());
  const band_mask bound = bind_band(mask, p);
  const reference exact = reference_attention<double>(p, q.cview(), k32.cview(), v32.cview(), bound);
  const reference plain = reference_attention<float>(p, q.cview(), k32.cview(), v32.cview(), bound);
  const double err = max_abs_error(o.view, exact.o), plain_err = plain_error<float>(plain, exact);
  INFO("max error " << err << ", plain f32 implementation " << plain_err);
  CHECK(err <= 2.0 * plain_err + 8.0 * epsilon<float>());
  const double lse_err = max_lse_error(lse, exact.lse), plain_lse = plain_lse_error(plain, exact);
  INFO("lse error " << lse_err << ", plain " << plain_lse);
  CHECK(lse_err <= 2.0 * plain_lse + lse_floor);
}

bool has_bf16() { return cpu::avx512bf16::available(); }
bool has_avx512() { return cpu::avx512::available(); }

}  // namespace

TEST_CASE("lowp: the CPU's features as CPUID reports them", "[lowp]") {
  const cpu::x86_features& f = cpu::x86_cpu();
  INFO("compiled for " << cpu::compiled_arch::name() << "; avx2_fma " << f.avx2_fma << " avx512 " << f.avx512 << " avx512bf16 " << f.avx512bf16 << " avx512fp16 "
                   << f.avx512fp16 << " amx_bf16 " << f.amx_bf16);
  CHECK((!f.avx512bf16 || f.avx512));  // each level implies the one below
  CHECK((!f.avx512 || f.avx2_fma));
  CHECK(cpu::arch_available<cpu::avx512bf16>() == f.avx512bf16);
  CHECK(cpu::arch_available<cpu::best>());
}

TEST_CASE("lowp: bf16 storage on vdpbf16ps against float64, error <= 2x a plain f32-accumulating implementation",
          "[lowp]") {
  if (!has_bf16()) {
    WARN("skipped: this CPU has no AVX512-BF16 (cpu::avx512bf16 is not available)");
    return;
  }
  for (const problem& p : lowp_shapes())
    for (const any_mask& mask : lowp_masks())
      for (int threads : {1, 3}) check_same_type<bf16>(policy::cpu_avx512bf16{threads}, p, mask, layout::bhsd, -1, 1);
  // Larger logits (a peaked softmax), strided layouts.
  const problem p{1, 4, 2, 200, 333, 64};
  check_same_type<bf16>(policy::cpu_avx512bf16{2}, p, causal{align::bottom_right}, layout::bshd, -3, 3);
  check_same_type<bf16>(policy::cpu_avx512bf16{2}, p, dense{}, layout::padded, -4, 4);
}

TEST_CASE("lowp: f32 and f16 storage on the AVX-512 kernel sets against float64", "[lowp]") {
  if (!has_avx512()) {
    WARN("skipped: this CPU has no AVX-512 (cpu::avx512 is not available)");
    return;
  }
  for (const problem& p : lowp_shapes())
    for (const any_mask& mask : lowp_masks()) {
      check_same_type<float>(policy::cpu_avx512_runtime{2}, p, mask, layout::bhsd, -1, 1);
      check_same_type<f16>(policy::cpu_avx512_runtime{1}, p, mask, layout::bshd, -1, 1);
      if (has_bf16()) check_same_type<float>(policy::cpu_avx512bf16{1}, p, mask, layout::padded, -1, 1);
    }
}

TEST_CASE("lowp: mixed storage, f32 Q and O with bf16 or f16 K and V, against float64", "[lowp]") {
  // Every CPU: the compiled arch; and the AVX-512 kernel sets where the CPU has them.
  for (const problem& p : lowp_shapes())
    for (const any_mask& mask : lowp_masks()) {
      check_mixed<bf16>(policy::cpu<>{2}, p, mask, layout::bhsd);
      check_mixed<f16>(policy::cpu_scalar{1}, p, mask, layout::bshd);
      check_mixed<bf16>(policy::cpu_auto{1}, p, mask, layout::padded);
      if (has_bf16()) check_mixed<f16>(policy::cpu_avx512bf16{3}, p, mask, layout::bhsd);
    }
}

TEST_CASE("lowp: mixed storage validates like attend and writes nothing on bad input", "[lowp]") {
  const problem p{1, 2, 1, 16, 16, 8};
  std::vector<float> q(static_cast<std::size_t>(2 * 16 * 8), 0.5f), o(q.size(), 7.0f);
  std::vector<bf16> k(static_cast<std::size_t>(16 * 8), bf16(0.25f)), v(k.size(), bf16(1.0f));
  const std::vector<float> before = o;
  const auto qv = bhsd<const float>(q.data(), p.q_dims());
  const auto kv = bhsd<const bf16>(k.data(), p.kv_dims());
  auto ov = bhsd(o.data(), p.o_dims());
  dims4 wrong = p.kv_dims();
  wrong.s = 15;
  status st = attend(policy::cpu<>{1}, p, qv, bhsd<const bf16>(k.data(), wrong), kv, ov, dense{});
  CHECK(st.code() == errc::invalid_argument);
  CHECK(st.what() == std::string("k.dims.s is 15 but the problem's seq implies 16"));
  CHECK(o == before);
  st = attend(policy::cpu_naive{1}, p, qv, kv, kv, ov, dense{});
  CHECK(st.code() == errc::unsupported);
  CHECK(o == before);
  REQUIRE(attend(policy::cpu<>{1}, p, qv, kv, bhsd<const bf16>(v.data(), p.kv_dims()), ov, causal{}).ok());
  for (float x : o) CHECK(std::abs(x - 1.0f) <= 1e-6f);  // every value row is 1
}

TEST_CASE("lowp: cpu::best picks the best kernel set of this CPU, names it in the plan and matches float64",
          "[lowp]") {
  const problem p{1, 4, 2, 129, 257, 64};
  std::mt19937_64 rng(fresh_seed());
  attention_case<bf16> c(p, layout::bhsd, rng);
  const kernel_plan pl = plan(policy::cpu_auto{2}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, causal{});
  REQUIRE(pl.st.ok());
#if FUSEDATTN_X86_KERNELS
  const bool dot = has_bf16() && cpu::x86::bf16_dot_pays();
#else
  const bool dot = false;
#endif
  const std::string want = cpu::amx::available() ? "cpu.flash<amx>"
                           : dot                    ? "cpu.flash<avx512bf16>"
                           : has_avx512()           ? "cpu.flash<avx512>"
                                                    : "";
  INFO("plan: " << to_string(pl));
  if (!want.empty()) CHECK(pl.kernel == want);
  CHECK(pl.kernel.find("best") == std::string::npos);
  CHECK(pl.scratch_bytes > 0);
  for (const any_mask& mask : lowp_masks()) {
    check_same_type<bf16>(policy::cpu_auto{2}, p, mask, layout::bhsd, -1, 1);
    check_same_type<float>(policy::cpu_auto{1}, p, mask, layout::bshd, -1, 1);
    check_same_type<double>(policy::cpu_auto{1}, p, mask, layout::bhsd, -1, 1);
  }
}

TEST_CASE("lowp: a tag the CPU lacks is refused with a status, nothing written", "[lowp]") {
  if (has_bf16()) {
    WARN("skipped: this CPU has AVX512-BF16, so no tag is missing");
    return;
  }
  const problem p{1, 1, 1, 8, 8, 8};
  std::mt19937_64 rng(fresh_seed());
  attention_case<bf16> c(p, layout::bhsd, rng);
  const std::vector<bf16> before = c.o.buf;
  const status st = attend(policy::cpu_avx512bf16{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, dense{});
  CHECK(st.code() == errc::unsupported);
  CHECK(unchanged(c.o.buf, before));
}

TEST_CASE("lowp: bf16 key pairs never let a key outside a tile reach a row (odd block-sparse blocks, NaN values)",
          "[lowp]") {
  if (!has_bf16()) {
    WARN("skipped: this CPU has no AVX512-BF16 (cpu::avx512bf16 is not available)");
    return;
  }
  // kv blocks of 3 keys; a layout puts an odd-ended tile before a NaN key about 1 in 4.
  check_unseen_keys_stay_out(policy::cpu_avx512bf16{2}, 24,
                             [](int) { return sparse_shape{problem{1, 2, 1, 24, 40, 16}, 3}; });
}
