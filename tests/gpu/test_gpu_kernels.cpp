// The CUDA kernels against the float64 oracle (copied back to the host): flash and naive × dtype × mask × tail
// shapes × layouts, split-KV decode, block-sparse layouts, flash == naive and block_sparse(all) == flash on the
// device, the CUDA policy's error statuses, and run-to-run determinism.
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gpu_entry.hpp"
#include "support/check.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;
using fusedattn::policy::cuda_kernel;

namespace {

const char* kernel_name(cuda_kernel k) {
  return k == cuda_kernel::flash            ? "flash"
         : k == cuda_kernel::flash_mma_sync ? "flash (mma.sync)"
         : k == cuda_kernel::naive          ? "naive"
                                            : "automatic";
}

/// ‖x − ref‖₂ / ‖ref‖₂ over every element of the view: a relative check that stays strict when |O| is small.
template <class T>
double relative_error(const tensor_ref<T>& o, const std::vector<double>& ref) {
  double num = 0, den = 0;
  const dims4 d = o.dims;
  for (index_t b = 0; b < d.b; ++b)
    for (index_t h = 0; h < d.h; ++h)
      for (index_t i = 0; i < d.s; ++i)
        for (index_t c = 0; c < d.d; ++c) {
          const double x = static_cast<double>(o.row(b, h, i)[c]);
          const double r = ref[static_cast<std::size_t>(((b * d.h + h) * d.s + i) * d.d + c)];
          num += std::isnan(x) ? INFINITY : (x - r) * (x - r);
          den += r * r;
        }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

/// Bound on the relative error for a storage type, in units of its roundoff u = 2^-digits (f16 2^-11, bf16 2^-8):
/// 4u for 16-bit types (P and O are each rounded to the type once); f32 and f64 sum hundreds of products and
/// exponentials, so they get 128u of a far smaller u.
template <class T>
double relative_bound() {
  const double u = std::ldexp(1.0, -std::numeric_limits<T>::digits);
  return (sizeof(T) == 2 ? 4.0 : 128.0) * u;
}

/// True when every element of `now` outside the view `v` (the gaps of a padded layout) equals `before`.
template <class T>
bool gaps_untouched(const tensor_ref<T>& v, const std::vector<T>& now, const std::vector<T>& before) {
  std::vector<char> inside(now.size(), 0);
  for (index_t b = 0; b < v.dims.b; ++b)
    for (index_t h = 0; h < v.dims.h; ++h)
      for (index_t i = 0; i < v.dims.s; ++i)
        for (index_t c = 0; c < v.dims.d; ++c) inside[static_cast<std::size_t>(v.offset(b, h, i) + c)] = 1;
  for (std::size_t e = 0; e < now.size(); ++e)
    if (!inside[e] && static_cast<double>(now[e]) != static_cast<double>(before[e])) return false;
  return true;
}

/// Device copies of a case's Q, K, V and O and an lse buffer filled with `lse_fill`, with the case's views over them.
/// Tests that queue calls or run them from several threads make every call's copies first (their synchronous copies
/// would otherwise wait for the queued work); `read` copies O back into the case and returns lse.
template <class T>
struct device_copy {
  attention_case<T>& c;
  gpu::device_buffer<T> q, k, v, o;
  gpu::device_buffer<float> lse;
  device_copy(attention_case<T>& ca, float lse_fill)
      : c(ca), q(ca.q.buf), k(ca.k.buf), v(ca.v.buf), o(ca.o.buf),
        lse(std::vector<float>(static_cast<std::size_t>(ca.p.lse_size()), lse_fill)) {}
  bool ok() const { return q.ok() && k.ok() && v.ok() && o.ok() && lse.ok(); }
  tensor_ref<const T> qd() const { return gpu::on_device<const T>(c.q.cview(), c.q.buf.data(), q.data()); }
  tensor_ref<const T> kd() const { return gpu::on_device<const T>(c.k.cview(), c.k.buf.data(), k.data()); }
  tensor_ref<const T> vd() const { return gpu::on_device<const T>(c.v.cview(), c.v.buf.data(), v.data()); }
  tensor_ref<T> od() const { return gpu::on_device<T>(c.o.view, c.o.buf.data(), o.data()); }
  std::vector<float> read() const {
    o.copy_to(c.o.buf);
    std::vector<float> out(static_cast<std::size_t>(c.p.lse_size()));
    lse.copy_to(out);
    return out;
  }
};

/// Outputs of one kernel run on the device for a case (O copied back into the case's host buffer). With `uploaded`
/// the mask must be a block_sparse; its layout is uploaded once and passed as cuda::device_block_sparse. With
/// `graph_replays` > 0 the call is captured into a CUDA graph, which runs that many times (gpu::attend_cuda_graph).
template <class T>
std::vector<float> run_on_device(cuda_kernel kernel, attention_case<T>& c, const any_mask& mask, bool uploaded = false,
                                 int graph_replays = 0) {
  const problem& p = c.p;
  const device_copy<T> d(c, 123.0f);
  REQUIRE(d.ok());
  REQUIRE((!uploaded || std::holds_alternative<block_sparse>(mask)));
  float* lse = d.lse.data();
  const status st =
      graph_replays > 0 ? gpu::attend_cuda_graph<T>(kernel, p, d.qd(), d.kd(), d.vd(), d.od(), mask, lse, graph_replays,
                                                    uploaded)
      : uploaded ? gpu::attend_cuda_uploaded<T>(kernel, p, d.qd(), d.kd(), d.vd(), d.od(), std::get<block_sparse>(mask),
                                                lse)
                 : gpu::attend_cuda<T>(kernel, p, d.qd(), d.kd(), d.vd(), d.od(), mask, lse);
  INFO(st.what());
  REQUIRE(st.ok());
  const status sync = gpu::synchronize();
  INFO(sync.what());
  REQUIRE(sync.ok());
  return d.read();
}

/// O of a case (absolute tolerance of the CPU suite and a relative bound) and its lse against the float64 oracle.
template <class T>
void check_outputs(const attention_case<T>& c, const any_mask& mask, const std::vector<float>& lse) {
  const expected e = std::visit([&](const auto& m) { return expect(c, bind(m, c.p)); }, mask);
  const double err = max_abs_error(c.o.view, e.ref.o);
  INFO("max error " << err << " tolerance " << e.tolerance);
  CHECK(err <= e.tolerance);
  const double rel = relative_error(c.o.view, e.ref.o);
  INFO("relative error " << rel << " bound " << relative_bound<T>());
  CHECK(rel <= relative_bound<T>());
  const double lse_err = max_lse_error(lse, e.ref.lse);
  INFO("lse error " << lse_err << " tolerance " << e.lse_tolerance);
  CHECK(lse_err <= e.lse_tolerance);
}

/// One kernel on a fresh random case against the float64 oracle (check_outputs), and the gaps of a padded O left
/// alone.
template <class T>
void check_gpu(cuda_kernel kernel, const problem& p, layout l, const any_mask& mask, bool uploaded = false,
               int graph_replays = 0) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  attention_case<T> c(p, l, rng);
  INFO(kernel_name(kernel) << " " << scalar_name<T>() << " " << describe(p) << " " << describe(mask) << " "
                           << layout_name(l) << (uploaded ? " (device layout)" : "")
                           << (graph_replays > 0 ? " (in a CUDA graph)" : "") << " seed=" << seed);
  const std::vector<T> o_before = c.o.buf;
  check_outputs(c, mask, run_on_device(kernel, c, mask, uploaded, graph_replays));
  CHECK(gaps_untouched(c.o.view, c.o.buf, o_before));
}

/// Shapes for flash: every tile width (32, 64, 96, 128, 256; on a Hopper 192 too) and head_dims between them (8, 40,
/// 72, 80, 120, 136, 144, 176, 200, 248: the next tile, its columns past head_dim zero; on a Hopper those above 64
/// take the Hopper tile, 136–192 its 192 tile) with tails of its q-tile (128 rows; 64 at head_dim 256 on mma.sync)
/// and key tile (64, 80, 112 or 128 keys), s_q != s_kv both ways, seq 1, GQA and MQA.
std::vector<problem> flash_shapes() {
  return {
      {1, 1, 1, 1, 1, 64},       {1, 2, 2, 7, 7, 128},     {2, 3, 3, 127, 127, 64},  {1, 2, 1, 128, 128, 128},
      {1, 4, 2, 129, 300, 64},   {1, 2, 2, 1000, 1000, 128}, {1, 2, 2, 7, 1000, 128}, {1, 1, 1, 1000, 7, 64},
      {2, 4, 1, 33, 65, 128},    {1, 1, 1, 1, 300, 64},    {1, 2, 1, 257, 191, 128}, {1, 2, 2, 520, 520, 64},
      {1, 1, 1, 1, 1, 32},       {2, 4, 2, 129, 300, 32},  {1, 2, 1, 520, 127, 32},  {1, 2, 2, 7, 7, 96},
      {1, 4, 2, 300, 129, 96},   {2, 2, 1, 128, 513, 96},  {1, 1, 1, 1, 1, 256},     {1, 4, 2, 65, 200, 256},
      {1, 2, 1, 300, 64, 256},   {1, 2, 2, 129, 129, 256},  {1, 2, 2, 65, 130, 8},    {2, 4, 2, 129, 300, 40},
      {1, 4, 2, 300, 129, 80},   {1, 2, 1, 200, 77, 136},   {1, 2, 2, 70, 150, 200},  {2, 2, 2, 129, 65, 72},
      {1, 4, 2, 7, 1000, 120},   {1, 2, 1, 300, 333, 248},  {1, 4, 1, 1, 2000, 192},  {1, 2, 2, 129, 250, 144},
      {2, 3, 1, 130, 113, 176},  {1, 2, 1, 257, 225, 192},  {1, 2, 2, 1, 1, 192},
  };
}

}  // namespace

