// fusedattn's AMX kernel set (policy::cpu_amx: Q·Kᵀ and P·V on TDPBF16PS tiles) against the float64 oracle, for
// bf16 storage and for f32 Q/O with bf16 K/V. The accuracy rule: max error <= 2 x the error of a plain
// implementation that takes the same bf16 inputs, accumulates in f32 and rounds its output to bf16 (with f32 Q the
// kernel rounds Q and P to bf16, so it is held to the bf16-storage rule). Built twice: natively (test_amx: skips
// with a message where the CPU or the OS offers no AMX) and as test_amx_emulated (FUSEDATTN_AMX_EMULATE: the tile
// instructions in scalar code, so the AMX layouts and tails are checked on any CPU with AVX512-BF16).
#include <cmath>
#include <string>

#include "support/check.hpp"
#include "support/lowp_check.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;

namespace {

using bf16 = Eigen::bfloat16;
using f16 = Eigen::half;

/// lse slack for P rounded to bf16 inside the kernel (relative 2^-9 per term, far below this).
constexpr double lse_floor = 1.0 / 256.0;

/// Shapes with every tail of the AMX kernels: head_dim with ceil(d/2) below, at and past multiples of 16 (the
/// slots tiles take; the rest on vdpbf16ps), key tiles not multiples of 32, q rows not multiples of 16, GQA, MQA,
/// seq_q != seq_kv both ways, one row, one key.
std::vector<problem> amx_shapes() {
  return {{1, 1, 1, 1, 1, 2},        {1, 1, 1, 7, 9, 3},       {2, 4, 2, 127, 129, 64}, {1, 2, 1, 300, 257, 80},
          {1, 8, 2, 65, 513, 128},   {1, 2, 2, 100, 31, 96},   {1, 4, 1, 33, 65, 65},   {1, 1, 1, 1, 300, 256},
          {1, 3, 3, 64, 64, 17},     {1, 2, 1, 48, 96, 32},    {1, 2, 2, 17, 40, 33}};
}

std::vector<any_mask> amx_masks() {
  return {dense{}, causal{align::top_left}, causal{align::bottom_right}, window{5, 3, align::top_left},
          window{33, 0, align::bottom_right}};
}

bool has_amx() { return cpu::amx::available(); }

const char* why_no_amx() {
#if defined(FUSEDATTN_AMX_EMULATE)
  return "skipped: the emulated AMX kernels need AVX512-BF16, which this CPU lacks";
#else
  return "skipped: no AMX here (CPUID lacks AMX-TILE, AMX-BF16 or AVX512-BF16, or the OS refused the tile permission)";
#endif
}

/// bf16 Q, K, V, O on cpu_amx against float64 (O and lse), the 2x-plain rule.
void check_bf16(int threads, const problem& p, const any_mask& mask, layout l, double lo, double hi) {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed, describe(p), describe(mask), layout_name(l), threads, lo, hi);
  std::mt19937_64 rng(seed);
  attention_case<bf16> c(p, l, rng);
  c.q.fill(rng, lo, hi);
  c.k.fill(rng, lo, hi);
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
  const status st = attend(policy::cpu_amx{threads}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask,
                           lse.data());
  REQUIRE(st.ok());
  const band_mask bound = bind_band(mask, p);
  const reference exact = reference_attention<double>(p, c.q.cview(), c.k.cview(), c.v.cview(), bound);
  const reference plain = reference_attention<float>(p, c.q.cview(), c.k.cview(), c.v.cview(), bound);
  check_lowp_rule(c.o.view, lse, exact, plain, lse_floor,
                  bf16_plain_error(p, c.q.cview(), c.k.cview(), c.v.cview(), bound, plain, exact));
}

