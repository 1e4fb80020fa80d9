// The numerical contract of docs/design.md ("Numerics") on every CUDA kernel: a NaN or inf reaches only the outputs
// that depend on it (naive pipeline, mma.sync flash, Hopper flash, split-KV decode and its merge, block-sparse); a row
// that sees no key gives O = 0 and lse = −inf; zero extents; fa::plan's answers for policy::cuda.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gpu_check.hpp"
#include "gpu_entry.hpp"
#include "support/check.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;
using fusedattn::policy::cuda_kernel;

namespace {

const char* kernel_label(cuda_kernel k) {
  return k == cuda_kernel::flash            ? "flash"
         : k == cuda_kernel::flash_mma_sync ? "flash (mma.sync)"
         : k == cuda_kernel::naive          ? "naive"
                                            : "automatic";
}

/// Where the non-finite value goes: one element of a Q row, one element of a K row, or a whole V row.
enum class bad_in { q, k, v };

struct bad_site {
  index_t b, h, i;  ///< the Q row (b, h, i)
  index_t g, j;     ///< the K / V row (b, g, j)
  index_t c;        ///< the column of the Q or K element
};

/// Runs `kernel` on a fresh random case with one non-finite value (`value`: NaN, or +inf for V) in Q, K or V, and
/// checks the contract: a NaN in Q row (b, h, i) makes that O row and its lse NaN, unless the row sees no key (O = 0,
/// lse = −inf); a NaN in K row (b, g, j) makes the O row and lse of every query row that attends key j NaN; an inf or
/// NaN filling V row (b, g, j) makes every element of those rows non-finite and leaves their lse alone. Every other
/// output is finite and within the float64 oracle's tolerance (the rows whose mask skips the key, other heads,
/// batches). Returns the number of affected rows.
template <class T, class Mask>
index_t check_confined(cuda_kernel kernel, const problem& p, const Mask& mask, bad_in where, float value,
                       const bad_site& at) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  attention_case<T> c(p, layout::bhsd, rng);
  const T bad = static_cast<T>(value);
  if (where == bad_in::q) c.q.view.row(at.b, at.h, at.i)[at.c] = bad;
  if (where == bad_in::k) c.k.view.row(at.b, at.g, at.j)[at.c] = bad;
  if (where == bad_in::v)
    for (index_t col = 0; col < p.head_dim; ++col) c.v.view.row(at.b, at.g, at.j)[col] = bad;
  const char* names[] = {"q", "k", "v"};
  INFO(kernel_label(kernel) << " " << scalar_name<T>() << " " << value << " in " << names[int(where)] << " "
                            << describe(p) << " " << mask_name(mask) << " seed=" << seed);

  gpu::device_buffer<T> q(c.q.buf), k(c.k.buf), v(c.v.buf), o(c.o.buf);
  gpu::device_buffer<float> lse_d(std::vector<float>(std::size_t(p.lse_size()), 123.0f));
  REQUIRE((q.ok() && k.ok() && v.ok() && o.ok() && lse_d.ok()));
  const status st = gpu::attend_cuda<T>(kernel, p, gpu::on_device<const T>(c.q.cview(), c.q.buf.data(), q.data()),
                                        gpu::on_device<const T>(c.k.cview(), c.k.buf.data(), k.data()),
                                        gpu::on_device<const T>(c.v.cview(), c.v.buf.data(), v.data()),
                                        gpu::on_device<T>(c.o.view, c.o.buf.data(), o.data()), any_mask{mask},
                                        lse_d.data());
  INFO(st.what());
  REQUIRE(st.ok());
  const status sync = gpu::synchronize();
  INFO(sync.what());
  REQUIRE(sync.ok());
  o.copy_to(c.o.buf);
  std::vector<float> lse(std::size_t(p.lse_size()));
  lse_d.copy_to(lse);