// `flash` is the Hopper (wgmma) kernel on an sm_90 device with sm_90a code, `flash_mma_sync` the portable one:
// on a Hopper both run here; elsewhere both are the mma.sync kernel.
TEMPLATE_TEST_CASE("cuda flash matches the float64 oracle", "[gpu][flash]", Eigen::half, Eigen::bfloat16) {
  const auto shapes = flash_shapes();
  const auto masks = all_masks();
  const layout layouts[] = {layout::bhsd, layout::bshd};
  const std::size_t shape_index = GENERATE(range<std::size_t>(0, 35));
  const cuda_kernel kernel = GENERATE(cuda_kernel::flash, cuda_kernel::flash_mma_sync);
  REQUIRE(shape_index < shapes.size());
  for (std::size_t m = 0; m < masks.size(); ++m)
    check_gpu<TestType>(kernel, shapes[shape_index], layouts[(shape_index + m) % 2], masks[m]);
}

TEMPLATE_TEST_CASE("cuda naive matches the float64 oracle", "[gpu][naive]", float, double, Eigen::half,
                   Eigen::bfloat16) {
  const auto shapes = tail_shapes();
  const auto masks = all_masks();
  const layout layouts[] = {layout::bhsd, layout::bshd, layout::padded};
  const std::size_t shape_index = GENERATE(range<std::size_t>(0, 10));
  REQUIRE(shape_index < shapes.size());
  for (std::size_t m = 0; m < masks.size(); ++m)
    check_gpu<TestType>(cuda_kernel::naive, shapes[shape_index], layouts[(shape_index + m) % 3], masks[m]);
}

TEMPLATE_TEST_CASE("cuda automatic: flash where it applies, flash_generic elsewhere, both right", "[gpu][automatic]",
                   Eigen::half, Eigen::bfloat16, float) {
  // head_dim 20 and f32 take flash_generic; 16-bit padded rows (stride d + 3) flash on aligned copies; bhsd flash.
  check_gpu<TestType>(cuda_kernel::automatic, {1, 2, 1, 100, 130, 128}, layout::padded, causal{});
  check_gpu<TestType>(cuda_kernel::automatic, {1, 2, 2, 100, 130, 80}, layout::bhsd, dense{});
  check_gpu<TestType>(cuda_kernel::automatic, {1, 2, 2, 100, 130, 20}, layout::bhsd, dense{});
  check_gpu<TestType>(cuda_kernel::automatic, {2, 2, 2, 100, 130, 128}, layout::bhsd, window{7, 2});
  // rows of stride d + 3 at head_dims of the Hopper tiles: 16-bit types on aligned copies, f32 on flash_generic
  check_gpu<TestType>(cuda_kernel::automatic, {1, 4, 2, 129, 300, 72}, layout::padded, causal{align::bottom_right});
  check_gpu<TestType>(cuda_kernel::automatic, {1, 2, 1, 300, 77, 160}, layout::padded, window{30, 5});
}

TEMPLATE_TEST_CASE("cuda flash == naive on larger shapes", "[gpu][flash][naive]", Eigen::half, Eigen::bfloat16) {
  const problem shapes[] = {{1, 8, 2, 2048, 2048, 128}, {2, 4, 4, 1500, 3000, 64}, {1, 4, 1, 4096, 4096, 128},
                            {1, 4, 2, 1500, 2500, 32},  {1, 4, 4, 2048, 1500, 96}, {1, 4, 2, 1500, 1500, 256}};
  const any_mask masks[] = {dense{}, causal{align::bottom_right}, window{256, 0},
                            causal{align::bottom_right}, dense{}, window{300, 20}};
  for (int i = 0; i < 6; ++i) {
    const problem& p = shapes[i];
    const std::uint64_t seed = fresh_seed();
    std::mt19937_64 rng(seed);
    attention_case<TestType> c(p, layout::bhsd, rng);
    INFO(describe(p) << " " << describe(masks[i]) << " seed=" << seed);
    const std::vector<float> lse_flash = run_on_device(cuda_kernel::flash, c, masks[i]);
    std::vector<double> flash_o(c.o.buf.size());
    for (std::size_t e = 0; e < flash_o.size(); ++e) flash_o[e] = static_cast<double>(c.o.buf[e]);
    const std::vector<float> lse_naive = run_on_device(cuda_kernel::naive, c, masks[i]);
    const double rel = relative_error(c.o.view, flash_o);
    INFO("relative difference " << rel);
    CHECK(rel <= 2 * relative_bound<TestType>());
    std::vector<double> lse_ref(lse_naive.begin(), lse_naive.end());
    CHECK(max_lse_error(lse_flash, lse_ref) <= 1e-4);
  }
}

