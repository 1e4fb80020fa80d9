// The CUDA-core flash kernel (cuda.flash_generic) against the float64 oracle: f32, f64, f16 and bf16; base pointers
// off by one element and odd strides; head_dims 1 to 512 that the tensor-core kernels do not take (1, 7, 20, 100,
// 264, 512) and some they do; every band mask, block-sparse layouts with block_q 16, 48 and 200; GQA; sequence
// tails; split-KV calls; score modifiers; lse; the numerical contract (NaN and inf reach only the outputs that
// depend on them); and policy::cuda{automatic} choosing it (fa::plan: "cuda.flash_generic" with why, never naive).
//
// Accuracy: O within 2 × the error of a plain same-precision implementation (f32 accumulation; f64 for f64) against
// float64, plus 8 units of roundoff of the storage type (testing::expect; for f64 at least 32 units, 7.1e-15: the
// kernel's base-2 exponentials round differently from the plain loop's exp), and an L2 error relative to |O| of at
// most 4u for the 16-bit types (u = 2^-11 f16, 2^-8 bf16) and 512u for f32 and f64 (u = 2^-24, 2^-53); lse within
// 2 × the plain implementation's error plus 64 f32 units.
#include <algorithm>
#include <cmath>
#include <cstring>
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

/// The L2 bound of the file comment, relative to |O|.
template <class T>
double relative_bound() {
  const double u = std::ldexp(1.0, -std::numeric_limits<T>::digits);
  return (sizeof(T) == 2 ? 4.0 : 512.0) * u;
}

/// A device copy of one operand: its whole host buffer (gaps included), with one leading element when `shift`, so
/// that the device view starts one element past an aligned address.
template <class T>
struct shifted_copy {
  std::vector<T> host;
  gpu::device_buffer<T> dev;
  int shift;
  shifted_copy(const std::vector<T>& buf, bool shifted)
      : host(with_lead(buf, shifted)), dev(host), shift(shifted ? 1 : 0) {}
  static std::vector<T> with_lead(const std::vector<T>& buf, bool shifted) {
    std::vector<T> h(buf.size() + (shifted ? 1 : 0), T(0.5f));
    std::copy(buf.begin(), buf.end(), h.begin() + (shifted ? 1 : 0));
    return h;
  }
  template <class U, class V>
  tensor_ref<U> view(const tensor_ref<V>& host_view, const void* host_base) const {
    return gpu::on_device<U>(host_view, host_base, dev.data() + shift);
  }
  void read_into(std::vector<T>& buf) {
    dev.copy_to(host);
    std::copy(host.begin() + shift, host.end(), buf.begin());
  }
};

/// Runs `kernel` on case `c` (device copies, shifted by one element when `shift`) with `mask` (an any_mask or a
/// modified<any_mask> holding device pointers); O is copied back into the case, lse returned.
template <class T, class M>
std::vector<float> run(cuda_kernel kernel, attention_case<T>& c, const M& mask, bool shift) {
  shifted_copy<T> q(c.q.buf, shift), k(c.k.buf, shift), v(c.v.buf, shift), o(c.o.buf, shift);
  gpu::device_buffer<float> lse(std::vector<float>(std::size_t(c.p.lse_size()), 123.0f));
  REQUIRE((q.dev.ok() && k.dev.ok() && v.dev.ok() && o.dev.ok() && lse.ok()));
  const auto qd = q.template view<const T>(c.q.cview(), c.q.buf.data());
  const auto kd = k.template view<const T>(c.k.cview(), c.k.buf.data());
  const auto vd = v.template view<const T>(c.v.cview(), c.v.buf.data());
  const auto od = o.template view<T>(c.o.view, c.o.buf.data());
  status st;
  if constexpr (std::is_same_v<M, any_mask>) st = gpu::attend_cuda<T>(kernel, c.p, qd, kd, vd, od, mask, lse.data());
  else st = gpu::attend_cuda_mods<T>(kernel, c.p, qd, kd, vd, od, mask, lse.data());
  INFO(st.what());
  REQUIRE(st.ok());
  const status sync = gpu::synchronize();
  INFO(sync.what());
  REQUIRE(sync.ok());
  o.read_into(c.o.buf);
  std::vector<float> out(std::size_t(c.p.lse_size()));
  lse.copy_to(out);
  return out;
}