  const auto bound = bind(mask, p);
  const expected e = expect(c, bound);
  const auto sees = [&](index_t b, index_t h, index_t i, index_t j) { return for_head(bound, b, h).allowed(i, j); };
  const auto sees_any = [&](index_t b, index_t h, index_t i) {
    for (index_t j = 0; j < p.seq_kv; ++j)
      if (sees(b, h, i, j)) return true;
    return false;
  };
  index_t affected = 0, missing = 0, spread = 0, wrong_lse = 0;
  double err = 0, lse_err = 0;
  for (index_t b = 0; b < p.batch; ++b)
    for (index_t h = 0; h < p.heads; ++h)
      for (index_t i = 0; i < p.seq_q; ++i) {
        const bool hit = where == bad_in::q ? b == at.b && h == at.h && i == at.i && sees_any(b, h, i)
                                            : b == at.b && p.kv_head(h) == at.g && sees(b, h, i, at.j);
        affected += hit;
        const std::size_t row = std::size_t((b * p.heads + h) * p.seq_q + i);
        const bool lse_hit = hit && where != bad_in::v;
        const bool lse_ok = lse_hit                      ? std::isnan(lse[row])
                            : std::isinf(e.ref.lse[row]) ? lse[row] == -std::numeric_limits<float>::infinity()
                                                         : std::isfinite(lse[row]);
        wrong_lse += !lse_ok;
        if (lse_ok && !lse_hit && std::isfinite(lse[row])) lse_err = std::max(lse_err, double(std::abs(lse[row] - e.ref.lse[row])));
        for (index_t col = 0; col < p.head_dim; ++col) {
          const double x = static_cast<double>(c.o.view.row(b, h, i)[col]);
          if (hit) {
            // A NaN logit gives NaN; an inf in V gives inf (or NaN where a zero weight met it in a full tile).
            const bool ok = where == bad_in::v && !std::isnan(value) ? !std::isfinite(x) : std::isnan(x);
            missing += !ok;
          } else if (!std::isfinite(x)) {
            ++spread;
          } else {
            err = std::max(err, std::abs(x - e.ref.o[row * std::size_t(p.head_dim) + std::size_t(col)]));
          }
        }
      }
  INFO("affected rows " << affected << "; outputs that should be non-finite but are not: " << missing
                        << "; non-finite outputs that should be finite: " << spread << "; wrong lse: " << wrong_lse
                        << "; max error " << err << " tolerance " << e.tolerance << "; lse error " << lse_err);
  CHECK(missing == 0);
  CHECK(spread == 0);
  CHECK(wrong_lse == 0);
  CHECK(err <= e.tolerance);
  CHECK(lse_err <= e.lse_tolerance);
  return affected;
}

/// The issue's cases for one kernel and type: causal bottom-right, S_q 200 / S_kv 300 and 300 / 200, GQA 4/2, d 64,
/// two batches; NaN and +inf filling a V row in a tile that rows skipping its key share; NaN in a Q row that sees
/// keys and in one that sees none; NaN in a K row.
template <class T>
void issue_cases(cuda_kernel kernel) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const causal br{align::bottom_right};
  const problem wide{2, 4, 2, 200, 300, 64}, tall{2, 4, 2, 300, 200, 64};
  // wide: row i sees keys j <= i + 100; key 150 is skipped by rows 0..49, which share its tiles with rows that see it.
  const bad_site wide_site{1, 3, 120, 1, 150, 5};
  // tall: row i sees keys j <= i − 100 (rows 0..99 see none); key 50 is skipped by rows 100..149.
  const bad_site tall_site{1, 3, 160, 1, 50, 5};
  const bad_site tall_blind{1, 2, 40, 1, 50, 5};  // Q row 40 sees no key
  for (float value : {nan, inf}) {
    CHECK(check_confined<T>(kernel, wide, br, bad_in::v, value, wide_site) > 0);
    CHECK(check_confined<T>(kernel, tall, br, bad_in::v, value, tall_site) > 0);
  }
  CHECK(check_confined<T>(kernel, wide, br, bad_in::q, nan, wide_site) == 1);
  CHECK(check_confined<T>(kernel, tall, br, bad_in::q, nan, tall_site) == 1);
  CHECK(check_confined<T>(kernel, tall, br, bad_in::q, nan, tall_blind) == 0);
  CHECK(check_confined<T>(kernel, wide, br, bad_in::k, nan, wide_site) > 0);
  CHECK(check_confined<T>(kernel, tall, br, bad_in::k, nan, tall_site) > 0);
  // A window and no mask, the value in a partial tile of a sequence tail.
  CHECK(check_confined<T>(kernel, wide, window{30, 0, align::bottom_right}, bad_in::v, inf, wide_site) > 0);
  CHECK(check_confined<T>(kernel, tall, dense{}, bad_in::v, nan, bad_site{0, 1, 7, 0, 199, 0}) > 0);
}

}  // namespace