// Unmasked head_dim 64 calls with at least two rounds of work items (hopper_takes_turns_tile): on a Hopper
// three consumer warpgroups of 64 rows (192-row blocks) that take turns on the tensor cores. 288–352 items, so the
// persistent grid's blocks walk two or three items each (the turns go on from item to item); tails of the 192-row
// block (2049 = 10·192 + 129, 400, 200) and of the 128-key tile (300, 333, 33 keys), GQA, MQA-like groups, padded
// strides.
TEMPLATE_TEST_CASE("cuda flash without a mask at head_dim 64 and many work items matches the float64 oracle",
                   "[gpu][flash]", Eigen::half, Eigen::bfloat16) {
  const problem shapes[] = {{1, 32, 4, 2049, 300, 64}, {8, 12, 3, 400, 333, 64}, {3, 48, 16, 200, 33, 64}};
  const layout layouts[] = {layout::bshd, layout::bhsd, layout::padded16};
  for (int i = 0; i < 3; ++i) check_gpu<TestType>(cuda_kernel::flash, shapes[i], layouts[i], dense{});
}

TEMPLATE_TEST_CASE("cuda flash decode (split-KV parts merged by lse) matches the float64 oracle", "[gpu][flash][decode]",
                   Eigen::half, Eigen::bfloat16) {
  const problem shapes[] = {{1, 4, 1, 1, 4000, 128}, {2, 2, 2, 3, 2999, 64}, {1, 8, 2, 16, 1500, 128},
                            {1, 1, 1, 1, 513, 64},   {1, 2, 2, 100, 4100, 128}, {1, 4, 2, 1, 3001, 32},
                            {2, 2, 1, 5, 1999, 96},  {1, 4, 2, 1, 2500, 256},  {1, 2, 2, 40, 1300, 256}};
  for (const problem& p : shapes)
    for (const any_mask& m : all_masks()) check_gpu<TestType>(cuda_kernel::flash, p, layout::bshd, m);
}

// Split-KV parts come from fusedattn's scratch pool, which keeps them mapped after the call; trim_scratch gives
// them back, and the next call maps them again and is still right.
TEST_CASE("cuda scratch pool: kept after a split-KV call, given back by trim_scratch", "[gpu][flash][decode]") {
  const problem p{1, 4, 1, 1, 4000, 128};  // one q-block per head, 4000 keys: split into parts
  check_gpu<Eigen::half>(cuda_kernel::flash, p, layout::bshd, dense{});
  std::size_t kept = 0;
  REQUIRE(gpu::scratch_reserved(kept).ok());
  CHECK(kept > 0);
  REQUIRE(gpu::trim_scratch(0).ok());
  std::size_t after = 1;
  REQUIRE(gpu::scratch_reserved(after).ok());
  CHECK(after == 0);
  check_gpu<Eigen::bfloat16>(cuda_kernel::flash, p, layout::bhsd, causal{align::bottom_right});
  REQUIRE(gpu::scratch_reserved(kept).ok());
  CHECK(kept > 0);
}

// Strides with gaps after every row, head and batch, all multiples of 16 bytes, so flash (and on a Hopper its TMA
// copies of Q, K, V and its TMA stores of O) takes them: the gaps of O must stay as they were.
TEMPLATE_TEST_CASE("cuda flash on padded 16-byte strides leaves the gaps of O alone", "[gpu][flash]", Eigen::half,
                   Eigen::bfloat16) {
  const problem shapes[] = {{2, 3, 3, 127, 127, 64}, {1, 2, 1, 257, 191, 128}, {2, 4, 2, 129, 300, 128},
                            {1, 4, 2, 65, 200, 256}, {1, 270, 2, 3, 40, 128}, {2, 4, 2, 129, 300, 96}};
  for (const problem& p : shapes)
    for (const any_mask& m : all_masks()) check_gpu<TestType>(cuda_kernel::flash, p, layout::padded16, m);
  for (const any_mask& m : all_masks())
    check_gpu<TestType>(cuda_kernel::flash_mma_sync, problem{1, 2, 1, 257, 191, 128}, layout::padded16, m);
}