/// f32 Q and O with K and V of type TKV on cpu_amx. bf16 K/V run on the tiles (Q rounded to bf16): held to the
/// bf16-storage rule on the rounded Q; f16 K/V, and decode-shaped calls (the decode kernel, K and V widened to
/// f32), run in f32: held to the f32 rule of mixed storage.
template <class TKV>
void check_mixed(int threads, const problem& p, const any_mask& mask, layout l) {
  const bool tiles = std::is_same<TKV, bf16>::value && !kernels::use_decode_kernel<band_mask>(p, tile_sizes{});
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed, describe(p), describe(mask), layout_name(l), threads, tiles);
  std::mt19937_64 rng(seed);
  operand<float> q(p.q_dims(), l), o(p.o_dims(), l), q32(p.q_dims(), layout::bhsd), k32(p.kv_dims(), layout::bhsd),
      v32(p.kv_dims(), layout::bhsd);
  operand<TKV> k(p.kv_dims(), l), v(p.kv_dims(), l);
  operand<bf16> q16(p.q_dims(), layout::bhsd);
  q.fill(rng, -2.0, 2.0);
  k.fill(rng, -2.0, 2.0);
  v.fill(rng);
  o.fill(rng, 7.0, 9.0);
  convert(k, k32);
  convert(v, v32);
  if (tiles) {
    convert(q, q16);
    convert(q16, q32);  // Q as the tiles see it
  } else {
    convert(q, q32);
  }
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
  const status st = attend(policy::cpu_amx{threads}, p, q.cview(), k.cview(), v.cview(), o.view, mask, lse.data());
  REQUIRE(st.ok());
  const band_mask bound = bind_band(mask, p);
  const reference exact = reference_attention<double>(p, q32.cview(), k32.cview(), v32.cview(), bound);
  const reference plain = reference_attention<float>(p, q32.cview(), k32.cview(), v32.cview(), bound);
  const double err = max_abs_error(o.view, exact.o);
  const double plain_err =
      tiles ? bf16_plain_error(p, q32.cview(), k32.cview(), v32.cview(), bound, plain, exact)
            : plain_error<float>(plain, exact);
  INFO("max error " << err << ", plain " << plain_err);
  CHECK(err <= 2.0 * plain_err + 8.0 * epsilon<float>());
  const double lse_err = max_lse_error(lse, exact.lse), plain_lse = plain_lse_error(plain, exact);
  INFO("lse error " << lse_err << ", plain " << plain_lse);
  CHECK(lse_err <= 2.0 * plain_lse + (tiles ? lse_floor : 64.0 * epsilon<float>()));
}

}  // namespace