TEMPLATE_TEST_CASE("cuda naive: NaN and inf reach only the outputs that depend on them", "[gpu][naive][numerics]",
                   float, Eigen::half) {
  if (!have_device()) return;
  issue_cases<TestType>(cuda_kernel::naive);
}

TEMPLATE_TEST_CASE("cuda flash: NaN and inf reach only the outputs that depend on them", "[gpu][flash][numerics]",
                   Eigen::half, Eigen::bfloat16) {
  if (!have_device()) return;
  issue_cases<TestType>(cuda_kernel::flash);           // the Hopper kernel on an H100 / H200
  issue_cases<TestType>(cuda_kernel::flash_mma_sync);  // the portable kernel
  issue_cases<TestType>(cuda_kernel::automatic);
  // head_dim 128 and 256 (the warp-specialised Hopper tiles), and 96 (the 128 tile with zero columns).
  const float inf = std::numeric_limits<float>::infinity();
  for (index_t d : {96, 128, 256}) {
    const problem p{1, 2, 1, 200, 300, d};
    const bad_site at{0, 1, 120, 0, 150, 3};
    for (cuda_kernel kernel : {cuda_kernel::flash, cuda_kernel::flash_mma_sync}) {
      CHECK(check_confined<TestType>(kernel, p, causal{align::bottom_right}, bad_in::v, inf, at) > 0);
      CHECK(check_confined<TestType>(kernel, p, causal{align::bottom_right}, bad_in::k,
                                     std::numeric_limits<float>::quiet_NaN(), at) > 0);
    }
  }
  // head_dim 64 without a mask and with many work items (the Hopper tile whose three warpgroups take turns): the
  // V row in the partial tile at the end of the keys.
  const problem many{4, 32, 8, 520, 520, 64};
  CHECK(check_confined<TestType>(cuda_kernel::flash, many, dense{}, bad_in::v, inf, bad_site{2, 5, 300, 1, 515, 0}) >
        0);
}

TEMPLATE_TEST_CASE("cuda split-KV decode: NaN and inf reach only the outputs that depend on them, the merge keeps a "
                   "part's NaN",
                   "[gpu][flash][decode][numerics]", Eigen::half, Eigen::bfloat16) {
  if (!have_device()) return;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  // One query row per head over 4096 keys: few blocks, so the keys are split and the parts merged by their lse.
  const problem decode{1, 4, 2, 1, 4096, 64}, decode128{2, 4, 1, 3, 3000, 128};
  const bad_site at{0, 3, 0, 1, 1000, 7};
  for (cuda_kernel kernel : {cuda_kernel::flash, cuda_kernel::flash_mma_sync}) {
    CHECK(check_confined<TestType>(kernel, decode, causal{align::bottom_right}, bad_in::k, nan, at) == 2);
    CHECK(check_confined<TestType>(kernel, decode, dense{}, bad_in::q, nan, at) == 1);
    CHECK(check_confined<TestType>(kernel, decode, dense{}, bad_in::v, inf, at) == 2);
    CHECK(check_confined<TestType>(kernel, decode, dense{}, bad_in::v, nan, at) == 2);
    // A window that ends before the bad key: nothing depends on it.
    CHECK(check_confined<TestType>(kernel, decode, window{500, 0, align::bottom_right}, bad_in::k, nan, at) == 0);
    // The key at the window's edge: rows 0 and 1 see key 2498 (keys from 2497 and 2498), row 2 skips it.
    const bad_site edge{1, 2, 1, 0, 2498, 1};
    CHECK(check_confined<TestType>(kernel, decode128, window{500, 0, align::bottom_right}, bad_in::v, inf, edge) > 0);
    CHECK(check_confined<TestType>(kernel, decode128, window{500, 0, align::bottom_right}, bad_in::k, nan, edge) > 0);
  }
}