TEST_CASE("cuda small shapes of every kernel (the compute-sanitizer run)", "[gpu][sanitize]") {
  const problem p{1, 2, 1, 70, 131, 64}, p128{1, 2, 2, 65, 97, 128}, decode{1, 2, 1, 1, 1100, 128};
  const problem p32{1, 2, 1, 130, 70, 32}, p96{1, 2, 2, 70, 131, 96}, p256{1, 2, 1, 70, 131, 256},
      decode256{1, 2, 2, 1, 700, 256}, decode96{1, 2, 2, 1, 900, 96}, p72{1, 2, 1, 70, 131, 72},
      p160{1, 2, 2, 65, 97, 160}, decode200{1, 2, 1, 1, 900, 200};
  for (const any_mask& m : all_masks()) {
    check_gpu<Eigen::half>(cuda_kernel::flash, decode, layout::bhsd, m);
    check_gpu<Eigen::half>(cuda_kernel::flash, p, layout::bhsd, m);
    check_gpu<Eigen::bfloat16>(cuda_kernel::flash, p128, layout::bshd, m);
    check_gpu<Eigen::half>(cuda_kernel::flash, p128, layout::padded16, m);
    check_gpu<Eigen::half>(cuda_kernel::flash, p32, layout::bshd, m);
    check_gpu<Eigen::bfloat16>(cuda_kernel::flash, p96, layout::bhsd, m);
    // head_dim 96 runs the Hopper 128 tile: rows padded past 96 (read as zeros by its maps, never written), and
    // split-KV parts of 128 columns merged into 96.
    check_gpu<Eigen::half>(cuda_kernel::flash, p96, layout::padded16, m);
    check_gpu<Eigen::bfloat16>(cuda_kernel::flash, decode96, layout::bshd, m);
    check_gpu<Eigen::half>(cuda_kernel::flash, p256, layout::bshd, m);
    check_gpu<Eigen::bfloat16>(cuda_kernel::flash, decode256, layout::bhsd, m);
    // head_dim 72 and 160 on the Hopper 128 and 192 tiles (columns past head_dim read as zeros), split-KV at 200.
    check_gpu<Eigen::half>(cuda_kernel::flash, p72, layout::bhsd, m);
    check_gpu<Eigen::bfloat16>(cuda_kernel::flash, p160, layout::padded16, m);
    check_gpu<Eigen::half>(cuda_kernel::flash, decode200, layout::bshd, m);
    check_gpu<Eigen::bfloat16>(cuda_kernel::flash_mma_sync, p128, layout::bshd, m);
    check_gpu<Eigen::half>(cuda_kernel::naive, p, layout::padded, m);
    check_gpu<double>(cuda_kernel::naive, p128, layout::bhsd, m);
  }
  // Unmasked head_dim 64 with 396 work items: on a Hopper three warpgroups taking turns, three items a block.
  check_gpu<Eigen::half>(cuda_kernel::flash, problem{1, 132, 2, 385, 40, 64}, layout::bshd, dense{});
  // More work items than blocks: on a Hopper the persistent grid (132 blocks) walks 3 items in most blocks, so both
  // Q buffers and the K/V buffers are reused across items (dense head by head, causal q-block first in a snake).
  const problem many{1, 270, 2, 3, 40, 128};
  check_gpu<Eigen::half>(cuda_kernel::flash, many, layout::bshd, dense{});
  check_gpu<Eigen::bfloat16>(cuda_kernel::flash, many, layout::bshd, causal{align::bottom_right});
  // More than 8 items a block under a causal mask (1080 items of up to two key tiles): one block per item.
  check_gpu<Eigen::half>(cuda_kernel::flash, problem{1, 540, 2, 129, 200, 128}, layout::bshd, causal{});
  // 270 items of 0 to 5 key tiles, one or two a block (the persistent grid carrying its buffers from item to item).
  const block_layout walk = random_layout(block_geometry{8, 600, 128, 128, 1, 270}, 0.6, fresh_seed());
  check_gpu<Eigen::bfloat16>(cuda_kernel::flash, problem{1, 270, 2, 8, 600, 128}, layout::bshd, block_sparse{walk});
  const problem ps{1, 2, 2, 256, 300, 128};
  const block_layout layout = random_layout(block_geometry{256, 300, 128, 32, 1, 2}, 0.5, fresh_seed());
  check_gpu<Eigen::half>(cuda_kernel::flash, ps, layout::bhsd, block_sparse{layout, causal{}});
  check_gpu<Eigen::half>(cuda_kernel::flash, ps, layout::bhsd, block_sparse{layout, window{40, 10}}, true);
  check_gpu<Eigen::half>(cuda_kernel::naive, ps, layout::bhsd, block_sparse{layout});
}

TEST_CASE("cuda: host pointers and unsupported cases are statuses, nothing written", "[gpu][errors]") {
  const problem p{1, 1, 1, 16, 16, 64};
  std::mt19937_64 rng(fresh_seed());
  attention_case<Eigen::half> c(p, layout::bhsd, rng);
  const std::vector<Eigen::half> before = c.o.buf;
  // Host memory handed to the CUDA policy.
  status st = gpu::attend_cuda<Eigen::half>(cuda_kernel::automatic, p, c.q.cview(), c.k.cview(), c.v.cview(),
                                            c.o.view, dense{}, nullptr);
  CHECK(st.code() == errc::invalid_argument);
  CHECK(std::string(st.what()).find("q.data is not device memory") != std::string::npos);
  CHECK(unchanged(c.o.buf, before));
  // Device q, k, v, o but a host lse.
  gpu::device_buffer<Eigen::half> q(c.q.buf), k(c.k.buf), v(c.v.buf), o(c.o.buf);
  std::vector<float> lse(16);
  st = gpu::attend_cuda<Eigen::half>(cuda_kernel::flash, p, bhsd<const Eigen::half>(q.data(), p.q_dims()),
                                     bhsd<const Eigen::half>(k.data(), p.kv_dims()),
                                     bhsd<const Eigen::half>(v.data(), p.kv_dims()), bhsd(o.data(), p.o_dims()),
                                     causal{}, lse.data());
  CHECK(st.code() == errc::invalid_argument);
  CHECK(std::string(st.what()).find("lse.data") != std::string::npos);
  // The reverse: device memory handed to a CPU policy (from a translation unit built with the backend).
  {
    attention_case<float> cf(p, layout::bhsd, rng);
    gpu::device_buffer<float> qf(cf.q.buf), kf(cf.k.buf), vf(cf.v.buf), of(cf.o.buf);
    const std::vector<float> o_before = cf.o.buf;
    st = gpu::attend_cpu_naive(p, bhsd<const float>(qf.data(), p.q_dims()), cf.k.cview(), cf.v.cview(), cf.o.view,
                               nullptr);
    CHECK(st.code() == errc::invalid_argument);
    CHECK(std::string(st.what()).find("q.data is device memory") != std::string::npos);
    st = gpu::attend_cpu_naive(p, cf.q.cview(), cf.k.cview(), cf.v.cview(), bhsd(of.data(), p.o_dims()), nullptr);
    CHECK(st.code() == errc::invalid_argument);
    CHECK(std::string(st.what()).find("o.data is device memory") != std::string::npos);
    std::vector<float> o_back(cf.o.buf.size());
    of.copy_to(o_back);
    CHECK(o_back == o_before);
    CHECK(cf.o.buf == o_before);
    // Host memory still runs there.
    CHECK(gpu::attend_cpu_naive(p, cf.q.cview(), cf.k.cview(), cf.v.cview(), cf.o.view, nullptr).ok());
  }
  // Flash asked for where it does not apply: head_dim 20 (not a multiple of 8), f32.
  const problem p20{1, 1, 1, 16, 16, 20};
  gpu::device_buffer<Eigen::half> big(std::vector<Eigen::half>(16 * 24 * 4, Eigen::half(0.5f)));
  Eigen::half* base = big.data();
  st = gpu::attend_cuda<Eigen::half>(cuda_kernel::flash, p20, bhsd<const Eigen::half>(base, p20.q_dims()),
                                     bhsd<const Eigen::half>(base + 16 * 24, p20.kv_dims()),
                                     bhsd<const Eigen::half>(base + 32 * 24, p20.kv_dims()),
                                     bhsd(base + 48 * 24, p20.o_dims()), dense{}, nullptr);
  CHECK(st.code() == errc::unsupported);
  CHECK(std::string(st.what()).find("head_dim is 20") != std::string::npos);
  gpu::device_buffer<float> f(std::vector<float>(16 * 64 * 4, 0.5f));
  st = gpu::attend_cuda<float>(cuda_kernel::flash, p, bhsd<const float>(f.data(), p.q_dims()),
                               bhsd<const float>(f.data() + 16 * 64, p.kv_dims()),
                               bhsd<const float>(f.data() + 32 * 64, p.kv_dims()), bhsd(f.data() + 48 * 64, p.o_dims()),
                               dense{}, nullptr);
  CHECK(st.code() == errc::unsupported);
  CHECK(std::string(st.what()).find("f16 and bf16") != std::string::npos);
  // Block-sparse with a q-block smaller than flash's q-tile: flash says why not (automatic runs flash_generic).
  const block_layout small_blocks = dense_layout(block_geometry{16, 16, 16, 16, 1, 1});
  st = gpu::attend_cuda<Eigen::half>(cuda_kernel::flash, p, bhsd<const Eigen::half>(q.data(), p.q_dims()),
                                     bhsd<const Eigen::half>(k.data(), p.kv_dims()),
                                     bhsd<const Eigen::half>(v.data(), p.kv_dims()), bhsd(o.data(), p.o_dims()),
                                     block_sparse{small_blocks}, nullptr);
  CHECK(st.code() == errc::unsupported);
  CHECK(std::string(st.what()).find("block_q") != std::string::npos);
  // Device layouts: a malformed layout is refused by upload; an empty device layout and one built for another
  // sequence length are refused by attend, nothing written.
  const std::vector<index_t> offsets{0, 2};
  const std::vector<block_index> unsorted{1, 0};
  block_layout_view bad;
  bad.geometry = block_geometry{64, 128, 64, 64, 1, 1};
  bad.row_offsets = offsets.data();
  bad.n_row_offsets = 2;
  bad.cols = unsorted.data();
  bad.n_cols = 2;
  st = gpu::upload_status(bad);
  CHECK(st.code() == errc::invalid_argument);
  CHECK(std::string(st.what()).find("cols[1]") != std::string::npos);
  const auto q16 = bhsd<const Eigen::half>(q.data(), p.q_dims()), k16 = bhsd<const Eigen::half>(k.data(), p.kv_dims()),
             v16 = bhsd<const Eigen::half>(v.data(), p.kv_dims());
  const auto o16 = bhsd(o.data(), p.o_dims());
  const block_layout fits = dense_layout(block_geometry{16, 16, 64, 64, 1, 1});
  st = gpu::attend_cuda_uploaded<Eigen::half>(cuda_kernel::automatic, p, q16, k16, v16, o16, block_sparse{fits}, nullptr,
                                              true);
  CHECK(st.code() == errc::invalid_argument);
  CHECK(std::string(st.what()).find("empty") != std::string::npos);
  const block_layout other = dense_layout(block_geometry{32, 16, 64, 64, 1, 1});
  st = gpu::attend_cuda_uploaded<Eigen::half>(cuda_kernel::automatic, p, q16, k16, v16, o16, block_sparse{other}, nullptr);
  CHECK(st.code() == errc::invalid_argument);
  CHECK(std::string(st.what()).find("device_block_sparse.layout.seq_q is 32") != std::string::npos);
  std::vector<Eigen::half> o_after(c.o.buf.size());
  o.copy_to(o_after);
  CHECK(unchanged(o_after, c.o.buf));
  REQUIRE(gpu::synchronize().ok());
}