/// Counts of a comparison with the oracle that allows non-finite expectations.
struct comparison {
  index_t nonfinite_expected = 0;  ///< outputs the oracle makes non-finite
  index_t missing = 0;             ///< of those, outputs the kernel left finite
  index_t spread = 0;              ///< non-finite outputs where the oracle is finite
  index_t wrong_lse = 0;           ///< lse NaN / −inf where the oracle's is not, or the reverse
  double err = 0, rel = 0, lse_err = 0;
};

/// O and lse of case `c` against the oracle `e` element by element: where the oracle is finite, the kernel must be
/// finite and within tolerance; where the oracle is NaN or ±inf (an inf or NaN in V), the kernel must be non-finite
/// too. lse: NaN where the oracle's is NaN, −inf where it is −inf, else within tolerance. Rows marked in `nan_rows`
/// (a NaN logit: the oracle's plain sums do not carry it) must have every O element and lse NaN.
template <class T>
comparison compare(const attention_case<T>& c, const expected& e, const std::vector<float>& lse,
                   const std::vector<char>* nan_rows = nullptr) {
  comparison r;
  double num = 0, den = 0;
  std::size_t compared = 0;
  const dims4 d = c.o.view.dims;
  for (index_t b = 0; b < d.b; ++b)
    for (index_t h = 0; h < d.h; ++h)
      for (index_t i = 0; i < d.s; ++i) {
        const std::size_t row = std::size_t((b * d.h + h) * d.s + i);
        if (nan_rows != nullptr && (*nan_rows)[row]) {
          for (index_t col = 0; col < d.d; ++col) {
            ++r.nonfinite_expected;
            r.missing += !std::isnan(static_cast<double>(c.o.view.row(b, h, i)[col]));
          }
          r.wrong_lse += !std::isnan(lse[row]);
          continue;
        }
        for (index_t col = 0; col < d.d; ++col) {
          const double x = static_cast<double>(c.o.view.row(b, h, i)[col]);
          const double ref = e.ref.o[row * std::size_t(d.d) + std::size_t(col)];
          if (!std::isfinite(ref)) {
            ++r.nonfinite_expected;
            r.missing += std::isfinite(x);
          } else if (!std::isfinite(x)) {
            ++r.spread;
          } else {
            r.err = std::max(r.err, std::abs(x - ref));
            num += (x - ref) * (x - ref);
            den += ref * ref;
            ++compared;
          }
        }
        const double l = lse[row], ref = e.ref.lse[row];
        if (std::isnan(ref)) r.wrong_lse += !std::isnan(l);
        else if (std::isinf(ref)) r.wrong_lse += l != ref;
        else if (!std::isfinite(l)) ++r.wrong_lse;
        else r.lse_err = std::max(r.lse_err, std::abs(l - ref));
      }
  // The relative error's denominator has a floor of tolerance² per element: outputs far below the tolerance (rows
  // that a sink or a large ALiBi bias leaves near zero, f16 subnormals) carry no relative precision of their own.
  const double den_floor = double(compared) * e.tolerance * e.tolerance;
  r.rel = compared == 0 ? 0.0 : std::sqrt(num / std::max(den, den_floor));
  return r;
}

template <class T>
void check(const comparison& r, const expected& e) {
  const double tolerance = std::is_same_v<T, double> ? std::max(e.tolerance, 32.0 * epsilon<double>()) : e.tolerance;
  INFO("max error " << r.err << " tolerance " << tolerance << "; relative " << r.rel << " bound "
                    << relative_bound<T>() << "; lse error " << r.lse_err << " tolerance " << e.lse_tolerance
                    << "; non-finite expected " << r.nonfinite_expected << ", left finite " << r.missing
                    << ", spread " << r.spread << ", wrong lse " << r.wrong_lse);
  CHECK(r.missing == 0);
  CHECK(r.spread == 0);
  CHECK(r.wrong_lse == 0);
  CHECK(r.err <= tolerance);
  CHECK(r.rel <= relative_bound<T>());
  CHECK(r.lse_err <= e.lse_tolerance);
}