TEMPLATE_TEST_CASE("cuda block-sparse: NaN and inf reach only the outputs that depend on them",
                   "[gpu][block_sparse][numerics]", Eigen::half, Eigen::bfloat16) {
  if (!have_device()) return;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const problem p{1, 4, 2, 300, 300, 64};
  // Every block listed, so the rows that skip the key do so by the element rule (causal) inside listed blocks, and
  // blocks of 64 keys: a 128-key tile reaches past a run's edge where a block is missing.
  const block_geometry g{p.seq_q, p.seq_kv, 128, 64, 1, p.heads};
  const block_layout layout = random_layout(g, 0.3, fresh_seed());
  const bad_site at{0, 3, 200, 1, 150, 2};
  for (cuda_kernel kernel : {cuda_kernel::flash, cuda_kernel::flash_mma_sync, cuda_kernel::naive}) {
    for (float value : {nan, inf}) check_confined<TestType>(kernel, p, block_sparse{layout, causal{}}, bad_in::v, value, at);
    check_confined<TestType>(kernel, p, block_sparse{layout, dense{}}, bad_in::v, inf, at);
    check_confined<TestType>(kernel, p, block_sparse{layout, causal{}}, bad_in::k, nan, at);
    check_confined<TestType>(kernel, p, block_sparse{layout, causal{}}, bad_in::q, nan, at);
  }
}

TEST_CASE("cuda zero extents: batch, heads or seq_q 0 write nothing, seq_kv 0 gives O = 0 and lse = -inf",
          "[gpu][errors]") {
  if (!have_device()) return;
  for (cuda_kernel kernel : {cuda_kernel::automatic, cuda_kernel::naive, cuda_kernel::flash}) {
    for (const problem& p : {problem{0, 4, 2, 16, 16, 64}, problem{2, 0, 2, 16, 16, 64}, problem{2, 4, 2, 0, 16, 64}}) {
      INFO(kernel_label(kernel) << " " << describe(p));
      const std::vector<Eigen::half> in(std::size_t(2 * 4 * 16 * 64), Eigen::half(0.5f));
      gpu::device_buffer<Eigen::half> q(in), k(in), v(in), o(in);
      REQUIRE((q.ok() && k.ok() && v.ok() && o.ok()));
      const status st = gpu::attend_cuda<Eigen::half>(
          kernel, p, bhsd<const Eigen::half>(q.data(), p.q_dims()), bhsd<const Eigen::half>(k.data(), p.kv_dims()),
          bhsd<const Eigen::half>(v.data(), p.kv_dims()), bhsd<Eigen::half>(o.data(), p.o_dims()), dense{}, nullptr);
      INFO(st.what());
      CHECK(st.ok());
      REQUIRE(gpu::synchronize().ok());
      std::vector<Eigen::half> out(in.size());
      o.copy_to(out);
      CHECK(unchanged(out, in));
    }
    // seq_kv = 0 on a strided O (B·S·H·D) whose gaps must stay as they were.
    const problem p{2, 4, 2, 5, 0, 64};
    INFO(kernel_label(kernel) << " " << describe(p));
    const std::vector<Eigen::half> in(std::size_t(2 * 4 * 5 * 64), Eigen::half(0.5f));
    std::vector<Eigen::half> o_host(std::size_t(2 * 5 * 4 * 80), Eigen::half(7.0f));
    gpu::device_buffer<Eigen::half> q(in), k(in), v(in), o(o_host);
    gpu::device_buffer<float> lse(std::vector<float>(std::size_t(p.lse_size()), 3.0f));
    REQUIRE((q.ok() && k.ok() && v.ok() && o.ok() && lse.ok()));
    const tensor_ref<Eigen::half> o_view{o.data(), p.o_dims(), strides4{5 * 4 * 80, 80, 4 * 80, 1}};
    const status st = gpu::attend_cuda<Eigen::half>(
        kernel, p, bhsd<const Eigen::half>(q.data(), p.q_dims()), bhsd<const Eigen::half>(k.data(), dims4{2, 2, 0, 64}),
        bhsd<const Eigen::half>(v.data(), dims4{2, 2, 0, 64}), o_view, causal{}, lse.data());
    INFO(st.what());
    REQUIRE(st.ok());
    REQUIRE(gpu::synchronize().ok());
    o.copy_to(o_host);
    std::vector<float> lse_host(std::size_t(p.lse_size()));
    lse.copy_to(lse_host);
    index_t zeros = 0, gaps_kept = 0;
    for (index_t b = 0; b < 2; ++b)
      for (index_t s = 0; s < 5; ++s)
        for (index_t h = 0; h < 4; ++h)
          for (index_t c = 0; c < 80; ++c) {
            const float x = static_cast<float>(o_host[std::size_t(((b * 5 + s) * 4 + h) * 80 + c)]);
            if (c < 64) zeros += x == 0.f;
            else gaps_kept += x == 7.f;
          }
    CHECK(zeros == 2 * 5 * 4 * 64);
    CHECK(gaps_kept == 2 * 5 * 4 * 16);
    for (float x : lse_host) CHECK(x == -std::numeric_limits<float>::infinity());
  }
}

