// Score modifiers (softcap, ALiBi, attention sinks, and all three) on every CUDA kernel — the Hopper and mma.sync
// flash kernels, split-KV decode with its merge, and the naive pipeline — against a float64 reference, with dense,
// causal, window and block-sparse masks, GQA, f16 and bf16, rows that see no key, and lse; and the checks of the
// modifiers' device pointers.
#include <cmath>
#include <limits>
#include <random>
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

/// The float64 reference with modifiers, written from core/score_mod.hpp's definitions alone: for row i of head h,
/// t_j = bound_mods::apply(scale · q_i·k_j, h, i, j) over the keys the mask allows, σ = the sink logit (−inf without),
/// O_i = Σ e^{t_j − m} v_j / (e^{σ − m} + Σ e^{t_j − m}), lse_i = m + log(e^{σ − m} + Σ e^{t_j − m}),
/// m = max(σ, t_j); a row with no key and no sink: O = 0, lse = −inf. `Acc` float gives the plain same-precision
/// implementation the tolerance derives from. `mods` holds host pointers.
template <class Acc, class T, class Mask>
reference modified_reference(const problem& p, const attention_case<T>& c, const Mask& mask, const bound_mods& mods) {
  reference r{std::vector<double>(static_cast<std::size_t>(p.batch * p.heads * p.seq_q * p.head_dim)),
              std::vector<double>(static_cast<std::size_t>(p.batch * p.heads * p.seq_q))};
  const Acc scale = static_cast<Acc>(p.softmax_scale());
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  std::vector<Acc> t(static_cast<std::size_t>(p.seq_kv)), acc(static_cast<std::size_t>(p.head_dim));
  for (index_t b = 0; b < p.batch; ++b)
    for (index_t h = 0; h < p.heads; ++h) {
      const auto head = for_head(mask, b, h);
      const index_t g = p.kv_head(h);
      for (index_t i = 0; i < p.seq_q; ++i) {
        const Acc sink = mods.sink<Acc>(h);
        Acc m = sink;
        for (index_t j = 0; j < p.seq_kv; ++j) {
          if (!head.allowed(i, j)) continue;
          Acc dot = 0;
          for (index_t x = 0; x < p.head_dim; ++x)
            dot += static_cast<Acc>(c.q.view.row(b, h, i)[x]) * static_cast<Acc>(c.k.view.row(b, g, j)[x]);
          t[std::size_t(j)] = mods.apply(scale * dot, h, i, j);
          m = std::max(m, t[std::size_t(j)]);
        }
        Acc l = m == neg_inf ? Acc(0) : std::exp(sink - m);
        std::fill(acc.begin(), acc.end(), Acc(0));
        for (index_t j = 0; j < p.seq_kv; ++j) {
          if (!head.allowed(i, j)) continue;
          const Acc e = std::exp(t[std::size_t(j)] - m);
          l += e;
          for (index_t x = 0; x < p.head_dim; ++x) acc[std::size_t(x)] += e * static_cast<Acc>(c.v.view.row(b, g, j)[x]);
        }
        const std::size_t row = std::size_t((b * p.heads + h) * p.seq_q + i);
        for (index_t x = 0; x < p.head_dim; ++x)
          r.o[row * std::size_t(p.head_dim) + std::size_t(x)] = l > 0 ? double(acc[std::size_t(x)] / l) : 0.0;
        r.lse[row] = l > 0 ? double(m + std::log(l)) : -std::numeric_limits<double>::infinity();
      }
    }
  return r;
}

/// Which modifiers a case turns on.
struct mod_set {
  bool softcap = false, alibi = false, sinks = false;
  align alibi_align = align::top_left;
  const char* name;
};

const mod_set all_sets[] = {
    {true, false, false, align::top_left, "softcap"},
    {false, true, false, align::top_left, "alibi top_left"},
    {false, true, false, align::bottom_right, "alibi bottom_right"},
    {false, false, true, align::top_left, "sinks"},
    {true, true, true, align::bottom_right, "softcap + alibi + sinks"},
};

/// `mask` with the modifiers of `set`: softcap 0.6 (scores reach about ±1.5, so the cap bends them), slopes and sink
/// logits from `slopes` and `sink_logits` (host or device copies).
modified<any_mask> with_mods(const any_mask& mask, const mod_set& set, const float* slopes, const float* sink_logits) {
  modified<any_mask> m{mask, {}};
  if (set.softcap) m = m | softcap{0.6f};
  if (set.alibi) m = m | alibi{slopes, set.alibi_align};
  if (set.sinks) m = m | sinks{sink_logits};
  return m;
}

