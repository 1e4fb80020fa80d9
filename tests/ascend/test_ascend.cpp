// policy::ascend against a recording fake of CANN: the arguments the backend gives aclnnFlashAttentionScore and
// aclnnIncreFlashAttentionV4 (layout string, shapes, strides, scale, head counts, sparse mode and token bounds,
// masks), the results end to end against the float64 oracle (the fake computes the attention it is asked for), lse
// assembled from the softmax max and sum, and the error paths (allocation, GetWorkspaceSize and launch failures,
// unsupported layouts) with nothing written.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "ascend/fake_cann.hpp"
#include "support/check.hpp"

namespace fa = fusedattn;
using namespace fusedattn::testing;

namespace {

/// The q, o and k data pointers of the last run_checked call.
const void* last_q = nullptr;
const void* last_o = nullptr;
const void* last_k = nullptr;

/// Element distance from `base` to the first element a recorded tensor views.
std::int64_t elements_from(const void* base, const fake_cann::tensor_record& t, std::size_t elem) {
  const auto first = reinterpret_cast<std::intptr_t>(t.data) + t.offset * static_cast<std::intptr_t>(elem);
  return (first - reinterpret_cast<std::intptr_t>(base)) / static_cast<std::intptr_t>(elem);
}

/// Runs one call on the fake and checks it against the oracle; returns the journal of the call.
template <class T>
fake_cann::journal run_checked(const fa::problem& p, layout l, const fa::any_mask& mask, bool with_lse = true) {
  fake_cann::reset();
  const int allocations = fake_cann::live_allocations();
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  attention_case<T> c(p, l, rng);
  last_q = c.q.view.data;
  last_o = c.o.view.data;
  last_k = c.k.view.data;
  INFO(fa::scalar_name<T>() << " " << describe(p) << " " << describe(mask) << " " << layout_name(l) << " seed=" << seed);
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()), 123.0f);
  const fa::status st = fa::attend(fa::policy::ascend{}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask,
                                   with_lse ? lse.data() : nullptr);
  INFO(st.what());
  REQUIRE(st.ok());
  const expected e = std::visit([&](const auto& m) { return expect(c, bind(m, p)); }, mask);
  const double err = max_abs_error(c.o.view, e.ref.o);
  INFO("max error " << err << " tolerance " << e.tolerance);
  CHECK(err <= e.tolerance);
  if (with_lse) {
    const double lse_err = max_lse_error(lse, e.ref.lse);
    INFO("lse error " << lse_err << " tolerance " << e.lse_tolerance);
    CHECK(lse_err <= e.lse_tolerance);
  }
  // Every object and buffer of the call is released (the per-device causal mask is kept on purpose).
  CHECK(fake_cann::live_objects() == 0);
  CHECK(fake_cann::pending_executors() == 0);
  CHECK(fake_cann::live_allocations() <= allocations + 1);
  CHECK(fake_cann::log().syncs == 1);
  return fake_cann::log();
}

std::vector<std::int64_t> v64(std::initializer_list<std::int64_t> l) { return l; }

}  // namespace

#if !FUSEDATTN_TEST_SUBSET  // [heavy]: not compiled in CI's sanitizer stage
TEST_CASE("ascend: every band mask, layout and shape matches the float64 oracle (f32)", "[ascend][heavy]") {
  // tail_shapes() with 300 where it has 1000: the fake and the oracle are plain loops.
  const std::vector<fa::problem> shapes = {
      {1, 1, 1, 1, 1, 1},        {1, 1, 1, 7, 7, 3},      {2, 3, 3, 127, 127, 64}, {1, 2, 1, 128, 128, 80},
      {1, 1, 1, 300, 300, 16},   {1, 2, 2, 7, 300, 128},  {1, 1, 1, 300, 7, 256},  {2, 4, 2, 128, 127, 32},
      {1, 4, 1, 33, 65, 64},     {1, 1, 1, 1, 300, 256},
  };
  for (const fa::problem& p : shapes)
    for (layout l : {layout::bhsd, layout::bshd, layout::padded, layout::padded16})
      for (const fa::any_mask& m : all_masks()) run_checked<float>(p, l, m);
}
#endif