TEST_CASE("amx: CPUID, the OS permission and the policy's answer agree", "[amx]") {
  const cpu::x86_features& f = cpu::x86_cpu();
  INFO("avx512bf16 " << f.avx512bf16 << " amx_bf16 " << f.amx_bf16);
  CHECK((!f.amx_bf16 || f.avx512bf16));
  if (f.amx_bf16) {
    const status& first = cpu::amx_permission();
    INFO("permission: " << (first.ok() ? std::string("granted") : std::string(first.what())));
    CHECK(&first == &cpu::amx_permission());  // asked once per process
    if (!first.ok()) CHECK(first.code() == errc::unsupported);
  }
  const problem p{1, 2, 1, 16, 16, 32};
  std::mt19937_64 rng(fresh_seed());
  attention_case<bf16> c(p, layout::bhsd, rng);
  const std::vector<bf16> before = c.o.buf;
  const status st = attend(policy::cpu_amx{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, causal{});
  if (has_amx()) {
    CHECK(st.ok());
    const kernel_plan pl = plan(policy::cpu_amx{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, causal{});
    CHECK(pl.kernel == "cpu.flash<amx>");
  } else {
    INFO("status: " << st.what());
    CHECK(st.code() == errc::unsupported);
    CHECK(std::string(st.what()).find(f.amx_bf16 ? "arch_prctl" : "amx") != std::string::npos);
    CHECK(unchanged(c.o.buf, before));
  }
}

TEST_CASE("amx: bf16 storage on AMX tiles against float64, error <= 2x a plain f32-accumulating implementation",
          "[amx]") {
  if (!has_amx()) {
    WARN(why_no_amx());
    return;
  }
  for (const problem& p : amx_shapes())
    for (const any_mask& mask : amx_masks())
      for (int threads : {1, 3}) check_bf16(threads, p, mask, layout::bhsd, -1, 1);
  // Larger logits (a peaked softmax), strided layouts, explicit tiles that cut keys off 32-key groups.
  const problem p{1, 4, 2, 200, 333, 64};
  check_bf16(2, p, causal{align::bottom_right}, layout::bshd, -3, 3);
  check_bf16(2, p, dense{}, layout::padded, -4, 4);
}

TEST_CASE("amx: f32 Q and O with bf16 K and V on the tiles, f16 K and V on the f32 kernels, against float64",
          "[amx]") {
  if (!has_amx()) {
    WARN(why_no_amx());
    return;
  }
  for (const problem& p : amx_shapes())
    for (const any_mask& mask : amx_masks()) {
      check_mixed<bf16>(2, p, mask, layout::bhsd);
      check_mixed<f16>(1, p, mask, layout::bshd);
    }
}

TEST_CASE("amx: f32 storage under cpu_amx runs the AVX-512 f32 kernels, exact to the f32 rule", "[amx]") {
  if (!has_amx()) {
    WARN(why_no_amx());
    return;
  }
  const problem p{1, 4, 2, 129, 257, 80};
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
  REQUIRE(attend(policy::cpu_amx{2}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, causal{}, lse.data()).ok());
  const band_mask bound = bind_band(causal{}, p);
  const reference exact = reference_attention<double>(p, c.q.cview(), c.k.cview(), c.v.cview(), bound);
  const reference plain = reference_attention<float>(p, c.q.cview(), c.k.cview(), c.v.cview(), bound);
  const double err = max_abs_error(c.o.view, exact.o), plain_err = plain_error<float>(plain, exact);
  INFO("max error " << err << ", plain " << plain_err);
  CHECK(err <= 2.0 * plain_err + 8.0 * epsilon<float>());
}

TEST_CASE("amx: key pairs never let a key outside a tile reach a row (odd block-sparse blocks, NaN values)",
          "[amx]") {
  if (!has_amx()) {
    WARN(why_no_amx());
    return;
  }
  // kv blocks of 3 and 35 keys: a tile of an odd key count pairs its last key with the next one, and one of 35 keys
  // puts 3 keys past its 32 on tiles.
  check_unseen_keys_stay_out(policy::cpu_amx{2}, 24, [](int round) {
    return round % 2 ? sparse_shape{problem{1, 2, 1, 40, 40, 32}, 3} : sparse_shape{problem{1, 2, 1, 40, 175, 32}, 35};
  });
}

TEST_CASE("amx: softcap, ALiBi and sinks on the AMX set against float64", "[amx]") {
  if (!has_amx()) {
    WARN(why_no_amx());
    return;
  }
  // The modifiers act on the f32 scores between the two tile products (the tile loop's modify_row), so the AMX set
  // takes them as every CPU kernel set does; checked with the 2x-plain rule of bf16 storage.
  for (const problem& p : {problem{1, 4, 2, 130, 129, 64}, problem{1, 2, 2, 33, 200, 80}})
    for (const causal base : {causal{align::top_left}, causal{align::bottom_right}})
      check_bf16_modifiers(policy::cpu_amx{2}, p, base, 1.5f, {0.01f, 0.05f}, {-2.0f, 3.0f}, lse_floor);
}

TEST_CASE("amx: cpu::best takes the AMX set for bf16 storage where the CPU has it", "[amx]") {
  const problem p{1, 2, 1, 40, 70, 64};
  std::mt19937_64 rng(fresh_seed());
  attention_case<bf16> c(p, layout::bhsd, rng);
  const kernel_plan pl = plan(policy::cpu_auto{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, dense{});
  REQUIRE(pl.st.ok());
  INFO("plan: " << to_string(pl));
#if defined(FUSEDATTN_AMX_EMULATE)
  CHECK(pl.kernel != "cpu.flash<amx>");  // emulated tiles are for tests only, never picked
#else
  if (has_amx()) CHECK(pl.kernel == "cpu.flash<amx>");
  else CHECK(pl.kernel != "cpu.flash<amx>");
#endif
}