/// One kernel with one set of modifiers on a fresh random case (inputs in [−2, 2], so that the softcap bends the
/// scores) against modified_reference: O within 2 × the plain f32 implementation's error plus a floor, and lse.
template <class T>
void check_mods(cuda_kernel kernel, const problem& p, const any_mask& mask, const mod_set& set,
                const char* expect_kernel = nullptr) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  attention_case<T> c(p, layout::bhsd, rng);
  c.q.fill(rng, -2.0, 2.0);
  c.k.fill(rng, -2.0, 2.0);
  std::uniform_real_distribution<float> slope_u(0.01f, 0.3f), sink_u(-1.0f, 3.0f);
  std::vector<float> slopes(static_cast<std::size_t>(p.heads)), sink_logits(slopes.size());
  for (auto& x : slopes) x = slope_u(rng);
  for (auto& x : sink_logits) x = sink_u(rng);
  INFO(kernel_label(kernel) << " " << scalar_name<T>() << " " << describe(p) << " " << describe(mask) << " "
                            << set.name << " seed=" << seed);
  gpu::device_buffer<float> slopes_d(slopes), sinks_d(sink_logits);
  gpu::device_buffer<T> q(c.q.buf), k(c.k.buf), v(c.v.buf), o(c.o.buf);
  gpu::device_buffer<float> lse_d(std::vector<float>(static_cast<std::size_t>(p.lse_size()), 123.0f));
  REQUIRE((slopes_d.ok() && sinks_d.ok() && q.ok() && k.ok() && v.ok() && o.ok() && lse_d.ok()));
  if (expect_kernel != nullptr) {
    const kernel_plan plan = gpu::plan_cuda_mods<T>(
        kernel, p, gpu::on_device<const T>(c.q.cview(), c.q.buf.data(), q.data()),
        gpu::on_device<const T>(c.k.cview(), c.k.buf.data(), k.data()),
        gpu::on_device<const T>(c.v.cview(), c.v.buf.data(), v.data()),
        gpu::on_device<T>(c.o.view, c.o.buf.data(), o.data()), with_mods(mask, set, slopes_d.data(), sinks_d.data()),
        lse_d.data());
    CHECK(plan.kernel == std::string(expect_kernel));
  }
  const status st = gpu::attend_cuda_mods<T>(
      kernel, p, gpu::on_device<const T>(c.q.cview(), c.q.buf.data(), q.data()),
      gpu::on_device<const T>(c.k.cview(), c.k.buf.data(), k.data()),
      gpu::on_device<const T>(c.v.cview(), c.v.buf.data(), v.data()),
      gpu::on_device<T>(c.o.view, c.o.buf.data(), o.data()), with_mods(mask, set, slopes_d.data(), sinks_d.data()),
      lse_d.data());
  INFO(st.what());
  REQUIRE(st.ok());
  const status sync = gpu::synchronize();
  INFO(sync.what());
  REQUIRE(sync.ok());
  o.copy_to(c.o.buf);
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
  lse_d.copy_to(lse);

  const modified<any_mask> host_mask = with_mods(mask, set, slopes.data(), sink_logits.data());
  fusedattn::detail::visit_mask(host_mask, [&](const auto& m) {
    const auto bound = bind(m, p);
    const bound_mods& mods = mods_of(bound);
    const reference ref = modified_reference<double>(p, c, bound, mods);
    const reference plain = modified_reference<float>(p, c, bound, mods);
    double plain_err = 0;
    for (std::size_t i = 0; i < plain.o.size(); ++i)
      plain_err = std::max(plain_err, std::abs(double(static_cast<T>(plain.o[i])) - ref.o[i]));
    const double tolerance = output_tolerance<T>(plain_err);
    const double err = max_abs_error(c.o.view, ref.o);
    INFO("max error " << err << " tolerance " << tolerance);
    CHECK(err <= tolerance);
    std::vector<float> plain_lse(plain.lse.begin(), plain.lse.end());
    // The floor scales with |lse|: ALiBi moves a row's logits by up to slope·seq_kv (hundreds), where one float
    // rounding of the biased score is already ulp(|lse|).
    double lse_scale = 1.0;
    for (const double x : ref.lse)
      if (std::isfinite(x)) lse_scale = std::max(lse_scale, std::abs(x));
    const double lse_tolerance =
        2.0 * max_lse_error(plain_lse, ref.lse) + 64.0 * double(epsilon<float>()) * lse_scale;
    const double lse_err = max_lse_error(lse, ref.lse);
    INFO("lse error " << lse_err << " tolerance " << lse_tolerance);
    CHECK(lse_err <= lse_tolerance);
  });
}