TEST_CASE("ascend: f16 and bf16 match the oracle, with and without lse", "[ascend]") {
  const std::vector<fa::problem> shapes = {{1, 4, 2, 33, 65, 64}, {2, 2, 1, 7, 7, 80}, {1, 2, 2, 65, 33, 32},
                                           {1, 2, 2, 1, 40, 64}};
  for (const fa::problem& p : shapes)
    for (layout l : {layout::bhsd, layout::bshd, layout::padded})
      for (const fa::any_mask& m : all_masks())
        for (bool with_lse : {true, false}) {
          run_checked<Eigen::half>(p, l, m, with_lse);
          run_checked<Eigen::bfloat16>(p, l, m, with_lse);
        }
}

TEST_CASE("ascend: layout string, shapes, strides, scale and head counts", "[ascend]") {
  fa::problem p{2, 8, 2, 33, 65, 64};
  p.scale = 0.3;
  SECTION("B·H·S·D views run as BNSD") {
    const fake_cann::journal j = run_checked<float>(p, layout::bhsd, fa::dense{});
    REQUIRE(j.flash.size() == 1);
    const fake_cann::flash_call& c = j.flash[0];
    CHECK(c.layout == "BNSD");
    CHECK(c.q.dims == v64({2, 8, 33, 64}));
    CHECK(c.q.strides == v64({8 * 33 * 64, 33 * 64, 64, 1}));
    CHECK(c.k.dims == v64({2, 2, 65, 64}));
    CHECK(c.v.strides == v64({2 * 65 * 64, 65 * 64, 64, 1}));
    CHECK(c.out.dims == c.q.dims);
    CHECK(c.head_num == 8);
    CHECK(c.scale == 0.3);
    CHECK(c.keep_prob == 1.0);
    CHECK(c.inner_precise == 0);
    CHECK_FALSE(c.other_inputs);
    CHECK(c.q.dtype == ACL_FLOAT);
    CHECK(c.q.format == ACL_FORMAT_ND);
    CHECK(c.softmax_max.dims == v64({2, 8, 33, 8}));
    CHECK(c.softmax_sum.dims == v64({2, 8, 33, 8}));
    CHECK(c.sparse_mode == 0);
    CHECK_FALSE(c.has_mask);
    CHECK(j.launches == std::vector<std::string>{"aclnnFlashAttentionScore", "aclnnLog", "aclnnInplaceAdd"});
  }
  SECTION("B·S·H·D views run as BSND") {
    const fake_cann::journal j = run_checked<float>(p, layout::bshd, fa::dense{}, false);
    REQUIRE(j.flash.size() == 1);
    const fake_cann::flash_call& c = j.flash[0];
    CHECK(c.layout == "BSND");
    CHECK(c.q.dims == v64({2, 33, 8, 64}));
    CHECK(c.q.strides == v64({33 * 8 * 64, 8 * 64, 64, 1}));
    CHECK(c.k.dims == v64({2, 65, 2, 64}));
    CHECK(c.k.strides == v64({65 * 2 * 64, 2 * 64, 64, 1}));
    CHECK(j.launches == std::vector<std::string>{"aclnnFlashAttentionScore"});  // no lse: no Log, no Add
  }
  SECTION("padded views keep their strides") {
    const fake_cann::journal j = run_checked<float>(p, layout::padded, fa::dense{});
    const fake_cann::flash_call& c = j.flash[0];
    CHECK(c.layout == "BNSD");
    const std::int64_t rs = 64 + 3, hs = 33 * rs + 5, bs = 8 * hs + 7;
    CHECK(c.q.strides == v64({bs, hs, rs, 1}));
  }
  SECTION("the default scale is 1/sqrt(head_dim)") {
    fa::problem d = p;
    d.scale.reset();
    const fake_cann::journal j = run_checked<float>(d, layout::bhsd, fa::dense{});
    CHECK(j.flash[0].scale == 1.0 / std::sqrt(64.0));
  }
}

namespace {
struct band_case {
  fa::index_t seq_q, seq_kv;
  fa::any_mask mask;
  std::int64_t mode, pre, next;
  fa::index_t row_begin, row_end;
};
}  // namespace

