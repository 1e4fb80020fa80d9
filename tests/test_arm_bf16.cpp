// The Arm bf16 kernel set (cpu::neon_bf16, policy::cpu_neon_bf16: Q·Kᵀ and P·V on BFDOT, P rounded to bf16)
// against the float64 oracle with the low-precision rule (support/lowp_check.hpp: error <= 2x the worst plain
// f32-accumulating implementation on the same bf16 inputs, with P in f32 or rounded to bf16). Built for AArch64
// with FEAT_BF16 in the target (tests/CMakeLists.txt adds -march=armv8.6-a for this program) and run under
// qemu-aarch64 -cpu max in CI, and its [arm_bf16_absent] case once more under -cpu neoverse-n1 (no BF16); elsewhere
// its one case says why it skips.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "support/check.hpp"
#include "support/lowp_check.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;

#if FUSEDATTN_ARM_BF16_KERNELS

namespace {

using bf16 = Eigen::bfloat16;

/// The lse slack: lse is f32 in every kernel; a plain f32 error can be 0 by luck.
constexpr double lse_floor = 64.0 * 1.1920928955078125e-07;

/// Tails in every dimension (odd head_dim, seq not a multiple of the 16-key panels or the tiles, head_dim not a
/// multiple of the 8-column chunks), GQA, MQA, seq_q != seq_kv both ways, one key. Small: the oracle runs emulated.
std::vector<problem> arm_shapes() {
  return {{1, 1, 1, 2, 1, 2},    {1, 1, 1, 7, 9, 3},    {2, 4, 2, 37, 41, 64}, {1, 2, 1, 70, 45, 33},
          {1, 4, 1, 21, 35, 65}, {1, 3, 3, 30, 30, 17}, {1, 2, 1, 5, 80, 12}};
}

std::vector<any_mask> band_masks() {
  return {dense{}, causal{align::top_left}, causal{align::bottom_right}, window{5, 3, align::top_left},
          window{9, 0, align::bottom_right}};
}

/// The exact and plain references of a call and the rule's check on its O and lse.
template <class Bound>
void check_call(const problem& p, attention_case<bf16>& c, const Bound& bound, const std::vector<float>& lse) {
  const reference exact = reference_attention<double>(p, c.q.cview(), c.k.cview(), c.v.cview(), bound);
  const reference plain = reference_attention<float>(p, c.q.cview(), c.k.cview(), c.v.cview(), bound);
  check_lowp_rule(c.o.view, lse, exact, plain, lse_floor,
                  bf16_plain_error(p, c.q.cview(), c.k.cview(), c.v.cview(), bound, plain, exact));
}

/// Runs `pol` on fresh random bf16 inputs (Q and K in [lo, hi]) under a band mask and checks O and lse.
void check_band(const policy::cpu_neon_bf16& pol, const problem& p, const any_mask& mask, layout l, double lo,
                double hi) {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed, describe(p), describe(mask), layout_name(l), pol.threads, pol.tiles.q, pol.tiles.kv, lo, hi);
  std::mt19937_64 rng(seed);
  attention_case<bf16> c(p, l, rng);
  c.q.fill(rng, lo, hi);
  c.k.fill(rng, lo, hi);
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
  REQUIRE(attend(pol, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse.data()).ok());
  check_call(p, c, bind_band(mask, p), lse);
}

}  // namespace

TEST_CASE("arm bf16: the CPU reports FEAT_BF16 and the plan names the Arm bf16 set", "[arm_bf16]") {
  INFO("compiled for " << cpu::compiled_arch::name() << "; HWCAP2_BF16 " << cpu::arm_cpu_has_bf16());
  REQUIRE(cpu::neon_bf16::supported());
  REQUIRE(cpu::arch_available<cpu::neon_bf16>());  // qemu-aarch64 -cpu max implements FEAT_BF16
  const problem p{1, 2, 1, 40, 50, 24};
  std::mt19937_64 rng(fresh_seed());
  attention_case<bf16> c(p, layout::bhsd, rng);
  const kernel_plan pl = plan(policy::cpu_neon_bf16{2}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, causal{});
  INFO("plan: " << to_string(pl));
  REQUIRE(pl.st.ok());
  CHECK(pl.kernel == "cpu.flash<neon_bf16>");
  CHECK(pl.scratch_bytes > 0);
}