/// `kernel` on a fresh random case of (p, layout, mask), shifted by one element when `shift`, against the oracle;
/// the gaps of a padded O keep their values.
template <class T>
void check_case(cuda_kernel kernel, const problem& p, layout l, const any_mask& mask, bool shift) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  attention_case<T> c(p, l, rng);
  INFO(scalar_name<T>() << " " << describe(p) << " " << describe(mask) << " " << layout_name(l)
                        << (shift ? " (base + 1 element)" : "") << " seed=" << seed);
  const std::vector<T> o_before = c.o.buf;
  const std::vector<float> lse = run(kernel, c, mask, shift);
  const expected e = std::visit([&](const auto& m) { return expect(c, bind(m, p)); }, mask);
  check<T>(compare(c, e, lse), e);
  index_t gaps_changed = 0;
  std::vector<char> inside(c.o.buf.size(), 0);
  for (index_t b = 0; b < p.batch; ++b)
    for (index_t h = 0; h < p.heads; ++h)
      for (index_t i = 0; i < p.seq_q; ++i)
        for (index_t col = 0; col < p.head_dim; ++col) inside[std::size_t(c.o.view.offset(b, h, i) + col)] = 1;
  for (std::size_t x = 0; x < inside.size(); ++x)
    gaps_changed += !inside[x] && static_cast<double>(c.o.buf[x]) != static_cast<double>(o_before[x]);
  CHECK(gaps_changed == 0);
}

/// Shapes: every generic tile width (32, 64, 128, 256, 512 columns) with head_dims inside them (1, 7, 20, 40, 80,
/// 100, 264); tails of the q-tiles (16 or 32 rows) and key tiles (8 to 64 keys); seq 1; s_q ≠ s_kv both ways; GQA
/// and MQA; decode-like calls whose keys split over blocks (merged by their lse).
std::vector<problem> generic_shapes() {
  return {{1, 1, 1, 1, 1, 1},       {1, 2, 1, 7, 7, 7},         {2, 4, 2, 129, 300, 40},  {1, 2, 2, 300, 129, 80},
          {1, 3, 1, 65, 200, 100},  {1, 2, 1, 70, 150, 264},    {1, 1, 1, 333, 7, 64},    {1, 4, 2, 1, 3000, 128},
          {2, 2, 1, 33, 1000, 256}, {1, 2, 2, 40, 40, 512},     {1, 2, 2, 100, 130, 20},  {1, 8, 2, 3, 2000, 64}};
}

}  // namespace

TEMPLATE_TEST_CASE("cuda flash_generic matches the float64 oracle", "[gpu][generic]", float, double, Eigen::half,
                   Eigen::bfloat16) {
  if (!have_device()) return;
  const auto shapes = generic_shapes();
  const auto masks = all_masks();
  const layout layouts[] = {layout::bhsd, layout::bshd, layout::padded};
  for (std::size_t s = 0; s < shapes.size(); ++s)
    for (std::size_t m = 0; m < masks.size(); ++m)
      check_case<TestType>(cuda_kernel::flash_generic, shapes[s], layouts[(s + m) % 3], masks[m], (s + m) % 2 == 1);
}