TEST_CASE("ascend: sparse mode and token bounds for causal and window masks in both alignments", "[ascend]") {
  constexpr std::int64_t none = 2147483647;
  const std::vector<band_case> cases = {
      {33, 65, fa::dense{}, 0, none, none, 0, 33},
      {33, 65, fa::causal{fa::align::top_left}, 2, none, 0, 0, 33},
      {33, 65, fa::causal{fa::align::bottom_right}, 3, none, 0, 0, 33},
      {64, 64, fa::causal{fa::align::top_left}, 3, none, 0, 0, 64},  // the two alignments coincide
      {65, 33, fa::causal{fa::align::bottom_right}, 3, none, 0, 32, 65},  // rows 0..31 see no key
      {65, 33, fa::causal{fa::align::top_left}, 2, none, 0, 0, 65},
      {33, 65, fa::window{5, 3, fa::align::top_left}, 4, 37, -29, 0, 33},
      {33, 65, fa::window{16, 0, fa::align::bottom_right}, 4, 16, 0, 0, 33},
      {10, 4, fa::window{2, 1, fa::align::top_left}, 4, 0, 3, 0, 6},  // rows 6..9 see no key
      {33, 65, fa::window{0, 0, fa::align::top_left}, 4, 32, -32, 0, 33},
      {33, 65, fa::window{100, 100, fa::align::top_left}, 0, none, none, 0, 33},  // covers every pair
  };
  for (const band_case& bc : cases) {
    const fa::problem p{1, 2, 1, bc.seq_q, bc.seq_kv, 16};
    INFO(describe(p) << " " << describe(bc.mask));
    const fake_cann::journal j = run_checked<float>(p, layout::bhsd, bc.mask);
    REQUIRE(j.flash.size() == 1);
    const fake_cann::flash_call& c = j.flash[0];
    CHECK(c.sparse_mode == bc.mode);
    CHECK(c.pre_tokens == bc.pre);
    CHECK(c.next_tokens == bc.next);
    CHECK(c.has_mask == (bc.mode != 0));
    if (c.has_mask) CHECK(c.mask.dims == v64({2048, 2048}));
    const fa::index_t rows = bc.row_end - bc.row_begin;
    CHECK(c.q.dims == v64({1, 2, rows, 16}));
    CHECK(elements_from(last_q, c.q, sizeof(float)) == bc.row_begin * 16);
    CHECK(elements_from(last_o, c.out, sizeof(float)) == bc.row_begin * 16);
    CHECK(c.k.dims == v64({1, 1, bc.seq_kv, 16}));
    const bool empty_rows = rows < bc.seq_q;
    std::vector<std::string> launches = {"aclnnFlashAttentionScore", "aclnnLog", "aclnnInplaceAdd"};
    if (empty_rows) launches.insert(launches.end(), {"aclnnInplaceZero", "aclnnInplaceFillScalar"});
    CHECK(j.launches == launches);
  }
}

TEST_CASE("ascend: seq_kv = 0 gives what the CPU policy gives, without an attention operator", "[ascend]") {
  fake_cann::reset();
  const fa::problem p{1, 2, 2, 5, 0, 8};
  std::vector<float> q(2 * 5 * 8, 0.5f), k(8, 0.25f), o(q.size(), 7.0f), o_cpu(q.size(), 7.0f);
  std::vector<float> lse(10, 1.0f), lse_cpu(10, 1.0f);
  const auto qv = fa::bhsd<const float>(q.data(), p.q_dims());
  const auto kv = fa::bhsd<const float>(k.data(), p.kv_dims());
  const fa::status cpu = fa::attend(fa::policy::cpu_naive{1}, p, qv, kv, kv, fa::bhsd(o_cpu.data(), p.o_dims()),
                                    fa::dense{}, lse_cpu.data());
  const fa::status st =
      fa::attend(fa::policy::ascend{}, p, qv, kv, kv, fa::bhsd(o.data(), p.o_dims()), fa::dense{}, lse.data());
  INFO(cpu.what() << " / " << st.what());
  CHECK(st.code() == cpu.code());
  CHECK(o == o_cpu);
  CHECK(lse == lse_cpu);
  if (st.ok()) {
    CHECK(fake_cann::log().flash.empty());
    CHECK(fake_cann::log().launches == std::vector<std::string>{"aclnnInplaceZero", "aclnnInplaceFillScalar"});
  }
}

