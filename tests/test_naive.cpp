// The naive three-pass kernel against the float64 oracle: every scalar type × mask × layout on the tail shapes.
#include "support/check.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;

// FUSEDATTN_TEST_SUBSET (CI's sanitizer stage) keeps float and a 16-bit type.
#if FUSEDATTN_TEST_SUBSET
#define NAIVE_ORACLE_TYPES float, Eigen::half
#else
#define NAIVE_ORACLE_TYPES float, double, Eigen::half, Eigen::bfloat16
#endif

TEMPLATE_TEST_CASE("naive matches the float64 oracle", "[naive]", NAIVE_ORACLE_TYPES) {
  const auto shapes = tail_shapes();
  const auto masks = all_masks();
  const layout layouts[] = {layout::bhsd, layout::bshd, layout::padded};
  const std::size_t shape_index = GENERATE(range<std::size_t>(0, 10));
  REQUIRE(shape_index < shapes.size());
  for (std::size_t m = 0; m < masks.size(); ++m)
    check_against_oracle<TestType>(policy::cpu_naive{1}, shapes[shape_index], layouts[(shape_index + m) % 3],
                                   masks[m]);
}

TEST_CASE("naive: thread count does not change the result", "[naive]") {
  const problem p{2, 3, 3, 65, 70, 24};
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  operand<float> o2(p.o_dims(), layout::bhsd);
  REQUIRE(attend(policy::cpu_naive{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, causal{}).ok());
  REQUIRE(attend(policy::cpu_naive{2}, p, c.q.cview(), c.k.cview(), c.v.cview(), o2.view, causal{}).ok());
  CHECK(c.o.buf == o2.buf);
}

TEST_CASE("naive: a single key gives back its value row", "[naive]") {
  const problem p{1, 2, 2, 5, 1, 8};
  std::mt19937_64 rng(fresh_seed());
  attention_case<double> c(p, layout::bhsd, rng);
  REQUIRE(attend(policy::cpu_naive{1}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view).ok());
  for (index_t h = 0; h < 2; ++h)
    for (index_t i = 0; i < 5; ++i)
      for (index_t d = 0; d < 8; ++d) CHECK(c.o.view.row(0, h, i)[d] == Approx(c.v.view.row(0, h, 0)[d]).epsilon(1e-14));
}