TEMPLATE_TEST_CASE("cuda flash_generic: block-sparse layouts with any block_q", "[gpu][generic][block_sparse]", float,
                   double, Eigen::half, Eigen::bfloat16) {
  if (!have_device()) return;
  struct sparse_case {
    problem p;
    index_t block_q, block_kv;
    bool per_head;
    double sparsity;
  };
  // block_q 16 (below every q-tile: a q-tile of 16 rows), 48 (not a multiple of the q-tile: q-tiles of 32 and 16
  // rows), 200 (q-tiles cut at its multiples); block_kv narrower and wider than the key tile; tails.
  const sparse_case cases[] = {{{1, 2, 2, 130, 300, 64}, 16, 32, true, 0.5},
                               {{2, 4, 2, 200, 257, 40}, 48, 64, false, 0.6},
                               {{1, 2, 1, 450, 333, 128}, 200, 100, true, 0.4},
                               {{1, 2, 2, 97, 200, 264}, 48, 16, true, 0.5}};
  const block_sparse::element_rule withins[] = {dense{}, causal{align::bottom_right}, window{40, 10}};
  for (const sparse_case& sc : cases)
    for (std::size_t w = 0; w < 3; ++w) {
      const block_geometry g{sc.p.seq_q, sc.p.seq_kv, sc.block_q, sc.block_kv, 1, sc.per_head ? sc.p.heads : 1};
      const block_layout layout = random_layout(g, sc.sparsity, fresh_seed());
      check_case<TestType>(cuda_kernel::flash_generic, sc.p, w == 1 ? layout::padded : layout::bshd,
                           block_sparse{layout, withins[w]}, w == 2);
    }
  // automatic on 16-bit storage with block_q 48: the tensor-core kernels refuse the layout, generic takes it.
  const problem p{1, 2, 2, 300, 300, 64};
  const block_layout layout = random_layout(block_geometry{300, 300, 48, 64, 1, 2}, 0.5, fresh_seed());
  check_case<TestType>(cuda_kernel::automatic, p, layout::bhsd, block_sparse{layout, causal{}}, false);
}

TEMPLATE_TEST_CASE("cuda flash_generic with score modifiers", "[gpu][generic][modifiers]", float, double, Eigen::half) {
  if (!have_device()) return;
  struct mod_set {
    bool softcap, alibi, sinks;
    align alibi_align;
    const char* name;
  };
  const mod_set sets[] = {{true, false, false, align::top_left, "softcap"},
                          {false, true, false, align::bottom_right, "alibi bottom_right"},
                          {false, false, true, align::top_left, "sinks"},
                          {true, true, true, align::top_left, "softcap + alibi + sinks"}};
  // s_q > s_kv under causal bottom-right leaves rows that see no key (O = 0, lse = the sink); the decode shape splits
  // its keys (the sink joins once, in the merge); head_dim 100 and 264.
  const problem shapes[] = {{2, 4, 2, 300, 200, 100}, {1, 4, 1, 2, 3000, 64}, {1, 2, 2, 70, 150, 264}};
  for (const problem& p : shapes) {
    const block_layout layout = random_layout(block_geometry{p.seq_q, p.seq_kv, 48, 64}, 0.5, fresh_seed(), {1, 0});
    const any_mask masks[] = {dense{}, causal{align::bottom_right}, window{40, 8}, block_sparse{layout}};
    for (const mod_set& set : sets)
      for (const any_mask& mask : masks) {
        const std::uint64_t seed = fresh_seed();
        std::mt19937_64 rng(seed);
        attention_case<TestType> c(p, layout::bshd, rng);
        c.q.fill(rng, -2.0, 2.0);  // scores reach about ±1.5·sqrt(d)·scale, so softcap 0.6 bends them
        c.k.fill(rng, -2.0, 2.0);
        std::uniform_real_distribution<float> slope_u(0.01f, 0.3f), sink_u(-1.0f, 3.0f);
        std::vector<float> slopes(std::size_t(p.heads)), sink_logits(slopes.size());
        for (auto& x : slopes) x = slope_u(rng);
        for (auto& x : sink_logits) x = sink_u(rng);
        INFO(scalar_name<TestType>() << " " << describe(p) << " " << describe(mask) << " " << set.name
                                     << " seed=" << seed);
        gpu::device_buffer<float> slopes_d(slopes), sinks_d(sink_logits);
        REQUIRE((slopes_d.ok() && sinks_d.ok()));
        const auto with = [&](const float* sl, const float* sk) {
          modified<any_mask> m{mask, {}};
          if (set.softcap) m = m | softcap{0.6f};
          if (set.alibi) m = m | alibi{sl, set.alibi_align};
          if (set.sinks) m = m | sinks{sk};
          return m;
        };
        const std::vector<float> lse = run(cuda_kernel::flash_generic, c, with(slopes_d.data(), sinks_d.data()), false);
        fusedattn::detail::visit_mask(with(slopes.data(), sink_logits.data()), [&](const auto& m) {
          expected e = expect(c, bind(m, p));
          // Large logits (docs/design.md, Numerics): ALiBi adds up to 0.3 · 3000 to a logit, and a kernel may round
          // a logit s a few times (|δs| ≤ 4·u·|s| in the accumulation type), which moves lse by δs and O by up to
          // 2·δs·max|v| (|v| ≤ 1).
          const double s_bound = p.softmax_scale() * double(p.head_dim) * 4.0 +
                                 (set.alibi ? 0.3 * double(std::max(p.seq_q, p.seq_kv)) : 0.0);
          const double ds = 4.0 * double(epsilon<accum_t<TestType>>()) * s_bound;
          e.tolerance += 2.0 * ds;
          e.lse_tolerance += ds;
          check<TestType>(compare(c, e, lse), e);
        });
      }
  }
}

