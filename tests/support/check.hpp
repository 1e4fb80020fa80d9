/// @file check.hpp
/// Catch2 helpers shared by the kernel tests: the shapes that hit every tail, the masks, and one check that runs a
/// policy on fresh random inputs and compares O and lse with the float64 oracle (seed captured on failure).
#pragma once

#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "data.hpp"

namespace fusedattn::testing {

/// Shapes that hit every tail: seq 1, 7, 127, 128, 1000; head_dim 1, 3, 64, 80, 128, 256; seq_q != seq_kv both
/// ways; batch > 1, heads > 1, GQA and MQA.
inline std::vector<problem> tail_shapes() {
  return {
      {1, 1, 1, 1, 1, 1},         {1, 1, 1, 7, 7, 3},       {2, 3, 3, 127, 127, 64},  {1, 2, 1, 128, 128, 80},
      {1, 1, 1, 1000, 1000, 16},  {1, 2, 2, 7, 1000, 128},  {1, 1, 1, 1000, 7, 256},  {2, 4, 2, 128, 127, 32},
      {1, 4, 1, 33, 65, 64},      {1, 1, 1, 1, 300, 256},
  };
}

/// The masks every kernel must support, both alignments.
inline std::vector<any_mask> all_masks() {
  return {dense{}, causal{align::top_left}, causal{align::bottom_right}, window{5, 3, align::top_left},
          window{16, 0, align::bottom_right}};
}

inline std::string describe(const problem& p) {
  return "b=" + std::to_string(p.batch) + " h=" + std::to_string(p.heads) + " h_kv=" + std::to_string(p.heads_kv) +
         " s_q=" + std::to_string(p.seq_q) + " s_kv=" + std::to_string(p.seq_kv) + " d=" + std::to_string(p.head_dim);
}
inline std::string describe(const any_mask& m) {
  return std::visit([](const auto& x) { return std::string(mask_name(x)); }, m);
}

/// The band rule of a dense, causal or window any_mask (a block_sparse alternative fails the test: it has none).
inline band_mask bind_band(const any_mask& mask, const problem& p) {
  return std::visit(
      [&](const auto& m) -> band_mask {
        if constexpr (std::is_same_v<decltype(bind(m, p)), band_mask>) {
          return bind(m, p);
        } else {
          FAIL("bind_band: " << mask_name(m) << " is not a band mask");
          return {};
        }
      },
      mask);
}

/// Checks case `c`'s O and the lse a kernel wrote against the oracle's expectation `e`.
template <class T>
void check_outputs(const attention_case<T>& c, const expected& e, const std::vector<float>& lse) {
  const double err = max_abs_error(c.o.view, e.ref.o);
  INFO("max error " << err << " tolerance " << e.tolerance);
  CHECK(err <= e.tolerance);
  const double lse_err = max_lse_error(lse, e.ref.lse);
  INFO("lse error " << lse_err << " tolerance " << e.lse_tolerance);
  CHECK(lse_err <= e.lse_tolerance);
}

/// Runs `pol` on a fresh random case and checks O and lse against the float64 oracle.
template <class T, class Policy>
void check_against_oracle(const Policy& pol, const problem& p, layout l, const any_mask& mask) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  attention_case<T> c(p, l, rng);
  const std::string what = std::string(scalar_name<T>()) + " " + describe(p) + " " + describe(mask) + " " +
                           layout_name(l) + " seed=" + std::to_string(seed);
  INFO(what);
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()), 123.0f);
  const status st = attend(pol, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse.data());
  INFO(st.what());
  REQUIRE(st.ok());
  const expected e = std::visit([&](const auto& m) { return expect(c, bind(m, p)); }, mask);
  check_outputs(c, e, lse);
}

}  // namespace fusedattn::testing