TEMPLATE_TEST_CASE("cuda block-sparse (flash and naive) matches the float64 oracle", "[gpu][block_sparse]",
                   Eigen::half, Eigen::bfloat16) {
  struct sparse_case {
    problem p;
    index_t block_q, block_kv;
    bool per_head;
    double sparsity;
  };
  // block_kv 32 < the 64/128-key tile: several runs share a tile (visited once per run, each visit counting only
  // its run's keys: nothing may be counted twice or missed); per-head and
  // shared patterns; tails in both sequences.
  // Every head_dim; block_q 64 only at head_dim 256 (the portable kernel's q-tile is 64 rows there; the Hopper
  // kernel's is 128, so flash on a Hopper runs block_q 64 on the portable kernel and block_q 128 on its own).
  const sparse_case cases[] = {{{1, 2, 2, 300, 520, 128}, 128, 64, true, 0.5},
                               {{2, 4, 2, 256, 700, 64}, 128, 128, false, 0.7},
                               {{1, 2, 1, 129, 323, 128}, 256, 32, true, 0.3},
                               {{1, 2, 2, 384, 1000, 64}, 384, 96, true, 0.6},
                               {{1, 2, 1, 300, 520, 32}, 128, 32, true, 0.5},
                               {{1, 2, 2, 256, 333, 96}, 128, 96, false, 0.5},
                               {{1, 2, 1, 200, 390, 256}, 64, 32, true, 0.5},
                               {{1, 2, 2, 300, 333, 256}, 128, 96, true, 0.5}};
  const block_sparse::element_rule withins[] = {dense{}, causal{}, window{40, 10}};
  for (const sparse_case& c : cases)
    for (const auto& within : withins) {
      const block_geometry g{c.p.seq_q, c.p.seq_kv, c.block_q, c.block_kv, 1, c.per_head ? c.p.heads : 1};
      const block_layout layout = random_layout(g, c.sparsity, fresh_seed());
      // The same blocks without the merged runs (a hand-made view): one segment per block.
      block_layout_view no_runs = layout.view();
      no_runs.run_offsets = nullptr;
      no_runs.runs = nullptr;
      no_runs.n_run_offsets = no_runs.n_runs = 0;
      for (cuda_kernel kernel : {cuda_kernel::flash, cuda_kernel::flash_mma_sync, cuda_kernel::naive})
        for (bool uploaded : {false, true}) {
          check_gpu<TestType>(kernel, c.p, layout::bshd, block_sparse{layout, within}, uploaded);
          if (kernel != cuda_kernel::naive)
            check_gpu<TestType>(kernel, c.p, layout::bshd, block_sparse{no_runs, within}, uploaded);
        }
    }
  // q-blocks smaller than flash's q-tile: automatic takes flash_generic, still right.
  const problem p{1, 2, 2, 200, 200, 64};
  const block_layout small = random_layout(block_geometry{200, 200, 64, 64, 1, 2}, 0.5, fresh_seed());
  check_gpu<TestType>(cuda_kernel::automatic, p, layout::bhsd, block_sparse{small, causal{}});
}

TEMPLATE_TEST_CASE("cuda flash with more work items than blocks (the Hopper kernel's persistent grid)",
                   "[gpu][flash][block_sparse]", Eigen::half, Eigen::bfloat16) {
  // On a Hopper, head_dim 128 and 256 run one block per SM, each walking work items (q-block, head) in turn (no
  // mask, block-sparse: head by head; causal and window with at most 8 items a block: q-block first, dealt in a
  // snake; hopper_schedule_for): these shapes give 1–3 items a block, q-tails, GQA, items of a block-sparse layout
  // with no listed block (O = 0, lse = −inf) between items with some; the third has more than 8 items a block on
  // 132 SMs (1200 items: dense 9–10 a block, causal and window one block per item).
  const problem shapes[] = {{1, 96, 16, 260, 130, 128}, {1, 48, 8, 260, 100, 256}, {1, 600, 4, 129, 40, 128}};
  for (const problem& p : shapes) {
    for (const any_mask& m : all_masks()) check_gpu<TestType>(cuda_kernel::flash, p, layout::bshd, m);
    const block_geometry g{p.seq_q, p.seq_kv, 128, 64, 1, p.heads};
    const block_layout layout = random_layout(g, 0.8, fresh_seed());
    for (bool uploaded : {false, true})
      check_gpu<TestType>(cuda_kernel::flash, p, layout::bhsd, block_sparse{layout, causal{}}, uploaded);
  }
}