TEMPLATE_TEST_CASE("cuda flash_generic: NaN and inf reach only the outputs that depend on them",
                   "[gpu][generic][numerics]", float, double, Eigen::half, Eigen::bfloat16) {
  if (!have_device()) return;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  enum class where { q, k, v };
  struct bad_case {
    problem p;
    any_mask mask;
    where at;
    float value;
    index_t b, h_or_g, row, col;  ///< Q row (b, h, row) or K / V row (b, g, row); the column of a Q or K value
    bool some_rows_blind;         ///< the mask leaves rows that skip the bad key (their outputs must stay finite)
  };
  const causal br{align::bottom_right};
  const problem wide{2, 4, 2, 200, 300, 80}, tall{2, 4, 2, 300, 200, 80}, decode{1, 4, 2, 2, 3000, 40};
  const bad_case cases[] = {
      // a V row of NaN or inf in tiles shared by rows that see its key and rows that do not
      {wide, br, where::v, nan, 1, 1, 150, 0, true},  {wide, br, where::v, inf, 1, 1, 150, 0, true},
      {tall, br, where::v, inf, 1, 1, 50, 0, true},   {tall, window{30, 0, br.alignment}, where::v, nan, 0, 0, 120, 0, true},
      // NaN in a Q row that sees keys (that row NaN) and in one that sees none (O = 0, lse = −inf); NaN in K
      {wide, br, where::q, nan, 1, 3, 120, 5, true},  {tall, br, where::q, nan, 1, 2, 40, 5, true},
      {tall, br, where::k, nan, 1, 1, 50, 5, true},   {wide, dense{}, where::v, nan, 0, 1, 299, 0, false},
      // split-KV parts merged by lse: a NaN part makes its row NaN; a window that ends before the bad key
      {decode, dense{}, where::k, nan, 0, 1, 1000, 7, false},
      {decode, window{500, 0, br.alignment}, where::v, inf, 0, 1, 2498, 0, true},
      {decode, br, where::v, inf, 0, 0, 2999, 0, true}};
  for (const bad_case& bc : cases) {
    const std::uint64_t seed = fresh_seed();
    std::mt19937_64 rng(seed);
    attention_case<TestType> c(bc.p, layout::bhsd, rng);
    const TestType bad = static_cast<TestType>(bc.value);
    if (bc.at == where::q) c.q.view.row(bc.b, bc.h_or_g, bc.row)[bc.col] = bad;
    if (bc.at == where::k) c.k.view.row(bc.b, bc.h_or_g, bc.row)[bc.col] = bad;
    if (bc.at == where::v)
      for (index_t x = 0; x < bc.p.head_dim; ++x) c.v.view.row(bc.b, bc.h_or_g, bc.row)[x] = bad;
    INFO(scalar_name<TestType>() << " " << describe(bc.p) << " " << describe(bc.mask) << " " << bc.value << " in "
                                 << "qkv"[int(bc.at)] << " seed=" << seed);
    const std::vector<float> lse = run(cuda_kernel::flash_generic, c, bc.mask, false);
    const expected e = std::visit([&](const auto& m) { return expect(c, bind(m, bc.p)); }, bc.mask);
    // A NaN in Q row (b, h, i) that sees a key, or in K row (b, g, j): the rows whose logits it enters are NaN.
    const band_mask band = bind_band(bc.mask, bc.p);
    std::vector<char> nan_rows(std::size_t(bc.p.lse_size()), 0);
    for (index_t h = 0; h < bc.p.heads; ++h)
      for (index_t i = 0; i < bc.p.seq_q; ++i) {
        bool hit = false;
        if (bc.at == where::k) hit = bc.p.kv_head(h) == bc.h_or_g && band.allowed(i, bc.row);
        if (bc.at == where::q && h == bc.h_or_g && i == bc.row)
          for (index_t j = 0; j < bc.p.seq_kv && !hit; ++j) hit = band.allowed(i, j);
        nan_rows[std::size_t((bc.b * bc.p.heads + h) * bc.p.seq_q + i)] = hit;
      }
    const comparison r = compare(c, e, lse, &nan_rows);
    check<TestType>(r, e);
    const bool blind_q = bc.at == where::q && std::count(nan_rows.begin(), nan_rows.end(), 1) == 0;
    if (blind_q) CHECK(r.nonfinite_expected == 0);  // a row that sees no key: O = 0, lse = −inf, NaN or not
    else CHECK(r.nonfinite_expected > 0);            // the bad value reaches some output, or the case tests nothing
    if (bc.some_rows_blind) {
      // rows of the same head skip the key: the outputs are not all non-finite
      const index_t head_outputs = bc.p.seq_q * bc.p.head_dim * (bc.at == where::q ? 1 : bc.p.group_size());
      CHECK(r.nonfinite_expected < head_outputs);
    }
  }
}