TEST_CASE("arm bf16: bf16 storage on BFDOT against float64, error <= 2x a plain f32-accumulating implementation",
          "[arm_bf16]") {
  for (const problem& p : arm_shapes())
    for (const any_mask& mask : band_masks())
      for (int threads : {1, 3}) check_band(policy::cpu_neon_bf16{threads}, p, mask, layout::bhsd, -1, 1);
  // Larger logits (a peaked softmax), strided layouts, small tiles (kv tiles that start at odd keys and end
  // inside a panel, so P and the V pairs start mid-panel).
  const problem p{1, 4, 2, 50, 77, 40};
  check_band(policy::cpu_neon_bf16{2}, p, causal{align::bottom_right}, layout::bshd, -3, 3);
  check_band(policy::cpu_neon_bf16{2}, p, dense{}, layout::padded, -4, 4);
  for (const any_mask& mask : band_masks())
    check_band(policy::cpu_neon_bf16{3, tile_sizes{7, 11, 0}}, p, mask, layout::bhsd, -2, 2);
}

TEST_CASE("arm bf16: block-sparse masks on BFDOT against float64", "[arm_bf16]") {
  for (int threads : {1, 3})
    for (const problem& p : {problem{1, 2, 1, 24, 40, 16}, problem{2, 4, 2, 33, 47, 19}}) {
      const std::uint64_t seed = fresh_seed();
      CAPTURE(seed, describe(p), threads);
      std::mt19937_64 rng(seed);
      const block_layout blocks = random_layout(block_geometry{p.seq_q, p.seq_kv, 4, 3}, 0.6, seed);
      const block_sparse mask{blocks};
      attention_case<bf16> c(p, layout::bhsd, rng);
      std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
      REQUIRE(attend(policy::cpu_neon_bf16{threads}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask,
                     lse.data())
                  .ok());
      check_call(p, c, bind(mask, p), lse);
    }
}

TEST_CASE("arm bf16: bf16 key pairs never let a key outside a tile reach a row (odd block-sparse blocks, NaN values)",
          "[arm_bf16]") {
  // kv blocks of 3 keys; 12 rounds, of which at least one must hold a NaN key.
  const int poisoned_rounds = check_unseen_keys_stay_out(
      policy::cpu_neon_bf16{2}, 12, [](int) { return sparse_shape{problem{1, 2, 1, 24, 40, 16}, 3}; });
  INFO("rounds with a NaN key " << poisoned_rounds);
  CHECK(poisoned_rounds > 0);
}

TEST_CASE("arm bf16: softcap, ALiBi and sinks on BFDOT against float64", "[arm_bf16]") {
  // The modifiers act on the f32 scores between the two dot products (the tile loop's modify_row).
  for (const problem& p : {problem{1, 4, 2, 45, 43, 32}, problem{1, 2, 2, 9, 70, 19}})
    for (const window base : {window{12, 4, align::top_left}, window{20, 0, align::bottom_right}})
      check_bf16_modifiers(policy::cpu_neon_bf16{3}, p, base, 2.0f, {0.02f, 0.2f}, {-1.0f, 2.0f}, lse_floor);
}

TEST_CASE("arm bf16: other storage types under cpu_neon_bf16 run the NEON kernels and match float64",
          "[arm_bf16]") {
  const problem p{1, 4, 2, 29, 37, 21};
  for (const any_mask& mask : band_masks()) {
    const std::uint64_t seed = fresh_seed();
    CAPTURE(seed, describe(mask));
    std::mt19937_64 rng(seed);
    attention_case<float> c(p, layout::bhsd, rng);
    std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
    REQUIRE(attend(policy::cpu_neon_bf16{2}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse.data())
                .ok());
    const band_mask bound = bind_band(mask, p);
    const reference exact = reference_attention<double>(p, c.q.cview(), c.k.cview(), c.v.cview(), bound);
    const reference plain = reference_attention<float>(p, c.q.cview(), c.k.cview(), c.v.cview(), bound);
    check_lowp_rule(c.o.view, lse, exact, plain, lse_floor);
  }
}