// head_dim 136–192 on a Hopper: the 192 tile (three 64-column panels, 112-key tiles; P·V as products of 128 and 64
// columns), with columns past head_dim read as zeros below 192. Every mask on a persistent grid of 2–3 items a block
// (q-tails: 260 = 2·128 + 4; key tails: 230 = 2·112 + 6, 337 = 3·112 + 1), GQA 6:1 and 2:1, O in padded rows;
// block-sparse layouts (host and device) of 80 % dropped blocks; causal and window calls of more than 8
// items a block (one block per item); split-KV decode (parts of 192 columns merged into 152); lse throughout.
TEMPLATE_TEST_CASE("cuda flash at head_dim 136 to 192 (the Hopper 192 tile) matches the float64 oracle",
                   "[gpu][flash][block_sparse]", Eigen::half, Eigen::bfloat16) {
  const problem shapes[] = {{1, 96, 16, 260, 230, 192}, {1, 48, 8, 200, 337, 160}, {2, 12, 6, 260, 130, 136}};
  const layout layouts[] = {layout::bshd, layout::bhsd, layout::padded16};
  for (std::size_t i = 0; i < 3; ++i) {
    const problem& p = shapes[i];
    const auto masks = all_masks();
    for (std::size_t m = 0; m < masks.size(); ++m)
      check_gpu<TestType>(cuda_kernel::flash, p, layouts[(i + m) % 3], masks[m]);
    const block_geometry g{p.seq_q, p.seq_kv, 128, 64, 1, p.heads};
    const block_layout layout = random_layout(g, 0.8, fresh_seed());
    for (bool uploaded : {false, true})
      check_gpu<TestType>(cuda_kernel::flash, p, layout::bhsd, block_sparse{layout, causal{}}, uploaded);
  }
  const problem many{1, 560, 2, 130, 100, 184};  // 1120 items
  check_gpu<TestType>(cuda_kernel::flash, many, layout::bshd, causal{align::bottom_right});
  check_gpu<TestType>(cuda_kernel::flash, many, layout::bhsd, window{40, 10});
  check_gpu<TestType>(cuda_kernel::flash, problem{1, 4, 1, 1, 3000, 152}, layout::bhsd, causal{align::bottom_right});
}

// Causal and window calls with more than 8 items a block on 132 SMs: on a Hopper one block per item
// (hopper_schedule_for), items of several key tiles, q-tails, GQA; head_dim 128 (two Q buffers) and 256 (one).
TEST_CASE("cuda flash: causal and window calls of more than 8 items a block", "[gpu][flash]") {
  const problem d128{1, 540, 4, 140, 260, 128}, d256{1, 560, 2, 130, 100, 256};  // 1080 and 1120 items
  check_gpu<Eigen::half>(cuda_kernel::flash, d128, layout::bshd, causal{});
  check_gpu<Eigen::bfloat16>(cuda_kernel::flash, d128, layout::bhsd, window{100, 30, align::bottom_right});
  check_gpu<Eigen::bfloat16>(cuda_kernel::flash, d256, layout::bshd, causal{align::bottom_right});
}

// On a Hopper, the persistent grid's blocks walk items of 0 to 6 key tiles in turn (the K and V buffers, their
// barriers' phases and the two Q buffers carried from item to item), items without a key tile between items with
// some; head_dim 128 and the whole-row head_dim 64 tile (128-key tiles); a causal and a window walk of 1 to 3 tiles;
// diagonal tiles masked per element (band32::columns). Enough items that no call splits the keys.
TEMPLATE_TEST_CASE("cuda flash: items of one to many key tiles in turn in a block",
                   "[gpu][flash][block_sparse]", Eigen::half, Eigen::bfloat16) {
  const problem d128{1, 280, 4, 20, 400, 128}, d64{1, 100, 4, 140, 400, 64}, banded{1, 52, 4, 260, 260, 128};
  check_gpu<TestType>(cuda_kernel::flash, d128, layout::bshd, dense{});    // 280 items of 4 key tiles
  check_gpu<TestType>(cuda_kernel::flash, d64, layout::bhsd, dense{});     // 200 items of 4 key tiles
  check_gpu<TestType>(cuda_kernel::flash, banded, layout::bshd, causal{});  // 156 items of 1 to 3 key tiles
  check_gpu<TestType>(cuda_kernel::flash, banded, layout::bhsd, window{150, 0, align::bottom_right});
  // Window edges far past the sequences (band32 clamps them; band32::columns adds them to rows in int).
  const problem small{1, 2, 2, 260, 300, 128};
  check_gpu<TestType>(cuda_kernel::flash, small, layout::bshd, window{index_t(1) << 40, 3});
  check_gpu<TestType>(cuda_kernel::flash, small, layout::bshd, window{5, index_t(1) << 40, align::bottom_right});
  const problem sparse{1, 270, 2, 16, 768, 128};  // 270 items of 0 to 6 key tiles
  const block_layout layout = random_layout(block_geometry{16, 768, 128, 128, 1, 270}, 0.6, fresh_seed());
  for (bool uploaded : {false, true})
    check_gpu<TestType>(cuda_kernel::flash, sparse, layout::bshd, block_sparse{layout}, uploaded);
  check_gpu<TestType>(cuda_kernel::flash, sparse, layout::bhsd, block_sparse{layout, causal{align::bottom_right}});
}

// Causal and window head_dim 64 calls of many items. On a Hopper with 132 SMs: 396 items of 192 rows (at most 8
// rounds) stay on the two-blocks-per-SM kernel, one block per 128-row q-block (the same shape on the
// three-warpgroup turns tile passes too); 1120 items of 192 rows (more than 8 rounds) take the
// turns tile for causal, one block per item (hopper_takes_turns_tile), with q-tails (200 = 192 + 8), keys past the
// queries on both alignments and GQA, and 1080 items bottom-right with more queries than keys (the first 300 rows
// see no key: items without a key tile, O = 0 and lse = −inf); the window stays on the two-blocks kernel.
TEST_CASE("cuda flash: causal and window head_dim 64 calls of many items", "[gpu][flash]") {
  const problem p{1, 132, 2, 385, 385, 64};
  check_gpu<Eigen::half>(cuda_kernel::flash, p, layout::bshd, causal{});
  check_gpu<Eigen::bfloat16>(cuda_kernel::flash, p, layout::bhsd, causal{align::bottom_right});
  check_gpu<Eigen::half>(cuda_kernel::flash, p, layout::bshd, window{100, 20});
  const problem many{1, 560, 4, 200, 330, 64};
  check_gpu<Eigen::bfloat16>(cuda_kernel::flash, many, layout::bshd, causal{});
  check_gpu<Eigen::half>(cuda_kernel::flash, many, layout::bhsd, causal{align::bottom_right});
  check_gpu<Eigen::half>(cuda_kernel::flash, many, layout::bshd, window{150, 0, align::bottom_right});
  check_gpu<Eigen::bfloat16>(cuda_kernel::flash, problem{1, 360, 4, 400, 100, 64}, layout::bshd,
                             causal{align::bottom_right});
}