TEST_CASE("cuda plan: automatic names cuda.flash_generic with why, never naive; naive still runs naive",
          "[gpu][generic][plan]") {
  if (!have_device()) return;
  using half = Eigen::half;
  const problem p{1, 4, 2, 300, 200, 64};
  const std::vector<half> h_in(std::size_t(4 * 300 * 64 + 8), half(0.25f));
  const std::vector<float> f_in(h_in.size(), 0.25f);
  gpu::device_buffer<half> hq(h_in), hk(h_in), hv(h_in), ho(h_in);
  gpu::device_buffer<float> fq(f_in), fk(f_in), fv(f_in), fo(f_in);
  REQUIRE((hq.ok() && hk.ok() && hv.ok() && ho.ok() && fq.ok() && fk.ok() && fv.ok() && fo.ok()));
  const auto plan_half = [&](cuda_kernel kernel, int offset, const any_mask& mask) {
    return gpu::plan_cuda<half>(kernel, p, bhsd<const half>(hq.data() + offset, p.q_dims()),
                                bhsd<const half>(hk.data() + offset, p.kv_dims()),
                                bhsd<const half>(hv.data() + offset, p.kv_dims()),
                                bhsd<half>(ho.data() + offset, p.o_dims()), mask, nullptr);
  };
  const auto expect_generic = [](const kernel_plan& pl, const char* reason) {
    INFO(pl.st.what() << " " << pl.kernel << ": " << pl.why);
    REQUIRE(pl);
    CHECK(pl.kernel == "cuda.flash_generic");
    CHECK(pl.fused);
    CHECK(pl.why.find(reason) != std::string::npos);
    CHECK(pl.why.find("naive") == std::string::npos);
  };
  // 16-bit views one element off a 16-byte boundary: the tensor-core kernels on aligned copies (scratch of Q, K, V
  // and O's size), saying why
  const kernel_plan copied = plan_half(cuda_kernel::automatic, 1, dense{});
  INFO(copied.st.what() << " " << copied.kernel << ": " << copied.why);
  REQUIRE(copied);
  CHECK(copied.kernel.rfind("cuda.flash", 0) == 0);
  CHECK(copied.kernel != "cuda.flash_generic");
  CHECK(copied.fused);
  CHECK(copied.why.find("aligned copies") != std::string::npos);
  CHECK(copied.why.find("16-byte aligned") != std::string::npos);
  CHECK(copied.scratch_bytes >= std::size_t(2 * 4 * 300 * 64 + 2 * 2 * 200 * 64) * sizeof(half));
  // block_q 48 (not a multiple of the tensor-core q-tile)
  const block_layout layout = random_layout(block_geometry{300, 200, 48, 64, 1, 1}, 0.5, fresh_seed());
  expect_generic(plan_half(cuda_kernel::automatic, 0, block_sparse{layout}), "block_q");
  // f32 storage
  const kernel_plan f32 = gpu::plan_cuda<float>(
      cuda_kernel::automatic, p, bhsd<const float>(fq.data(), p.q_dims()), bhsd<const float>(fk.data(), p.kv_dims()),
      bhsd<const float>(fv.data(), p.kv_dims()), bhsd<float>(fo.data(), p.o_dims()), causal{}, nullptr);
  expect_generic(f32, "f16 and bf16");
  // asked for on a call the tensor-core kernels take
  expect_generic(plan_half(cuda_kernel::flash_generic, 0, causal{}), "flash_generic");
  // the tensor-core kernel stays where it applies; naive asked for stays naive
  const kernel_plan fused = plan_half(cuda_kernel::automatic, 0, causal{});
  REQUIRE(fused);
  CHECK(fused.kernel.rfind("cuda.flash", 0) == 0);
  CHECK(fused.kernel != "cuda.flash_generic");
  const kernel_plan naive = plan_half(cuda_kernel::naive, 1, dense{});
  REQUIRE(naive);
  CHECK(naive.kernel == "cuda.naive");
  CHECK_FALSE(naive.fused);
  // explicit flash keeps refusing what it does not take
  CHECK(plan_half(cuda_kernel::flash, 1, dense{}).st.code() == errc::unsupported);
  // naive and automatic (the tensor-core kernels on aligned copies) on an unaligned f16 call, both right
  check_case<half>(cuda_kernel::naive, {1, 2, 1, 100, 130, 24}, layout::padded, causal{}, true);
  check_case<half>(cuda_kernel::automatic, {1, 2, 1, 100, 130, 24}, layout::padded, causal{}, true);
}

