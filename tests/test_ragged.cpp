// attend_ragged: sequences packed end to end give bitwise the result of one attend call per sequence (each with
// its own lengths and causal alignment), prefill and decode, GQA 1/4/8, f32/f16/bf16; the float64 oracle agrees;
// bad offsets are refused with nothing written.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <variant>
#include <vector>

#include <catch2/catch.hpp>

#include <fusedattn/dispatch/serving.hpp>

#include "support/check.hpp"
#include "support/data.hpp"
#include "support/oracle.hpp"
#include "support/ragged.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;

namespace {

using band_choice = std::variant<dense, causal, window>;

/// Packed [token][head][d] Q, K, V, O of a ragged batch with the given per-sequence lengths.
template <class T>
struct ragged_case : ragged_offsets {
  std::vector<T> q, k, v, o;
  std::vector<float> lse;

  ragged_case(index_t heads, index_t heads_kv, index_t d, const std::vector<std::int32_t>& len_q,
              const std::vector<std::int32_t>& len_kv, std::mt19937_64& rng)
      : ragged_offsets(heads, heads_kv, d, len_q, len_kv) {
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    auto fill = [&](std::vector<T>& x, index_t n) {
      x.resize(static_cast<std::size_t>(n));
      for (auto& e : x) e = static_cast<T>(u(rng));
    };
    fill(q, p.seq_q * heads * d);
    fill(k, p.seq_kv * heads_kv * d);
    fill(v, p.seq_kv * heads_kv * d);
    o.assign(q.size(), T(7.0f));
    lse.assign(static_cast<std::size_t>(p.lse_size()), 123.0f);
  }
  tensor_ref<const T> qv() const { return bshd<const T>(q.data(), p.q_dims()); }
  tensor_ref<const T> kv() const { return bshd<const T>(k.data(), p.kv_dims()); }
  tensor_ref<const T> vv() const { return bshd<const T>(v.data(), p.kv_dims()); }
  tensor_ref<T> ov() { return bshd(o.data(), p.o_dims()); }
};

/// Runs attend_ragged, then compares every sequence with its own attend call (bitwise) and the oracle.
template <class T, class Policy, class Mask>
void check_ragged(ragged_case<T>& c, const Policy& pol, const Mask& mask) {
  const status st = attend_ragged(pol, c.p, c.batch(), c.qv(), c.kv(), c.vv(), c.ov(), mask, c.lse.data());
  INFO(st.what());
  REQUIRE(st.ok());
  const problem& p = c.p;
  for (index_t b = 0; b + 1 < static_cast<index_t>(c.cu_q.size()); ++b) {
    const index_t q0 = c.cu_q[static_cast<std::size_t>(b)], nq = c.cu_q[static_cast<std::size_t>(b) + 1] - q0;
    const index_t k0 = c.cu_kv[static_cast<std::size_t>(b)], nk = c.cu_kv[static_cast<std::size_t>(b) + 1] - k0;
    INFO("sequence " << b << ": " << nq << " queries, " << nk << " keys");
    if (nq == 0) continue;
    const problem pb{1, p.heads, p.heads_kv, nq, std::max<index_t>(nk, 1), p.head_dim};
    // The sequence's rows of the ragged output, and of lse ([h][token]).
    std::vector<T> got(static_cast<std::size_t>(nq * p.heads * p.head_dim));
    std::memcpy(got.data(), c.o.data() + q0 * p.heads * p.head_dim, got.size() * sizeof(T));
    std::vector<float> got_lse(static_cast<std::size_t>(p.heads * nq));
    for (index_t h = 0; h < p.heads; ++h)
      for (index_t i = 0; i < nq; ++i) got_lse[static_cast<std::size_t>(h * nq + i)] = c.lse[static_cast<std::size_t>(h * p.seq_q + q0 + i)];
    if (nk == 0) {
      CHECK(std::all_of(got.begin(), got.end(), [](const T& x) { return static_cast<float>(x) == 0.0f; }));
      CHECK(std::all_of(got_lse.begin(), got_lse.end(),
                        [](float x) { return x == -std::numeric_limits<float>::infinity(); }));
      continue;
    }
    const tensor_ref<const T> qb = bshd<const T>(c.q.data() + q0 * p.heads * p.head_dim, pb.q_dims());
    const tensor_ref<const T> kb = bshd<const T>(c.k.data() + k0 * p.heads_kv * p.head_dim, pb.kv_dims());
    const tensor_ref<const T> vb = bshd<const T>(c.v.data() + k0 * p.heads_kv * p.head_dim, pb.kv_dims());
    std::vector<T> one(got.size(), T(5.0f));
    std::vector<float> one_lse(got_lse.size());
    REQUIRE(attend(pol, pb, qb, kb, vb, bshd(one.data(), pb.o_dims()), mask, one_lse.data()).ok());
    CHECK(std::memcmp(one.data(), got.data(), got.size() * sizeof(T)) == 0);
    CHECK(one_lse == got_lse);
    // Against the float64 oracle, the mask bound to this sequence's own lengths.
    const band_mask bound = bind(mask, pb);
    const reference ref = reference_attention<double>(pb, qb, kb, vb, bound);
    const reference plain = reference_attention<accum_t<T>>(pb, qb, kb, vb, bound);
    double err = 0, plain_err = 0;
    const tensor_ref<const T> gv = bshd<const T>(got.data(), pb.o_dims());
    for (index_t h = 0; h < p.heads; ++h)
      for (index_t i = 0; i < nq; ++i)
        for (index_t x = 0; x < p.head_dim; ++x) {
          const std::size_t at = static_cast<std::size_t>((h * nq + i) * p.head_dim + x);
          const double g = static_cast<double>(gv.row(0, h, i)[x]);
          err = std::max(err, std::isnan(g) ? std::numeric_limits<double>::infinity() : std::abs(g - ref.o[at]));
          plain_err = std::max(plain_err, std::abs(static_cast<double>(static_cast<T>(plain.o[at])) - ref.o[at]));
        }
    INFO("error " << err << " plain " << plain_err);
    CHECK(err <= output_tolerance<T>(plain_err));
    CHECK(max_lse_error(got_lse, ref.lse) <= 1e-4);
  }
}

const band_choice masks[] = {dense{}, causal{align::top_left}, causal{align::bottom_right},
                             window{9, 2, align::bottom_right}};

// FUSEDATTN_TEST_SUBSET (CI's sanitizer stage) keeps float and one 16-bit type.
#if FUSEDATTN_TEST_SUBSET
#define RAGGED_TYPES float, Eigen::half
#else
#define RAGGED_TYPES float, Eigen::half, Eigen::bfloat16
#endif

}  // namespace