// On a Hopper the warp-specialised kernel's persistent grid carries its two Q buffers, its deferred O stores and its
// K/V buffers from item to item; an item without key tiles still takes a Q buffer, ends at once (O = 0, lse = −inf)
// and passes the buffer on. Blocks of about 7 items each, with runs of items without a key tile between the others
// (block-sparse rows with no block; causal bottom-right q-blocks above the first key, dealt q-block first), lse
// checked with O.
TEST_CASE("cuda flash: items without key tiles among others on the persistent grid", "[gpu][flash][block_sparse]") {
  const block_geometry g{300, 96, 128, 32, 1, 300};  // 3 q-blocks and 3 key blocks a head, 900 items
  std::mt19937_64 rng(fresh_seed());
  std::vector<char> active(static_cast<std::size_t>(g.patterns() * g.n_q_blocks() * g.n_kv_blocks()), 0);
  for (std::size_t row = 0; row < active.size() / 3; ++row) {
    if (rng() % 2 == 0) continue;  // half the rows have no block
    const unsigned bits = 1 + static_cast<unsigned>(rng() % 7);
    for (unsigned kb = 0; kb < 3; ++kb) active[row * 3 + kb] = (bits >> kb) & 1;
  }
  const block_layout layout = layout_from_block_mask(g, active);
  check_gpu<Eigen::half>(cuda_kernel::flash, problem{1, 300, 3, 300, 96, 128}, layout::bshd, block_sparse{layout});
  // 1000 items (at most 8 a block: the persistent grid), the first two q-blocks of each head without a key.
  check_gpu<Eigen::bfloat16>(cuda_kernel::flash, problem{1, 250, 2, 400, 100, 128}, layout::bhsd,
                             causal{align::bottom_right});
}

// Block-sparse calls with a layout copied per call, queued behind a 20 ms kernel with no synchronisation between
// them: each call's host layout is freed as soon as the call returns, while the device has not yet run its copy;
// layouts of different sizes, each call with its own inputs and outputs.
TEST_CASE("cuda block_sparse: layouts copied per call by many calls queued at once", "[gpu][block_sparse]") {
  using T = Eigen::half;
  const problem p{1, 4, 2, 300, 700, 128};
  const block_geometry g{300, 700, 128, 64, 1, 4};
  constexpr int calls = 13;
  std::vector<std::uint64_t> seeds;
  std::vector<std::unique_ptr<attention_case<T>>> cases;
  std::vector<std::unique_ptr<device_copy<T>>> copies;  // every call's, first (device_copy)
  const auto sparsity = [](int i) { return 0.1 + 0.8 * (i % 5) / 4.0; };
  for (int i = 0; i < calls; ++i) {
    seeds.push_back(fresh_seed());
    std::mt19937_64 rng(seeds.back());
    cases.push_back(std::make_unique<attention_case<T>>(p, layout::bshd, rng));
    copies.push_back(std::make_unique<device_copy<T>>(*cases.back(), 7.0f));
    REQUIRE(copies.back()->ok());
  }
  REQUIRE(gpu::synchronize().ok());
  REQUIRE(gpu::spin(20000).ok());
  for (int i = 0; i < calls; ++i) {
    const device_copy<T>& d = *copies[std::size_t(i)];
    const block_layout passed = random_layout(g, sparsity(i), seeds[std::size_t(i)]);  // freed when the call returns
    const status st = gpu::attend_cuda<T>(cuda_kernel::flash, p, d.qd(), d.kd(), d.vd(), d.od(), block_sparse{passed},
                                          d.lse.data());
    INFO(st.what());
    REQUIRE(st.ok());
  }
  const status sync = gpu::synchronize();
  INFO(sync.what());
  REQUIRE(sync.ok());
  for (int i = 0; i < calls; ++i) {
    const block_layout layout = random_layout(g, sparsity(i), seeds[std::size_t(i)]);  // the same again, for the oracle
    INFO("call " << i << " of " << calls << ", " << layout.view().n_cols << " listed blocks, seed "
                 << seeds[std::size_t(i)]);
    check_outputs(*cases[std::size_t(i)], block_sparse{layout}, copies[std::size_t(i)]->read());
  }
}

// Calls captured into a CUDA graph on a stream of their own, the graph then run twice (O and lse set to NaN between
// the runs): the Hopper kernels (the warp-specialised one on a persistent grid and with one block per item, the
// two-blocks one), split-KV decode (its scratch an allocation node of the graph), the portable kernel, the naive
// cuBLAS pipeline, and block-sparse through an uploaded layout. A layout copied per call cannot be captured (the
// graph would copy from the call's freed buffer): refused, nothing written.
TEMPLATE_TEST_CASE("cuda calls captured into a CUDA graph match the float64 oracle", "[gpu][graph]", Eigen::half,
                   Eigen::bfloat16) {
  check_gpu<TestType>(cuda_kernel::flash, problem{1, 8, 2, 300, 520, 128}, layout::bshd, dense{}, false, 2);
  check_gpu<TestType>(cuda_kernel::flash, problem{2, 4, 4, 300, 300, 64}, layout::bhsd, causal{}, false, 2);
  // 1080 causal items, more than 8 a block of a persistent grid: on a Hopper one block per item.
  check_gpu<TestType>(cuda_kernel::flash, problem{1, 540, 2, 129, 200, 128}, layout::bshd, causal{}, false, 2);
  check_gpu<TestType>(cuda_kernel::flash, problem{1, 4, 1, 1, 6000, 64}, layout::bhsd, dense{}, false, 2);
  check_gpu<TestType>(cuda_kernel::flash_mma_sync, problem{1, 2, 2, 129, 300, 128}, layout::bshd, window{40, 10},
                      false, 2);
  check_gpu<TestType>(cuda_kernel::naive, problem{1, 2, 1, 200, 333, 64}, layout::bhsd, causal{align::bottom_right},
                      false, 2);
  const problem sp{1, 2, 2, 300, 520, 128};
  const block_layout layout = random_layout(block_geometry{300, 520, 128, 128, 1, 2}, 0.5, fresh_seed());
  check_gpu<TestType>(cuda_kernel::flash, sp, layout::bshd, block_sparse{layout, causal{}}, true, 2);

  std::mt19937_64 rng(fresh_seed());
  attention_case<TestType> c(sp, layout::bshd, rng);
  const device_copy<TestType> d(c, 123.0f);
  REQUIRE(d.ok());
  const status st = gpu::attend_cuda_graph<TestType>(cuda_kernel::flash, sp, d.qd(), d.kd(), d.vd(), d.od(),
                                                     block_sparse{layout}, d.lse.data(), 1);
  INFO(st.what());
  CHECK(st.code() == errc::unsupported);
  CHECK(std::string(st.what()).find("cuda::upload") != std::string::npos);
  REQUIRE(gpu::synchronize().ok());
  const std::vector<TestType> o_before = c.o.buf;
  const std::vector<float> lse_back = d.read();
  CHECK(c.o.buf == o_before);
  CHECK(lse_back == std::vector<float>(lse_back.size(), 123.0f));
}