TEST_CASE("ascend: decode (one query row, f16/bf16, no lse) runs aclnnIncreFlashAttentionV4", "[ascend]") {
  const fa::problem p{2, 8, 2, 1, 50, 64};
  SECTION("packed B·H·S·D") {
    const fake_cann::journal j = run_checked<Eigen::half>(p, layout::bhsd, fa::dense{}, false);
    REQUIRE(j.decode.size() == 1);
    CHECK(j.flash.empty());
    const fake_cann::decode_call& c = j.decode[0];
    CHECK(c.layout == "BNSD");
    CHECK(c.q.dims == v64({2, 8, 1, 64}));
    REQUIRE(c.k.size() == 1);
    CHECK(c.k[0].dims == v64({2, 2, 50, 64}));
    CHECK(c.actual_seq_lengths == v64({50, 50}));
    CHECK(c.num_heads == 8);
    CHECK(c.num_kv_heads == 2);
    CHECK(c.scale == 1.0 / 8.0);
    CHECK(c.block_size == 0);
    CHECK_FALSE(c.other_inputs);
    CHECK(j.launches == std::vector<std::string>{"aclnnIncreFlashAttentionV4"});
  }
  SECTION("B·S·H·D") {
    const fake_cann::journal j = run_checked<Eigen::bfloat16>(p, layout::bshd, fa::causal{fa::align::bottom_right},
                                                              false);
    REQUIRE(j.decode.size() == 1);
    CHECK(j.decode[0].layout == "BSND");
    CHECK(j.decode[0].k[0].dims == v64({2, 50, 2, 64}));
  }
  SECTION("a window narrows K and V to the row's keys") {
    const fake_cann::journal j = run_checked<Eigen::half>(p, layout::bhsd, fa::window{7, 0, fa::align::bottom_right},
                                                          false);
    REQUIRE(j.decode.size() == 1);
    CHECK(j.decode[0].actual_seq_lengths == v64({8, 8}));
    CHECK(elements_from(last_k, j.decode[0].k[0], 2) == 42 * 64);
  }
  SECTION("a KV cache with spare capacity is read through actualSeqLengths") {
    fake_cann::reset();
    const fa::index_t capacity = 96;
    std::mt19937_64 rng(fresh_seed());
    std::uniform_real_distribution<float> u(-1, 1);
    std::vector<Eigen::half> q(2 * 8 * 64), k(2 * 2 * capacity * 64), v(k.size()), o(q.size());
    for (auto* b : {&q, &k, &v})
      for (auto& x : *b) x = Eigen::half(u(rng));
    const fa::strides4 cache{2 * capacity * 64, capacity * 64, 64, 1};
    const auto kv = fa::strided<const Eigen::half>(k.data(), p.kv_dims(), cache);
    const auto vv = fa::strided<const Eigen::half>(v.data(), p.kv_dims(), cache);
    const auto qv = fa::bhsd<const Eigen::half>(q.data(), p.q_dims());
    REQUIRE(fa::attend(fa::policy::ascend{}, p, qv, kv, vv, fa::bhsd(o.data(), p.o_dims())).ok());
    REQUIRE(fake_cann::log().decode.size() == 1);
    CHECK(fake_cann::log().decode[0].k[0].dims == v64({2, 2, capacity, 64}));
    CHECK(fake_cann::log().decode[0].actual_seq_lengths == v64({50, 50}));
    const reference ref = reference_attention<double>(p, qv, kv, vv, fa::bind(fa::dense{}, p));
    double err = 0;
    for (std::size_t i = 0; i < o.size(); ++i) err = std::max(err, std::abs(double(o[i]) - ref.o[i]));
    CHECK(err <= 4 * epsilon<Eigen::half>());
  }
  SECTION("with lse, or in f32, decode runs aclnnFlashAttentionScore") {
    CHECK(run_checked<Eigen::half>(p, layout::bhsd, fa::dense{}, true).flash.size() == 1);
    CHECK(run_checked<float>(p, layout::bhsd, fa::dense{}, false).flash.size() == 1);
    CHECK(run_checked<Eigen::half>(p, layout::padded, fa::dense{}, false).flash.size() == 1);  // not packed
  }
}