TEMPLATE_TEST_CASE("ragged: prefill equals one call per sequence bitwise, and the oracle", "[ragged]", RAGGED_TYPES) {
  using T = TestType;
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  // Lengths off every tile multiple; s_q > s_kv, s_q < s_kv, an empty query block, an empty key block.
  const std::vector<std::int32_t> len_q = {5, 0, 70, 1, 130, 9}, len_kv = {9, 4, 70, 300, 33, 0};
  const index_t heads[][2] = {{4, 4}, {8, 2}, {8, 1}};
  for (const auto& h : heads)
    for (const band_choice& mask : masks) {
      INFO("heads " << h[0] << "/" << h[1] << " " << std::visit([](const auto& m) { return mask_name(m); }, mask));
      ragged_case<T> c(h[0], h[1], 40, len_q, len_kv, rng);
      std::visit([&](const auto& m) { check_ragged(c, policy::cpu<>{2}, m); }, mask);
    }
}

TEMPLATE_TEST_CASE("ragged: decode (one query per sequence) equals one call per sequence bitwise", "[ragged]",
                   RAGGED_TYPES) {
  using T = TestType;
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const index_t heads[][2] = {{4, 4}, {8, 2}, {8, 1}};
  for (const auto& h : heads)
    for (const band_choice& mask : masks) {
      // One query (and then two: speculative decode) per sequence; keys off every multiple, one split in chunks.
      for (std::int32_t n : {1, 2}) {
        ragged_case<T> c(h[0], h[1], 128, {n, n, n, n}, {1, 1700, 65, 0}, rng);
        std::visit([&](const auto& m) { check_ragged(c, policy::cpu<>{3}, m); }, mask);
      }
    }
}

TEST_CASE("ragged: the naive policy and the scalar arch agree", "[ragged]") {
  std::mt19937_64 rng(fresh_seed());
  ragged_case<double> c(4, 2, 24, {3, 17, 1}, {40, 17, 5}, rng);
  check_ragged(c, policy::cpu_naive{2}, causal{align::bottom_right});
  check_ragged(c, policy::cpu_scalar{1}, causal{align::bottom_right});
}