TEST_CASE("arm bf16: cpu::best (policy::cpu_auto) takes the Arm bf16 set where the CPU has FEAT_BF16", "[arm_bf16]") {
  const problem p{1, 4, 2, 33, 52, 40};
  std::mt19937_64 rng(fresh_seed());
  attention_case<bf16> c(p, layout::bhsd, rng);
  const kernel_plan pl = plan(policy::cpu_auto{2}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, dense{});
  INFO("plan: " << to_string(pl));
  REQUIRE(pl.st.ok());
  CHECK(pl.kernel == "cpu.flash<neon_bf16>");
  for (const any_mask& mask : band_masks()) {
    const std::uint64_t seed = fresh_seed();
    CAPTURE(seed, describe(mask));
    std::mt19937_64 r(seed);
    attention_case<bf16> b(p, layout::bshd, r);
    std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
    REQUIRE(attend(policy::cpu_auto{3}, p, b.q.cview(), b.k.cview(), b.v.cview(), b.o.view, mask, lse.data()).ok());
    check_call(p, b, bind_band(mask, p), lse);
  }
}

TEST_CASE("arm bf16: on a CPU without FEAT_BF16 cpu_neon_bf16 is refused, nothing written, and cpu_auto runs NEON",
          "[arm_bf16_absent]") {
  // CI runs this case under qemu-aarch64 -cpu neoverse-n1 (Armv8.2, no BF16): the binary targets FEAT_BF16, and the
  // run-time check (HWCAP2_BF16) keeps the BFDOT code from running there.
  if (cpu::neon_bf16::available()) {
    WARN("skipped: this CPU has FEAT_BF16 (run under qemu-aarch64 -cpu neoverse-n1 to check the refusal)");
    return;
  }
  CHECK_FALSE(cpu::arm_cpu_has_bf16());
  const problem p{1, 2, 1, 19, 23, 13};
  std::mt19937_64 rng(fresh_seed());
  attention_case<bf16> c(p, layout::bhsd, rng);
  const std::vector<bf16> before = c.o.buf;
  const status st = attend(policy::cpu_neon_bf16{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, causal{});
  CHECK(st.code() == errc::unsupported);
  CHECK(std::string(st.what()).find("neon_bf16") != std::string::npos);
  CHECK(unchanged(c.o.buf, before));
  const kernel_plan pl = plan(policy::cpu_auto{2}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, causal{});
  INFO("plan: " << to_string(pl));
  REQUIRE(pl.st.ok());
  CHECK(pl.kernel == std::string("cpu.flash<") + cpu::compiled_arch::name() + ">");
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
  REQUIRE(attend(policy::cpu_auto{2}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, causal{}, lse.data()).ok());
  check_call(p, c, bind_band(causal{}, p), lse);
}

TEST_CASE("arm bf16: bad input is refused with a status naming the field, nothing written", "[arm_bf16]") {
  const problem p{1, 2, 1, 16, 16, 8};
  std::mt19937_64 rng(fresh_seed());
  attention_case<bf16> c(p, layout::bhsd, rng);
  const std::vector<bf16> before = c.o.buf;
  const status st =
      attend(policy::cpu_neon_bf16{0}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, causal{});
  CHECK(st.code() == errc::invalid_argument);
  CHECK(std::string(st.what()).find("policy.threads is 0") != std::string::npos);
  CHECK(unchanged(c.o.buf, before));
}

#else

TEST_CASE("arm bf16: the Arm bf16 kernel set", "[arm_bf16]") {
  WARN("skipped: this build has no Arm bf16 kernels (they need AArch64 with FEAT_BF16 in the target, e.g. "
       "-march=armv8.6-a); policy::cpu_neon_bf16 returns unsupported here");
  const problem p{1, 1, 1, 4, 4, 4};
  std::mt19937_64 rng(fresh_seed());
  attention_case<Eigen::bfloat16> c(p, layout::bhsd, rng);
  const std::vector<Eigen::bfloat16> before = c.o.buf;
  const status st = attend(policy::cpu_neon_bf16{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, dense{});
  CHECK(st.code() == errc::unsupported);
  CHECK(unchanged(c.o.buf, before));
}

#endif