TEST_CASE("ascend: block-sparse runs sparse mode 1 with the layout expanded to a full mask", "[ascend]") {
  fake_cann::reset();
  const fa::problem p{2, 4, 2, 300, 200, 32};
  std::mt19937_64 rng(fresh_seed());
  SECTION("one pattern: a [Sq, Skv] mask") {
    const fa::block_layout layout = fa::random_layout({p.seq_q, p.seq_kv, 64, 32}, 0.6, 7, {1, 0, 0, 0});
    attention_case<float> c(p, layout::bhsd, rng);
    std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
    REQUIRE(fa::attend(fa::policy::ascend{}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view,
                       fa::block_sparse{layout}, lse.data())
                .ok());
    const fake_cann::flash_call& fc = fake_cann::log().flash.at(0);
    CHECK(fc.sparse_mode == 1);
    REQUIRE(fc.has_mask);
    CHECK(fc.mask.dims == v64({300, 200}));
    const fa::block_sparse_mask bound = fa::bind(fa::block_sparse{layout}, p);
    const expected e = expect(c, bound);
    CHECK(max_abs_error(c.o.view, e.ref.o) <= e.tolerance);
    CHECK(max_lse_error(lse, e.ref.lse) <= e.lse_tolerance);
  }
  SECTION("a pattern per head: a [B, N, Sq, Skv] mask") {
    fa::block_geometry g{p.seq_q, p.seq_kv, 64, 32};
    g.heads = p.heads;
    const fa::block_layout layout = fa::random_layout(g, 0.5, 11, {1, 1, 0, 0});
    attention_case<Eigen::bfloat16> c(p, layout::bshd, rng);
    REQUIRE(fa::attend(fa::policy::ascend{}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view,
                       fa::block_sparse{layout})
                .ok());
    CHECK(fake_cann::log().flash.at(0).mask.dims == v64({2, 4, 300, 200}));
    const expected e = expect(c, fa::bind(fa::block_sparse{layout}, p));
    CHECK(max_abs_error(c.o.view, e.ref.o) <= e.tolerance);
  }
}

TEST_CASE("ascend: a block-sparse row without keys is unsupported", "[ascend]") {
  fake_cann::reset();
  const fa::problem p{1, 1, 1, 4, 4, 8};
  // q-block 1 lists no kv-block: rows 2 and 3 see no key
  const fa::block_layout layout({4, 4, 2, 2}, {0, 2, 2}, {0, 1});
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  const std::vector<float> before = c.o.buf;
  std::vector<float> lse(4, 5.0f);
  const fa::status st = fa::attend(fa::policy::ascend{}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view,
                                   fa::block_sparse{layout}, lse.data());
  CHECK(st.code() == fa::errc::unsupported);
  CHECK(std::string(st.what()).find("row 2") != std::string::npos);
  CHECK(unchanged(c.o.buf, before));
  CHECK(lse == std::vector<float>(4, 5.0f));
  CHECK(fake_cann::log().launches.empty());
  CHECK(fake_cann::live_objects() == 0);
}

namespace {
/// One f32 causal call with lse on fresh inputs; checks that a failing call wrote nothing and released everything.
fa::status call_and_check_untouched_on_error(const fa::problem& p, const fa::any_mask& mask) {
  const int allocations = fake_cann::live_allocations();
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  const std::vector<float> before = c.o.buf;
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()), 5.0f);
  const fa::status st =
      fa::attend(fa::policy::ascend{}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, lse.data());
  if (!st.ok()) {
    CHECK(unchanged(c.o.buf, before));
    CHECK(lse == std::vector<float>(lse.size(), 5.0f));
  }
  CHECK(fake_cann::live_objects() == 0);
  CHECK(fake_cann::pending_executors() == 0);
  CHECK(fake_cann::live_allocations() <= allocations + 1);
  return st;
}
}  // namespace

TEST_CASE("ascend: allocation failures are out_of_memory, nothing written", "[ascend]") {
  const fa::problem p{1, 2, 1, 40, 40, 16};
  bool reached_success = false;
  for (int n = 1; n < 20 && !reached_success; ++n) {
    fake_cann::reset();
    fake_cann::inject().malloc_at = n;
    INFO("aclrtMalloc number " << n << " fails");
    const fa::status st = call_and_check_untouched_on_error(p, fa::causal{fa::align::top_left});
    if (st.ok()) {
      reached_success = true;
    } else {
      CHECK(st.code() == fa::errc::out_of_memory);
      CHECK(std::string(st.what()).find("aclrtMalloc") != std::string::npos);
      CHECK(std::string(st.what()).find("fake CANN failure") != std::string::npos);
      CHECK(fake_cann::log().launches.empty());
    }
  }
  CHECK(reached_success);
}