// Calls from four host threads at once, each on a stream of its own, three rounds each: the Hopper kernels, split-KV
// decode, the mma.sync kernel and the naive cuBLAS pipeline side by side, with the per-device state (the Hopper
// probe's answer, the scratch pool, each thread's cuBLAS handle) set up by whichever thread comes first when the
// case runs alone. Catch2's checks stay on the main thread.
TEST_CASE("cuda calls from several host threads at once match the float64 oracle", "[gpu][threads]") {
  using T = Eigen::half;
  struct job {
    cuda_kernel kernel;
    problem p;
    any_mask mask;
  };
  const job jobs[] = {{cuda_kernel::flash, {1, 8, 2, 300, 520, 128}, causal{}},
                      {cuda_kernel::naive, {1, 2, 1, 200, 333, 64}, dense{}},
                      {cuda_kernel::flash, {1, 4, 1, 1, 6000, 64}, dense{}},
                      {cuda_kernel::flash_mma_sync, {1, 2, 2, 129, 300, 128}, window{40, 10}}};
  constexpr int n = 4, rounds = 3;
  std::vector<std::uint64_t> seeds;
  std::vector<std::unique_ptr<attention_case<T>>> cases;
  std::vector<std::unique_ptr<device_copy<T>>> copies;
  for (const job& j : jobs) {
    seeds.push_back(fresh_seed());
    std::mt19937_64 rng(seeds.back());
    cases.push_back(std::make_unique<attention_case<T>>(j.p, layout::bshd, rng));
    copies.push_back(std::make_unique<device_copy<T>>(*cases.back(), 7.0f));
    REQUIRE(copies.back()->ok());
  }
  std::vector<status> statuses(n);
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t)
    threads.emplace_back([&, t] {
      const device_copy<T>& d = *copies[std::size_t(t)];
      for (int r = 0; r < rounds && statuses[std::size_t(t)]; ++r)
        statuses[std::size_t(t)] = gpu::attend_cuda_own_stream<T>(jobs[t].kernel, jobs[t].p, d.qd(), d.kd(), d.vd(),
                                                                  d.od(), jobs[t].mask, d.lse.data());
    });
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < n; ++t) {
    INFO(kernel_name(jobs[t].kernel) << " " << describe(jobs[t].p) << " " << describe(jobs[t].mask) << " seed "
                                     << seeds[std::size_t(t)] << ": " << statuses[std::size_t(t)].what());
    REQUIRE(statuses[std::size_t(t)].ok());
    check_outputs(*cases[std::size_t(t)], jobs[t].mask, copies[std::size_t(t)]->read());
  }
}

TEMPLATE_TEST_CASE("cuda block_sparse(every block) == dense flash", "[gpu][block_sparse][flash]", Eigen::half,
                   Eigen::bfloat16) {
  const problem p{1, 4, 2, 512, 777, 128};
  const block_layout all = dense_layout(block_geometry{512, 777, 128, 128, 1, 1});
  std::mt19937_64 rng(fresh_seed());
  attention_case<TestType> c(p, layout::bhsd, rng);
  const std::vector<float> lse_dense = run_on_device(cuda_kernel::flash, c, dense{});
  std::vector<double> dense_o(c.o.buf.size());
  for (std::size_t e = 0; e < dense_o.size(); ++e) dense_o[e] = static_cast<double>(c.o.buf[e]);
  std::vector<double> lse_ref(lse_dense.begin(), lse_dense.end());
  for (bool uploaded : {false, true}) {
    INFO((uploaded ? "device layout" : "layout copied per call"));
    const std::vector<float> lse_sparse = run_on_device(cuda_kernel::flash, c, block_sparse{all}, uploaded);
    CHECK(relative_error(c.o.view, dense_o) <= relative_bound<TestType>());
    CHECK(max_lse_error(lse_sparse, lse_ref) <= 1e-5);
  }
}

TEST_CASE("cuda forward is deterministic: the same inputs give bitwise the same O and lse on every run",
          "[gpu][determinism]") {
  // Each kernel (flash, its split-KV decode, block-sparse through a device layout, the cuBLAS naive pipeline) runs
  // three times on one case; O and lse must match the first run bit for bit (docs/design.md, Numerics).
  struct run_case {
    cuda_kernel kernel;
    problem p;
    any_mask mask;
    bool uploaded;
  };
  const problem p{2, 4, 2, 300, 517, 128}, decode{1, 4, 1, 1, 6000, 64}, sparse{1, 2, 2, 512, 1024, 128};
  const block_layout layout = random_layout(block_geometry{512, 1024, 128, 64, 1, 2}, 0.6, fresh_seed());
  const run_case cases[] = {
      {cuda_kernel::flash, p, dense{}, false},
      {cuda_kernel::flash, p, causal{align::bottom_right}, false},
      {cuda_kernel::flash, decode, window{3000, 0, align::bottom_right}, false},
      {cuda_kernel::flash, sparse, block_sparse{layout, causal{}}, true},
      {cuda_kernel::naive, p, window{64, 16}, false},
  };
  for (const run_case& rc : cases) {
    const std::uint64_t seed = fresh_seed();
    std::mt19937_64 rng(seed);
    attention_case<Eigen::half> c(rc.p, layout::bhsd, rng);
    INFO(kernel_name(rc.kernel) << " " << describe(rc.p) << " " << describe(rc.mask) << " seed=" << seed);
    const std::vector<Eigen::half> o_initial = c.o.buf;
    const std::vector<float> lse_first = run_on_device(rc.kernel, c, rc.mask, rc.uploaded);
    const std::vector<Eigen::half> o_first = c.o.buf;
    for (int again = 0; again < 2; ++again) {
      c.o.buf = o_initial;
      const std::vector<float> lse = run_on_device(rc.kernel, c, rc.mask, rc.uploaded);
      CHECK(std::memcmp(c.o.buf.data(), o_first.data(), o_first.size() * sizeof(Eigen::half)) == 0);
      CHECK(std::memcmp(lse.data(), lse_first.data(), lse.size() * sizeof(float)) == 0);
    }
  }
}