/// A block-sparse layout over (seq_q, seq_kv) with 128 × 64 blocks, about half of them dropped (the first column
/// kept).
block_layout half_sparse(const problem& p, std::uint64_t seed) {
  const block_geometry g{p.seq_q, p.seq_kv, 128, 64};
  return random_layout(g, 0.5, seed, {1, 0});
}

}  // namespace

// Every kernel × modifier set × mask on GQA shapes with tails: s_q ≠ s_kv both ways (causal bottom-right with
// s_q > s_kv leaves rows that see no key: O = 0, lse = the sink), head_dim 64 (the Hopper 64 tile), 128, 80 (the
// mma.sync 96 tile with zero columns), 176 (on a Hopper the 192 tile with zero columns).
TEMPLATE_TEST_CASE("cuda score modifiers match the float64 reference", "[gpu][modifiers]", Eigen::half,
                   Eigen::bfloat16) {
  if (!have_device()) return;
  const problem shapes[] = {{2, 4, 2, 300, 200, 64}, {1, 4, 1, 200, 333, 128}, {1, 2, 2, 130, 257, 80},
                            {1, 2, 1, 150, 230, 176}};
  const cuda_kernel kernel = GENERATE(cuda_kernel::flash, cuda_kernel::flash_mma_sync, cuda_kernel::naive);
  const std::size_t shape_index = GENERATE(range<std::size_t>(0, 4));
  const problem& p = shapes[shape_index];
  const block_layout layout = half_sparse(p, 7 + shape_index);
  const any_mask masks[] = {dense{}, causal{align::bottom_right}, window{40, 8, align::top_left},
                            block_sparse{layout}};
  for (const mod_set& set : all_sets)
    for (const any_mask& mask : masks) check_mods<TestType>(kernel, p, mask, set);
}

// Split-KV calls (decode-like: few q-blocks, long rows) add the sink once, in the merge of the parts.
TEMPLATE_TEST_CASE("cuda score modifiers on split-KV calls", "[gpu][modifiers]", Eigen::half, Eigen::bfloat16) {
  if (!have_device()) return;
  const problem shapes[] = {{1, 4, 1, 1, 4000, 128}, {1, 2, 2, 20, 3000, 64}, {1, 2, 1, 1, 3000, 192}};
  for (const problem& p : shapes)
    for (const mod_set& set : all_sets) {
      check_mods<TestType>(cuda_kernel::flash, p, dense{}, set);
      check_mods<TestType>(cuda_kernel::flash_mma_sync, p, causal{align::bottom_right}, set);
    }
}

// GQA decode shapes on policy::cuda{automatic} run cuda.decode, which applies the modifiers per row of its
// (group heads × seq_q) block and adds the sink in split 0 only.
TEMPLATE_TEST_CASE("cuda score modifiers on cuda.decode through plain attend", "[gpu][modifiers]", Eigen::half,
                   Eigen::bfloat16) {
  if (!have_device()) return;
  const problem shapes[] = {{2, 8, 2, 1, 3001, 128}, {1, 8, 2, 3, 1000, 64}, {1, 4, 1, 2, 517, 256}};
  const any_mask masks[] = {dense{}, causal{align::bottom_right}, window{300, 0, align::bottom_right}};
  for (const problem& p : shapes)
    for (const any_mask& mask : masks)
      for (const mod_set& set : all_sets) check_mods<TestType>(cuda_kernel::automatic, p, mask, set, "cuda.decode");
}

TEST_CASE("cuda score modifiers in f32 (flash_generic)", "[gpu][modifiers]") {
  if (!have_device()) return;
  for (const mod_set& set : all_sets)
    check_mods<float>(cuda_kernel::automatic, {1, 4, 2, 100, 150, 40}, causal{align::bottom_right}, set);
}