TEST_CASE("ascend: GetWorkspaceSize failures are backend_error with CANN's text, nothing written", "[ascend]") {
  const fa::problem p{1, 2, 1, 40, 30, 16};
  for (const char* fn : {"aclnnFlashAttentionScoreGetWorkspaceSize", "aclnnLogGetWorkspaceSize",
                         "aclnnInplaceAddGetWorkspaceSize", "aclnnInplaceZeroGetWorkspaceSize",
                         "aclnnInplaceFillScalarGetWorkspaceSize"}) {
    fake_cann::reset();
    fake_cann::inject().get_workspace = fn;
    fake_cann::inject().message = "EZ1001: the fake refuses";
    INFO(fn);
    const fa::status st = call_and_check_untouched_on_error(p, fa::causal{fa::align::bottom_right});
    CHECK(st.code() == fa::errc::backend_error);
    CHECK(std::string(st.what()).find(fn) != std::string::npos);
    CHECK(std::string(st.what()).find("EZ1001: the fake refuses") != std::string::npos);
    CHECK(fake_cann::log().launches.empty());
  }
}

TEST_CASE("ascend: a failed launch is backend_error with CANN's text, and the stream is drained", "[ascend]") {
  fake_cann::reset();
  fake_cann::inject().launch = "aclnnFlashAttentionScore";
  fake_cann::inject().message = "EZ9999: aicore timeout";
  const fa::status st = call_and_check_untouched_on_error({2, 2, 2, 17, 23, 8}, fa::dense{});
  CHECK(st.code() == fa::errc::backend_error);
  CHECK(std::string(st.what()).find("aclnnFlashAttentionScore returned") != std::string::npos);
  CHECK(std::string(st.what()).find("EZ9999: aicore timeout") != std::string::npos);
  CHECK(fake_cann::log().syncs == 1);
  fake_cann::reset();
  fake_cann::inject().launch = "aclnnIncreFlashAttentionV4";
  const fa::problem p{1, 2, 2, 1, 9, 8};
  std::mt19937_64 rng(fresh_seed());
  attention_case<Eigen::half> c(p, layout::bhsd, rng);
  const std::vector<Eigen::half> before = c.o.buf;
  const fa::status st2 = fa::attend(fa::policy::ascend{}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view);
  CHECK(st2.code() == fa::errc::backend_error);
  CHECK(unchanged(c.o.buf, before));
}

TEST_CASE("ascend: views CANN's layouts cannot express are unsupported, with the reason", "[ascend]") {
  fake_cann::reset();
  const fa::problem p{2, 2, 2, 5, 6, 8};
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> a(p, layout::bshd, rng), b(p, layout::bhsd, rng);
  const std::vector<float> before = a.o.buf;
  SECTION("q B·S·H·D, k B·H·S·D") {
    const fa::status st = fa::attend(fa::policy::ascend{}, p, a.q.cview(), b.k.cview(), b.v.cview(), a.o.view);
    CHECK(st.code() == fa::errc::unsupported);
    CHECK(std::string(st.what()).find("q is laid out B·S·N·D but k is B·N·S·D") != std::string::npos);
  }
  SECTION("sequence outermost (S·B·H·D)") {
    std::vector<float> q(static_cast<std::size_t>(5 * 2 * 2 * 8));
    for (auto& x : q) x = 0.25f;
    const auto qv = fa::strided<const float>(q.data(), p.q_dims(), {2 * 8, 8, 2 * 2 * 8, 1});
    const fa::status st = fa::attend(fa::policy::ascend{}, p, qv, a.k.cview(), a.v.cview(), a.o.view);
    CHECK(st.code() == fa::errc::unsupported);
    CHECK(std::string(st.what()).find("q's strides (b 16, h 8, s 32)") != std::string::npos);
  }
  SECTION("f64") {
    std::vector<double> q(static_cast<std::size_t>(2 * 2 * 5 * 8), 0.5), k(2 * 2 * 6 * 8, 0.25), o(q.size());
    const fa::status st = fa::attend(fa::policy::ascend{}, p, fa::bhsd<const double>(q.data(), p.q_dims()),
                                     fa::bhsd<const double>(k.data(), p.kv_dims()),
                                     fa::bhsd<const double>(k.data(), p.kv_dims()), fa::bhsd(o.data(), p.o_dims()));
    CHECK(st.code() == fa::errc::unsupported);
    CHECK(std::string(st.what()).find("f16, bf16 and f32") != std::string::npos);
  }
  SECTION("more than 256 heads") {
    const fa::problem big{1, 257, 1, 2, 2, 4};
    std::vector<float> q(257 * 2 * 4, 0.5f), k(2 * 4, 0.5f), o(q.size());
    const fa::status st = fa::attend(fa::policy::ascend{}, big, fa::bhsd<const float>(q.data(), big.q_dims()),
                                     fa::bhsd<const float>(k.data(), big.kv_dims()),
                                     fa::bhsd<const float>(k.data(), big.kv_dims()), fa::bhsd(o.data(), big.o_dims()));
    CHECK(st.code() == fa::errc::unsupported);
    CHECK(std::string(st.what()).find("at most 256") != std::string::npos);
  }
  CHECK(unchanged(a.o.buf, before));
  CHECK(fake_cann::log().launches.empty());
  CHECK(fake_cann::live_objects() == 0);
}