TEST_CASE("cuda plan: the kernel attend runs, its scratch, and why it is not fused", "[gpu][plan]") {
  if (!have_device()) return;
  using half = Eigen::half;
  const auto run_plan = [](cuda_kernel kernel, const problem& p, const any_mask& mask) {
    // At least one element each: the zero-extent calls still pass device pointers.
    const std::vector<half> q_host(std::size_t(std::max<index_t>(1, p.batch * p.heads * p.seq_q * p.head_dim)),
                                   half(0.25f));
    const std::vector<half> kv_host(std::size_t(std::max<index_t>(1, p.batch * p.heads_kv * p.seq_kv * p.head_dim)),
                                    half(0.25f));
    gpu::device_buffer<half> q(q_host), k(kv_host), v(kv_host), o(q_host);
    REQUIRE((q.ok() && k.ok() && v.ok() && o.ok()));
    return gpu::plan_cuda<half>(kernel, p, bhsd<const half>(q.data(), p.q_dims()),
                                bhsd<const half>(k.data(), p.kv_dims()), bhsd<const half>(v.data(), p.kv_dims()),
                                bhsd<half>(o.data(), p.o_dims()), mask, nullptr);
  };
  {
    const kernel_plan pl = run_plan(cuda_kernel::automatic, problem{2, 8, 2, 1024, 1024, 128}, causal{});
    INFO(pl.st.what() << " " << pl.kernel);
    REQUIRE(pl);
    CHECK(pl.fused);
    CHECK(pl.kernel.rfind("cuda.flash", 0) == 0);
    CHECK(pl.scratch_bytes == sizeof(int));  // the repair pass's flag (a causal mask leaves masked keys in tiles)
    CHECK(pl.why.empty());
  }
  {  // head_dim 20 (not a multiple of 8): automatic runs the CUDA-core flash kernel, and says why
    const problem p{1, 4, 2, 300, 200, 20};
    const kernel_plan pl = run_plan(cuda_kernel::automatic, p, dense{});
    INFO(pl.st.what() << " " << pl.kernel << ": " << pl.why);
    REQUIRE(pl);
    CHECK(pl.kernel == "cuda.flash_generic");
    CHECK(pl.fused);
    CHECK(pl.why.find("head_dim is 20") != std::string::npos);
    CHECK(pl.why.find("naive") == std::string::npos);
    // at most its split-KV parts (f32 O rows, m and l): O(S), no seq_q x seq_kv term
    CHECK(pl.scratch_bytes % (sizeof(float) * (20 + 2)) == 0);
    CHECK(pl.scratch_bytes <= std::size_t(64) * 4 * 300 * (20 + 2) * sizeof(float));
  }
  {  // naive asked for on the same call: the naive pipeline's packed Q (f16) and unpacked O (f32), packed K and V,
     // S (f32) and P (f16), the non-finite V flag
    const kernel_plan pl = run_plan(cuda_kernel::naive, problem{1, 4, 2, 300, 200, 20}, dense{});
    REQUIRE(pl);
    CHECK(pl.kernel == "cuda.naive");
    CHECK_FALSE(pl.fused);
    const std::size_t expect_bytes = std::size_t(1 * 4 * 300 * 20) * 6 + std::size_t(1 * 2 * 200 * 20) * 4 +
                                     std::size_t(1 * 4 * 300 * 200) * 6 + sizeof(int);
    CHECK(pl.scratch_bytes == expect_bytes);
  }
  {  // head_dim 80 and 40: the Hopper 128 tile (on an sm_90a build and device) or the mma.sync kernel on the 96
     // and 64 tiles (few work items: its split-KV form)
    for (const index_t d : {index_t(40), index_t(80)}) {
      const kernel_plan pl = run_plan(cuda_kernel::automatic, problem{1, 4, 2, 300, 200, d}, dense{});
      INFO(pl.st.what() << " " << pl.kernel << ": " << pl.why);
      REQUIRE(pl);
      CHECK(pl.fused);
      CHECK((pl.kernel == "cuda.flash_mma_sync" || pl.kernel == "cuda.flash_split_kv" ||
             pl.kernel == "cuda.flash_hopper"));
      CHECK(pl.why.empty());
    }
  }
  {  // naive asked for
    const kernel_plan pl = run_plan(cuda_kernel::naive, problem{1, 2, 2, 64, 64, 64}, dense{});
    REQUIRE(pl);
    CHECK(pl.kernel == "cuda.naive");
    CHECK(pl.why.find("naive") != std::string::npos);
  }
  {  // flash asked for where it does not apply: the refusal attend returns
    const kernel_plan pl = run_plan(cuda_kernel::flash, problem{1, 2, 2, 64, 64, 20}, dense{});
    CHECK_FALSE(pl);
    CHECK(pl.st.code() == errc::unsupported);
  }
  {  // decode: split-KV, with its parts as scratch
    const problem p{1, 4, 2, 1, 8192, 64};
    const kernel_plan pl = run_plan(cuda_kernel::flash, p, dense{});
    INFO(pl.st.what() << " " << pl.kernel);
    REQUIRE(pl);
    CHECK(pl.kernel == "cuda.flash_split_kv");
    CHECK(pl.fused);
    CHECK(pl.scratch_bytes > 0);
    CHECK(pl.scratch_bytes % (sizeof(float) * 4 * (64 + 1)) == 0);
  }
  {  // the portable kernel asked for
    const kernel_plan pl = run_plan(cuda_kernel::flash_mma_sync, problem{2, 8, 2, 1024, 1024, 64}, dense{});
    REQUIRE(pl);
    CHECK(pl.kernel == "cuda.flash_mma_sync");
  }
  {  // zero extents
    const kernel_plan none = run_plan(cuda_kernel::automatic, problem{2, 4, 2, 0, 16, 64}, dense{});
    REQUIRE(none);
    CHECK(none.kernel == "cuda.none");
    const kernel_plan no_keys = run_plan(cuda_kernel::automatic, problem{2, 4, 2, 16, 0, 64}, dense{});
    REQUIRE(no_keys);
    CHECK(no_keys.kernel == "cuda.no_keys");
  }
  {  // host memory: the status attend returns
    const problem p{1, 2, 2, 16, 16, 64};
    std::vector<half> host(std::size_t(2 * 16 * 64), half(0.5f));
    const kernel_plan pl = gpu::plan_cuda<half>(cuda_kernel::automatic, p, bhsd<const half>(host.data(), p.q_dims()),
                                                bhsd<const half>(host.data(), p.kv_dims()),
                                                bhsd<const half>(host.data(), p.kv_dims()),
                                                bhsd<half>(host.data(), p.o_dims()), dense{}, nullptr);
    CHECK_FALSE(pl);
    CHECK(pl.st.code() == errc::invalid_argument);
  }
}