TEST_CASE("cuda score modifiers: seq_kv 0 gives lse = the sink, and host pointers are refused", "[gpu][modifiers]") {
  if (!have_device()) return;
  using half = Eigen::half;
  const problem p{1, 2, 1, 3, 0, 64};
  const std::vector<float> sink_logits{0.5f, -1.25f};
  gpu::device_buffer<float> sinks_d(sink_logits);
  gpu::device_buffer<half> q(std::vector<half>(2 * 3 * 64, half(0.25f))), kv(std::vector<half>(64, half(0.25f)));
  gpu::device_buffer<half> o(std::vector<half>(2 * 3 * 64, half(7.0f)));
  gpu::device_buffer<float> lse_d(std::vector<float>(6, 123.0f));
  REQUIRE((sinks_d.ok() && q.ok() && kv.ok() && o.ok() && lse_d.ok()));
  const modified<any_mask> mask = any_mask{dense{}} | sinks{sinks_d.data()};
  for (const cuda_kernel kernel : {cuda_kernel::flash, cuda_kernel::naive}) {
    const status st = gpu::attend_cuda_mods<half>(kernel, p, bhsd<const half>(q.data(), p.q_dims()),
                                                  bhsd<const half>(kv.data(), p.kv_dims()),
                                                  bhsd<const half>(kv.data(), p.kv_dims()),
                                                  bhsd<half>(o.data(), p.o_dims()), mask, lse_d.data());
    INFO(kernel_label(kernel) << ": " << st.what());
    REQUIRE(st.ok());
    REQUIRE(gpu::synchronize().ok());
    std::vector<float> lse(6);
    lse_d.copy_to(lse);
    std::vector<half> o_host(2 * 3 * 64);
    o.copy_to(o_host);
    for (int r = 0; r < 6; ++r) CHECK(lse[std::size_t(r)] == sink_logits[std::size_t(r / 3)]);
    for (const half x : o_host) CHECK(static_cast<float>(x) == 0.0f);
  }
  // Slopes or sink logits in host memory: refused, naming the field, nothing written.
  const problem p2{1, 2, 1, 16, 16, 64};
  gpu::device_buffer<half> o2(std::vector<half>(2 * 16 * 64, half(7.0f)));
  gpu::device_buffer<half> in(std::vector<half>(2 * 16 * 64, half(0.25f)));
  REQUIRE((o2.ok() && in.ok()));
  const std::vector<float> host_slopes{0.1f, 0.2f};
  const auto call = [&](const modified<any_mask>& m) {
    return gpu::attend_cuda_mods<half>(cuda_kernel::automatic, p2, bhsd<const half>(in.data(), p2.q_dims()),
                                       bhsd<const half>(in.data(), p2.kv_dims()),
                                       bhsd<const half>(in.data(), p2.kv_dims()), bhsd<half>(o2.data(), p2.o_dims()), m,
                                       nullptr);
  };
  status st = call(any_mask{causal{}} | alibi{host_slopes.data()});
  CHECK(st.code() == errc::invalid_argument);
  CHECK(std::string(st.what()).find("alibi.slopes") != std::string::npos);
  st = call(any_mask{dense{}} | sinks{sink_logits.data()});
  CHECK(st.code() == errc::invalid_argument);
  CHECK(std::string(st.what()).find("sinks.logits") != std::string::npos);
  std::vector<half> o2_host(2 * 16 * 64);
  o2.copy_to(o2_host);
  for (const half x : o2_host) CHECK(static_cast<float>(x) == 7.0f);
}

TEST_CASE("cuda score modifiers: fa::plan runs them fused", "[gpu][modifiers]") {
  if (!have_device()) return;
  using half = Eigen::half;
  const problem p{1, 4, 2, 512, 512, 64};
  gpu::device_buffer<half> in(std::vector<half>(4 * 512 * 64, half(0.25f))), o(std::vector<half>(4 * 512 * 64));
  gpu::device_buffer<float> slopes(std::vector<float>(4, 0.1f));
  REQUIRE((in.ok() && o.ok() && slopes.ok()));
  const kernel_plan pl = gpu::plan_cuda_mods<half>(
      cuda_kernel::automatic, p, bhsd<const half>(in.data(), p.q_dims()), bhsd<const half>(in.data(), p.kv_dims()),
      bhsd<const half>(in.data(), p.kv_dims()), bhsd<half>(o.data(), p.o_dims()),
      any_mask{causal{}} | softcap{30.0f} | alibi{slopes.data()}, nullptr);
  INFO(pl.st.what() << " " << pl.kernel << ": " << pl.why);
  REQUIRE(pl);
  CHECK(pl.fused);
  CHECK(pl.kernel.rfind("cuda.flash", 0) == 0);
}