TEST_CASE("ascend: a view that starts off the 32-byte grid is passed as an offset from an aligned address",
          "[ascend]") {
  fake_cann::reset();
  const fa::problem p{1, 2, 1, 9, 11, 8};
  std::mt19937_64 rng(fresh_seed());
  attention_case<float> c(p, layout::bhsd, rng);
  std::vector<float> shifted(c.q.buf.size() + 3);
  std::memcpy(shifted.data() + 3, c.q.buf.data(), c.q.buf.size() * sizeof(float));
  const auto qv = fa::bhsd<const float>(shifted.data() + 3, p.q_dims());
  REQUIRE(fa::attend(fa::policy::ascend{}, p, qv, c.k.cview(), c.v.cview(), c.o.view).ok());
  const fake_cann::tensor_record& q = fake_cann::log().flash.at(0).q;
  CHECK(reinterpret_cast<std::uintptr_t>(q.data) % 32 == 0);
  CHECK(static_cast<const float*>(q.data) + q.offset == shifted.data() + 3);
  const expected e = expect(c, fa::bind(fa::dense{}, p));
  CHECK(max_abs_error(c.o.view, e.ref.o) <= e.tolerance);
}

#if __has_include(<fusedattn/dispatch/plan.hpp>)
TEST_CASE("ascend: plan names the operator, the backend's scratch, and why block-sparse is not fused", "[ascend]") {
  const fa::problem p{2, 4, 2, 33, 65, 16};
  std::mt19937_64 rng(fresh_seed());
  attention_case<Eigen::half> c(p, layout::bhsd, rng);
  const fa::kernel_plan dense = fa::plan(fa::policy::ascend{}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view);
  REQUIRE(dense.st.ok());
  CHECK(dense.kernel == "ascend.flash_attention_score");
  CHECK(dense.fused);
  CHECK(dense.scratch_bytes == 2u * 2 * 4 * 33 * 8 * sizeof(float));
  const fa::problem d{2, 4, 2, 1, 65, 16};
  attention_case<Eigen::half> dc(d, layout::bhsd, rng);
  CHECK(fa::plan(fa::policy::ascend{}, d, dc.q.cview(), dc.k.cview(), dc.v.cview(), dc.o.view).kernel ==
        "ascend.incre_flash_attention_v4");
  const fa::block_layout layout = fa::random_layout({p.seq_q, p.seq_kv, 16, 16}, 0.5, 3, {1, 0, 0, 0});
  const fa::kernel_plan sparse = fa::plan(fa::policy::ascend{}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view,
                                          fa::block_sparse{layout});
  REQUIRE(sparse.st.ok());
  CHECK_FALSE(sparse.fused);
  CHECK(sparse.why.find("sparseMode 1") != std::string::npos);
  CHECK(sparse.scratch_bytes == 2u * 2 * 4 * 33 * 8 * sizeof(float) + 33 * 65);
  attention_case<Eigen::half> t(p, layout::bshd, rng);
  const fa::kernel_plan mixed = fa::plan(fa::policy::ascend{}, p, t.q.cview(), c.k.cview(), c.v.cview(), t.o.view);
  CHECK(mixed.st.code() == fa::errc::unsupported);
}
#endif