TEST_CASE("ragged: bad offsets are refused by name, nothing written", "[ragged]") {
  std::mt19937_64 rng(fresh_seed());
  ragged_case<float> c(2, 1, 16, {3, 4}, {5, 6}, rng);
  const std::vector<float> o0 = c.o, lse0 = c.lse;
  const auto refused = [&](std::vector<std::int32_t> cu_q, std::vector<std::int32_t> cu_kv, const std::string& what) {
    const ragged_batch rb{static_cast<index_t>(cu_q.size()) - 1, cu_q.data(), cu_kv.data()};
    const status st = attend_ragged(policy::cpu<>{2}, c.p, rb, c.qv(), c.kv(), c.vv(), c.ov(), dense{}, c.lse.data());
    INFO(st.what());
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find(what) != std::string::npos);
    CHECK(c.o == o0);
    CHECK(c.lse == lse0);
  };
  refused({0, 5, 3, 7}, {0, 5, 8, 11}, "ragged.cu_seqlens_q[2] is 3");         // decreasing
  refused({0, 3, 7}, {0, 6, 5}, "ragged.cu_seqlens_kv[2] is 5");               // decreasing
  refused({0, 3, 6}, {0, 5, 11}, "ragged.cu_seqlens_q[2] is 6 but problem.seq_q");   // not ending at the total
  refused({0, 3, 7}, {0, 5, 12}, "ragged.cu_seqlens_kv[2] is 12 but problem.seq_kv");
  refused({1, 3, 7}, {0, 5, 11}, "ragged.cu_seqlens_q[0] is 1");               // not starting at 0
  {
    const ragged_batch rb{2, nullptr, c.cu_kv.data()};
    const status st = attend_ragged(policy::cpu<>{2}, c.p, rb, c.qv(), c.kv(), c.vv(), c.ov());
    CHECK(st.message().find("ragged.cu_seqlens_q is null") != std::string::npos);
  }
  {
    problem p2 = c.p;
    p2.batch = 2;
    const status st = attend_ragged(policy::cpu<>{2}, p2, c.batch(), c.qv(), c.kv(), c.vv(), c.ov());
    CHECK(st.message().find("problem.batch is 2") != std::string::npos);
  }
  CHECK(c.o == o0);
  const status st = attend_ragged(policy::cuda{}, c.p, c.batch(), c.qv(), c.kv(), c.vv(), c.ov());
  CHECK(st.code() == errc::unsupported);
}

TEST_CASE("ragged: host mirrors equal to the offsets give the same bits; a differing mirror is refused by name",
          "[ragged][mirror]") {
  std::mt19937_64 rng(fresh_seed());
  // Decode (one query per sequence, one decode-kernel call) and prefill (sequence by sequence), a sequence of no keys.
  for (const auto& len_q : {std::vector<std::int32_t>{1, 1, 1}, std::vector<std::int32_t>{3, 9, 1}}) {
    ragged_case<float> c(4, 2, 32, len_q, {70, 0, 13}, rng);
    INFO("queries per sequence " << len_q[0] << ", " << len_q[1] << ", " << len_q[2]);
    const auto call = [&](const ragged_batch& rb) {
      std::fill(c.o.begin(), c.o.end(), 7.0f);
      std::fill(c.lse.begin(), c.lse.end(), 123.0f);
      return attend_ragged(policy::cpu<>{2}, c.p, rb, c.qv(), c.kv(), c.vv(), c.ov(), causal{align::bottom_right},
                           c.lse.data());
    };
    REQUIRE(call(c.batch()).ok());
    const std::vector<float> o_plain = c.o, lse_plain = c.lse;
    const std::vector<std::int32_t> mq = c.cu_q, mkv = c.cu_kv;  // the mirrors: copies of the offsets
    for (const ragged_batch& rb : {c.batch().with_host_offsets(mq.data(), mkv.data()),
                                   c.batch().with_host_offsets(mq.data(), nullptr),
                                   c.batch().with_host_offsets(nullptr, mkv.data())}) {
      const status st = call(rb);
      INFO(st.what());
      REQUIRE(st.ok());
      CHECK(c.o == o_plain);
      CHECK(c.lse == lse_plain);
    }
    const auto refused = [&](const ragged_batch& rb, const std::string& field) {
      const status st = call(rb);
      INFO(st.what());
      CHECK(st.code() == errc::invalid_argument);
      CHECK(st.message().find(field) != std::string::npos);
      CHECK(std::all_of(c.o.begin(), c.o.end(), [](float x) { return x == 7.0f; }));
      CHECK(std::all_of(c.lse.begin(), c.lse.end(), [](float x) { return x == 123.0f; }));
    };
    std::vector<std::int32_t> bad_q = c.cu_q, bad_kv = c.cu_kv;
    bad_q[1] += 1;  // still valid offsets: only the comparison catches it
    refused(c.batch().with_host_offsets(bad_q.data(), nullptr),
            "ragged.host_cu_seqlens_q[1] is " + std::to_string(bad_q[1]) + " but ragged.cu_seqlens_q[1] is " +
                std::to_string(c.cu_q[1]));
    bad_kv[2] += 5;
    refused(c.batch().with_host_offsets(nullptr, bad_kv.data()),
            "ragged.host_cu_seqlens_kv[2] is " + std::to_string(bad_kv[2]) + " but ragged.cu_seqlens_kv[2] is " +
                std::to_string(c.cu_kv[2]));
  }
}