TEST_CASE("cuda non-finite V, Q and K on small shapes of every kernel (the compute-sanitizer run)",
          "[gpu][sanitize][numerics]") {
  if (!have_device()) return;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const causal br{align::bottom_right};
  const problem wide{1, 2, 1, 130, 200, 64}, decode{1, 2, 1, 1, 2048, 64};
  const bad_site at{0, 1, 100, 0, 150, 3};
  for (cuda_kernel kernel : {cuda_kernel::flash, cuda_kernel::flash_mma_sync, cuda_kernel::naive}) {
    CHECK(check_confined<Eigen::half>(kernel, wide, br, bad_in::v, inf, at) > 0);
    CHECK(check_confined<Eigen::bfloat16>(kernel, wide, br, bad_in::k, nan, at) > 0);
    CHECK(check_confined<Eigen::half>(kernel, decode, br, bad_in::v, nan, bad_site{0, 1, 0, 0, 1500, 0}) == 2);
  }
  const problem d128{1, 2, 1, 130, 200, 128};
  CHECK(check_confined<Eigen::half>(cuda_kernel::flash, d128, br, bad_in::v, inf, at) > 0);
  const block_layout layout = random_layout(block_geometry{130, 200, 128, 64, 1, 1}, 0.0, fresh_seed());
  CHECK(check_confined<Eigen::bfloat16>(cuda_kernel::flash, wide, block_sparse{layout, br}, bad_in::v, inf, at) > 0);
}