TEST_CASE("cuda flash_generic: zero extents and seq_kv 0", "[gpu][generic][errors]") {
  if (!have_device()) return;
  const problem p{2, 4, 2, 5, 0, 20};
  const std::vector<float> in(std::size_t(2 * 4 * 5 * 20), 0.5f);
  gpu::device_buffer<float> q(in), kv(std::vector<float>(1, 0.5f)), o(std::vector<float>(in.size(), 7.0f));
  gpu::device_buffer<float> lse(std::vector<float>(std::size_t(p.lse_size()), 3.0f));
  REQUIRE((q.ok() && kv.ok() && o.ok() && lse.ok()));
  const status st = gpu::attend_cuda<float>(cuda_kernel::flash_generic, p, bhsd<const float>(q.data(), p.q_dims()),
                                            bhsd<const float>(kv.data(), p.kv_dims()),
                                            bhsd<const float>(kv.data(), p.kv_dims()), bhsd<float>(o.data(), p.o_dims()),
                                            causal{}, lse.data());
  INFO(st.what());
  REQUIRE(st.ok());
  REQUIRE(gpu::synchronize().ok());
  std::vector<float> o_host(in.size()), lse_host(std::size_t(p.lse_size()));
  o.copy_to(o_host);
  lse.copy_to(lse_host);
  for (float x : o_host) CHECK(x == 0.0f);
  for (float x : lse_host) CHECK(x == -std::numeric_limits<float>::infinity());
}
