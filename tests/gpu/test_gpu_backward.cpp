// The CUDA backward pass (attend_backward on policy::cuda) against the float64 closed-form gradient: f16 and bf16,
// every band mask and tail, GQA / MQA, head_dims 32-128 (and padded ones), strided views, block-sparse layouts
// (copied per call and uploaded), bitwise determinism across runs, zero extents and bad input refused with nothing
// written; score modifiers (softcap, ALiBi of both alignments, sinks with their gradient, all three) on every mask.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backward_entry.hpp"
#include "gpu_entry.hpp"
#include "support/backward_check.hpp"
#include "support/check.hpp"
#include "support/oracle_backward.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;

namespace {

/// Device copies of a case's buffers and the views over them; `read` copies dQ, dK, dV back into the case,
/// `launch_and_read` runs one backward call on them and reads its gradients back.
template <class T>
struct bwd_device {
  backward_case<T>& c;
  gpu::device_buffer<T> q, k, v, o, d_o, dq, dk, dv;
  gpu::device_buffer<float> lse;
  explicit bwd_device(backward_case<T>& ca)
      : c(ca), q(ca.q.buf), k(ca.k.buf), v(ca.v.buf), o(ca.o.buf), d_o(ca.d_o.buf), dq(ca.dq.buf), dk(ca.dk.buf),
        dv(ca.dv.buf), lse(ca.lse) {}
  bool ok() const {
    return q.ok() && k.ok() && v.ok() && o.ok() && d_o.ok() && dq.ok() && dk.ok() && dv.ok() && lse.ok();
  }
  template <class U>
  static tensor_ref<const T> in(const operand<T>& x, const gpu::device_buffer<U>& d) {
    return gpu::on_device<const T>(x.cview(), x.buf.data(), d.data());
  }
  template <class U>
  static tensor_ref<T> out(const operand<T>& x, const gpu::device_buffer<U>& d) {
    return gpu::on_device<T>(x.view, x.buf.data(), d.data());
  }
  status run(const any_mask& mask, bool uploaded = false, bool deterministic = true) {
    if (uploaded)
      return gpu::attend_backward_cuda_uploaded<T>(c.p, in(c.q, q), in(c.k, k), in(c.v, v), in(c.o, o),
                                                   in(c.d_o, d_o), lse.data(), out(c.dq, dq), out(c.dk, dk),
                                                   out(c.dv, dv), std::get<block_sparse>(mask), deterministic);
    return gpu::attend_backward_cuda<T>(c.p, in(c.q, q), in(c.k, k), in(c.v, v), in(c.o, o), in(c.d_o, d_o),
                                        lse.data(), out(c.dq, dq), out(c.dk, dk), out(c.dv, dv), mask,
                                        deterministic);
  }
  void read() {
    dq.copy_to(c.dq.buf);
    dk.copy_to(c.dk.buf);
    dv.copy_to(c.dv.buf);
  }
  /// Requires the buffers, then `launch()` (a backward call on them, returning its status) and the device's
  /// synchronisation to succeed, each status's reason in the message; then reads dQ, dK, dV back.
  template <class Launch>
  void launch_and_read(Launch&& launch) {
    REQUIRE(ok());
    const status st = launch();
    INFO(st.what());
    REQUIRE(st.ok());
    const status sync = gpu::synchronize();
    INFO(sync.what());
    REQUIRE(sync.ok());
    read();
  }
};

/// The plain same-precision implementation of a tensor-core backward: the closed form in f32 from the stored O and
/// lse, with P and dS rounded to T where they enter a product (as the 16-bit mma operands are), each gradient
/// rounded to T. FlashAttention's rule measures a kernel's error against this one's.
template <class T, class Mask>
reference_grads plain_backward_16(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                                  const tensor_ref<const T>& v, const tensor_ref<const T>& o,
                                  const tensor_ref<const T>& d_o, const float* lse, const Mask& mask) {
  const index_t d = p.head_dim;
  reference_grads g;
  g.dq.resize(static_cast<std::size_t>(p.batch * p.heads * p.seq_q * d));
  g.dk.resize(static_cast<std::size_t>(p.batch * p.heads_kv * p.seq_kv * d));
  g.dv.resize(g.dk.size());
  const float scale = static_cast<float>(p.softmax_scale());
  const auto r16 = [](float x) { return static_cast<float>(static_cast<T>(x)); };
  std::vector<float> dk(g.dk.size(), 0.f), dv(g.dv.size(), 0.f), dq(static_cast<std::size_t>(d));
  for (index_t b = 0; b < p.batch; ++b)
    for (index_t h = 0; h < p.heads; ++h) {
      const index_t hk = h / p.group_size();
      const auto hm = for_head(mask, b, h);
      const bound_mods mods = oracle_mods(hm, 0);
      for (index_t i = 0; i < p.seq_q; ++i) {
        std::fill(dq.begin(), dq.end(), 0.f);
        const float l = lse[(b * p.heads + h) * p.seq_q + i];
        const T* qi = q.row(b, h, i);
        const T* doi = d_o.row(b, h, i);
        if (l != -std::numeric_limits<float>::infinity()) {
          float delta = 0;
          for (index_t c = 0; c < d; ++c) delta += static_cast<float>(doi[c]) * static_cast<float>(o.row(b, h, i)[c]);
          for (index_t j = 0; j < p.seq_kv; ++j) {
            if (!hm.allowed(i, j)) continue;
            const T* kj = k.row(b, hk, j);
            const T* vj = v.row(b, hk, j);
            float s = 0, dp = 0;
            for (index_t c = 0; c < d; ++c) {
              s += static_cast<float>(qi[c]) * static_cast<float>(kj[c]);
              dp += static_cast<float>(doi[c]) * static_cast<float>(vj[c]);
            }
            const float capped = mods.cap(scale * s);
            const float pij = std::exp(capped + mods.bias<float>(h, i, j) - l);
            const float ds = r16(pij * (dp - delta) * mods.cap_grad(capped));
            const float p16 = r16(pij);
            const std::size_t kr = static_cast<std::size_t>(((b * p.heads_kv + hk) * p.seq_kv + j) * d);
            for (index_t c = 0; c < d; ++c) {
              dq[static_cast<std::size_t>(c)] += ds * static_cast<float>(kj[c]);
              dk[kr + static_cast<std::size_t>(c)] += ds * static_cast<float>(qi[c]);
              dv[kr + static_cast<std::size_t>(c)] += p16 * static_cast<float>(doi[c]);
            }
          }
        }
        const std::size_t qr = static_cast<std::size_t>(((b * p.heads + h) * p.seq_q + i) * d);
        for (index_t c = 0; c < d; ++c)
          g.dq[qr + static_cast<std::size_t>(c)] = static_cast<double>(static_cast<T>(scale * dq[static_cast<std::size_t>(c)]));
      }
    }
  for (std::size_t x = 0; x < dk.size(); ++x) {
    g.dk[x] = static_cast<double>(static_cast<T>(scale * dk[x]));
    g.dv[x] = static_cast<double>(static_cast<T>(dv[x]));
  }
  return g;
}

/// Forward on the CPU, backward on the device, gradients against the float64 closed form; `deterministic` false takes
/// the atomic-dQ path (policy::cuda::deterministic).
template <class T>
void check_backward_gpu(const problem& p, layout l, const any_mask& mask, bool uploaded = false,
                        bool deterministic = true) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  backward_case<T> c(p, l, rng);
  INFO(scalar_name<T>() << " " << describe(p) << " " << describe(mask) << " " << layout_name(l)
                        << (uploaded ? " (device layout)" : "") << (deterministic ? "" : " (atomic dQ)")
                        << " seed=" << seed);
  c.forward(mask);
  bwd_device<T> dev(c);
  dev.launch_and_read([&] { return dev.run(mask, uploaded, deterministic); });
  check_gradients(c, mask, [](const auto&... a) { return plain_backward_16(a...); });
}

/// Forward on the CPU and backward on the device with score modifiers (their arrays on the host for the forward and
/// the oracle, on the device for the backward); dQ, dK, dV and d sink against the float64 closed form.
template <class T>
void check_backward_mods_gpu(const problem& p, const any_mask& mask, bool cap, bool alibi_on, align alibi_align,
                             bool sink, bool deterministic = true) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  backward_case<T> c(p, layout::bhsd, rng);
  c.q.fill(rng, -2.0, 2.0);  // scaled scores reach about ±2, so softcap 1.0 bends them
  c.k.fill(rng, -2.0, 2.0);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<float> slopes(static_cast<std::size_t>(p.heads)), logits(slopes.size());
  for (auto& x : slopes) x = float(0.01 + 0.1 * u(rng));
  for (auto& x : logits) x = float(-1.0 + 3.0 * u(rng));
  std::vector<float> dsink(slopes.size(), 99.0f);
  gpu::device_buffer<float> d_slopes(slopes), d_logits(logits), d_dsink(dsink);
  REQUIRE((d_slopes.ok() && d_logits.ok() && d_dsink.ok()));
  const auto with = [&](const float* sl, const float* lg, float* gr) {
    modified<any_mask> m{mask, {}};
    if (cap) m = m | softcap{1.0f};
    if (alibi_on) m = m | alibi{sl, alibi_align};
    if (sink) m = m | sinks{lg, gr};
    return m;
  };
  const modified<any_mask> on_host = with(slopes.data(), logits.data(), nullptr);
  const modified<any_mask> on_device = with(d_slopes.data(), d_logits.data(), d_dsink.data());
  INFO(scalar_name<T>() << " " << describe(p) << " " << describe(mask) << (cap ? " softcap" : "")
                        << (alibi_on ? (alibi_align == align::top_left ? " alibi(top_left)" : " alibi(bottom_right)") : "")
                        << (sink ? " sinks" : "") << (deterministic ? "" : " (atomic dQ)") << " seed=" << seed);
  c.forward(on_host);
  bwd_device<T> dev(c);
  dev.launch_and_read([&] {
    return gpu::attend_backward_cuda_mods<T>(
        p, dev.in(c.q, dev.q), dev.in(c.k, dev.k), dev.in(c.v, dev.v), dev.in(c.o, dev.o), dev.in(c.d_o, dev.d_o),
        dev.lse.data(), dev.out(c.dq, dev.dq), dev.out(c.dk, dev.dk), dev.out(c.dv, dev.dv), on_device,
        deterministic);
  });
  d_dsink.copy_to(dsink);
  std::visit(
      [&](const auto& m) {
        const auto bound = bind(modified<std::decay_t<decltype(m)>>{m, on_host.mods}, p);
        const reference_grads ref = reference_backward(p, c.q.cview(), c.k.cview(), c.v.cview(), c.d_o.cview(), bound);
        const reference_grads pl =
            plain_backward_16(p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.cview(), c.d_o.cview(), c.lse.data(), bound);
        // ALiBi's logits grow with the distance: the floor widens with the largest bias (as the CPU tests do).
        const double extra = alibi_on ? 0.11 * double(p.seq_q + p.seq_kv) * 8.0 * epsilon<T>() : 0.0;
        const auto check = [&](const char* name, const auto& got, const std::vector<double>& oracle,
                               const std::vector<double>& plain) {
          const double tol = gradient_tolerance<T>(oracle, plain, extra);
          const double err = max_abs_error(got, oracle);
          INFO(name << ": error " << err << " plain error " << max_difference(plain, oracle) << " tolerance " << tol);
          CHECK(err <= tol);
        };
        check("dq", c.dq.view, ref.dq, pl.dq);
        check("dk", c.dk.view, ref.dk, pl.dk);
        check("dv", c.dv.view, ref.dv, pl.dv);
        if (sink) {
          // d sink against the oracle: the plain f32 closed form's error, and float roundoff over the rows summed.
          const reference_grads pf = plain_backward(p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.cview(),
                                                    c.d_o.cview(), c.lse.data(), bound);
          double err = 0, plain_err = 0;
          for (std::size_t h = 0; h < dsink.size(); ++h) {
            err = std::max(err, std::isnan(dsink[h]) ? std::numeric_limits<double>::infinity()
                                                     : std::abs(double(dsink[h]) - ref.dsink[h]));
            plain_err = std::max(plain_err, std::abs(pf.dsink[h] - ref.dsink[h]));
          }
          const double tol = 2.0 * plain_err + 8.0 * std::max(epsilon<T>(), epsilon<float>()) *
                                                   double(p.batch * p.seq_q) * std::max(1.0, max_magnitude(ref.dsink));
          INFO("dsink: error " << err << " plain error " << plain_err << " tolerance " << tol);
          CHECK(err <= tol);
        } else {
          CHECK(dsink == std::vector<float>(dsink.size(), 99.0f));
        }
      },
      mask);
}

}  // namespace

TEMPLATE_TEST_CASE("cuda backward applies score modifiers like the float64 gradient", "[gpu][backward][modifiers]",
                   Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  struct set {
    bool cap, alibi;
    align alibi_align;
    bool sink;
  };
  const set sets[] = {{true, false, align::top_left, false},
                      {false, true, align::top_left, false},
                      {false, true, align::bottom_right, false},
                      {false, false, align::top_left, true},
                      {true, true, align::bottom_right, true}};
  // Tails (sizes not multiples of 64), GQA 4/2 and MQA 4/1, head_dim 64 and 128.
  const std::vector<problem> shapes = {{1, 4, 2, 100, 77, 64}, {2, 4, 1, 130, 200, 128}, {1, 2, 2, 65, 129, 64}};
  for (const set& s : sets)
    for (const problem& p : shapes)
      for (const any_mask& mask : {any_mask{dense{}}, any_mask{causal{align::top_left}},
                                   any_mask{causal{align::bottom_right}}, any_mask{window{30, 10, align::bottom_right}}})
        check_backward_mods_gpu<T>(p, mask, s.cap, s.alibi, s.alibi_align, s.sink);
  // Block-sparse with all three.
  const problem p{1, 2, 1, 256, 300, 64};
  const block_layout lay = random_layout(block_geometry{256, 300, 128, 32, 1, 2}, 0.5, fresh_seed());
  check_backward_mods_gpu<T>(p, block_sparse{lay, causal{}}, true, true, align::top_left, true);
}

TEMPLATE_TEST_CASE("cuda backward matches the float64 gradient: every mask, tails, GQA/MQA, head_dims",
                   "[gpu][backward]", Eigen::half, Eigen::bfloat16) {
  const std::vector<problem> shapes = {
      {1, 2, 2, 100, 77, 64},  {2, 4, 2, 130, 200, 64}, {1, 4, 1, 65, 129, 128}, {1, 2, 1, 200, 64, 128},
      {1, 1, 1, 7, 300, 32},   {1, 3, 3, 1, 1, 64},     {1, 2, 2, 96, 150, 96},  {2, 2, 1, 77, 70, 40},
      {1, 2, 2, 257, 257, 128},
  };
  for (const problem& p : shapes)
    for (const any_mask& mask : all_masks()) check_backward_gpu<TestType>(p, layout::bhsd, mask);
}

TEMPLATE_TEST_CASE("cuda backward on strided views (bshd, padded 16-byte strides) and a larger shape",
                   "[gpu][backward]", Eigen::half, Eigen::bfloat16) {
  check_backward_gpu<TestType>(problem{2, 4, 2, 150, 130, 64}, layout::bshd, causal{align::bottom_right});
  check_backward_gpu<TestType>(problem{1, 2, 1, 90, 200, 128}, layout::padded16, window{30, 10, align::top_left});
  check_backward_gpu<TestType>(problem{1, 2, 2, 1024, 1024, 128}, layout::bhsd, causal{align::top_left});
  check_backward_gpu<TestType>(problem{1, 2, 2, 700, 1500, 64}, layout::bhsd, dense{});
}

TEMPLATE_TEST_CASE("cuda backward with block-sparse layouts (copied per call and uploaded)", "[gpu][backward]",
                   Eigen::half, Eigen::bfloat16) {
  const problem p{1, 2, 1, 256, 300, 64};
  const block_layout lay = random_layout(block_geometry{256, 300, 128, 32, 1, 2}, 0.5, fresh_seed());
  check_backward_gpu<TestType>(p, layout::bhsd, block_sparse{lay});
  check_backward_gpu<TestType>(p, layout::bhsd, block_sparse{lay, causal{}});
  check_backward_gpu<TestType>(p, layout::bhsd, block_sparse{lay, window{40, 10}}, true);
  const problem p2{2, 4, 2, 192, 200, 128};
  const block_layout per_head = random_layout(block_geometry{192, 200, 64, 64, 2, 4}, 0.4, fresh_seed());
  check_backward_gpu<TestType>(p2, layout::bshd, block_sparse{per_head});
  check_backward_gpu<TestType>(p2, layout::bhsd, block_sparse{per_head, causal{align::bottom_right}}, true);
}

TEMPLATE_TEST_CASE("cuda backward with atomic dQ (deterministic = false) matches the float64 gradient",
                   "[gpu][backward][atomic]", Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  // head_dim 64 and 128 (the Hopper kernels' split over keys and over columns), tails, GQA / MQA, every mask.
  const std::vector<problem> shapes = {{1, 2, 2, 100, 77, 64}, {2, 4, 2, 130, 200, 64}, {1, 4, 1, 65, 129, 128},
                                       {1, 2, 1, 200, 64, 128}, {1, 3, 3, 1, 1, 64}, {1, 2, 2, 257, 257, 128}};
  for (const problem& p : shapes)
    for (const any_mask& mask : all_masks()) check_backward_gpu<T>(p, layout::bhsd, mask, false, false);
  check_backward_gpu<T>(problem{2, 4, 2, 150, 130, 64}, layout::bshd, causal{align::bottom_right}, false, false);
  check_backward_gpu<T>(problem{1, 2, 1, 90, 200, 128}, layout::padded16, window{30, 10, align::top_left}, false,
                        false);
  check_backward_gpu<T>(problem{1, 2, 2, 1024, 1024, 128}, layout::bhsd, causal{align::top_left}, false, false);
  const problem pb{2, 4, 2, 192, 200, 128};
  const block_layout per_head = random_layout(block_geometry{192, 200, 128, 64, 2, 4}, 0.4, fresh_seed());
  check_backward_gpu<T>(pb, layout::bhsd, block_sparse{per_head, causal{align::bottom_right}}, true, false);
  for (const problem& p : {problem{1, 4, 2, 100, 77, 64}, problem{2, 4, 1, 130, 200, 128}})
    check_backward_mods_gpu<T>(p, causal{align::bottom_right}, true, true, align::bottom_right, true, false);
  {  // seq_kv = 0: every row saw no key, dQ = 0 (no accumulator is made)
    std::mt19937_64 rng(fresh_seed());
    backward_case<T> c(problem{1, 2, 1, 40, 0, 64}, layout::bhsd, rng);
    c.forward(dense{});
    bwd_device<T> dev(c);
    REQUIRE(dev.run(dense{}, false, false).ok());
    REQUIRE(gpu::synchronize().ok());
    dev.read();
    for (const auto& x : c.dq.buf) CHECK(static_cast<float>(x) == 0.f);
  }
}

TEST_CASE("cuda backward is deterministic: bitwise the same dQ, dK, dV on every run", "[gpu][backward]") {
  using T = Eigen::bfloat16;
  std::mt19937_64 rng(fresh_seed());
  for (const any_mask& mask : {any_mask{dense{}}, any_mask{causal{align::bottom_right}}}) {
    backward_case<T> c(problem{2, 8, 2, 777, 900, 128}, layout::bhsd, rng);
    c.forward(mask);
    std::vector<T> first[3];
    for (int run = 0; run < 3; ++run) {
      bwd_device<T> dev(c);
      dev.launch_and_read([&] { return dev.run(mask); });
      const std::vector<T>* now[3] = {&c.dq.buf, &c.dk.buf, &c.dv.buf};
      for (int x = 0; x < 3; ++x) {
        if (run == 0) first[x] = *now[x];
        else CHECK(std::memcmp(first[x].data(), now[x]->data(), first[x].size() * sizeof(T)) == 0);
      }
    }
  }
}

TEST_CASE("cuda backward: zero extents write zeros where gradients exist, nothing elsewhere", "[gpu][backward]") {
  using T = Eigen::half;
  std::mt19937_64 rng(fresh_seed());
  {  // seq_q = 0: no query sees a key, dK = dV = 0 (lse has no element; any device pointer will do)
    backward_case<T> c(problem{1, 2, 1, 0, 50, 64}, layout::bhsd, rng);
    bwd_device<T> dev(c);
    const gpu::device_buffer<float> lse(std::vector<float>(1, 0.f));
    REQUIRE(lse.ok());
    const status st = gpu::attend_backward_cuda<T>(c.p, dev.in(c.q, dev.q), dev.in(c.k, dev.k), dev.in(c.v, dev.v),
                                                   dev.in(c.o, dev.o), dev.in(c.d_o, dev.d_o), lse.data(),
                                                   dev.out(c.dq, dev.dq), dev.out(c.dk, dev.dk),
                                                   dev.out(c.dv, dev.dv), dense{});
    INFO(st.what());
    REQUIRE(st.ok());
    REQUIRE(gpu::synchronize().ok());
    dev.read();
    for (const auto& x : c.dk.buf) CHECK(static_cast<float>(x) == 0.f);
    for (const auto& x : c.dv.buf) CHECK(static_cast<float>(x) == 0.f);
  }
  {  // seq_kv = 0: every row saw no key (lse = −inf), dQ = 0
    backward_case<T> c(problem{1, 2, 1, 40, 0, 64}, layout::bhsd, rng);
    c.forward(dense{});
    bwd_device<T> dev(c);
    REQUIRE(dev.run(dense{}).ok());
    REQUIRE(gpu::synchronize().ok());
    dev.read();
    for (const auto& x : c.dq.buf) CHECK(static_cast<float>(x) == 0.f);
  }
}

TEST_CASE("cuda backward: bad input and unsupported calls are statuses, nothing written", "[gpu][backward][errors]") {
  std::mt19937_64 rng(fresh_seed());
  using T = Eigen::half;
  backward_case<T> c(problem{1, 2, 1, 64, 64, 64}, layout::bhsd, rng);
  c.forward(dense{});
  const std::vector<T> dq0 = c.dq.buf, dk0 = c.dk.buf, dv0 = c.dv.buf;
  bwd_device<T> dev(c);
  REQUIRE(dev.ok());
  const auto q = dev.in(c.q, dev.q), k = dev.in(c.k, dev.k), v = dev.in(c.v, dev.v), o = dev.in(c.o, dev.o),
             d_o = dev.in(c.d_o, dev.d_o);
  const auto dq = dev.out(c.dq, dev.dq), dk = dev.out(c.dk, dev.dk), dv = dev.out(c.dv, dev.dv);
  const auto expect_refused = [&](const status& st, errc code, const char* field) {
    INFO(st.what());
    CHECK(st.code() == code);
    CHECK(std::string(st.what()).find(field) != std::string::npos);
  };
  // Host memory where device memory is expected.
  expect_refused(gpu::attend_backward_cuda<T>(c.p, c.q.cview(), k, v, o, d_o, dev.lse.data(), dq, dk, dv, dense{}),
                 errc::invalid_argument, "q");
  expect_refused(gpu::attend_backward_cuda<T>(c.p, q, k, v, o, d_o, c.lse.data(), dq, dk, dv, dense{}),
                 errc::invalid_argument, "lse");
  // dK aliasing dV; dQ aliasing dO; a null lse.
  expect_refused(gpu::attend_backward_cuda<T>(c.p, q, k, v, o, d_o, dev.lse.data(), dq, dk, dk, dense{}),
                 errc::invalid_argument, "dk overlaps dv");
  expect_refused(gpu::attend_backward_cuda<T>(c.p, q, k, v, o, d_o, dev.lse.data(),
                                              tensor_ref<T>{const_cast<T*>(d_o.data), d_o.dims, d_o.stride}, dk, dv,
                                              dense{}),
                 errc::invalid_argument, "dq overlaps d_o");
  expect_refused(gpu::attend_backward_cuda<T>(c.p, q, k, v, o, d_o, nullptr, dq, dk, dv, dense{}),
                 errc::invalid_argument, "lse is null");
  // dO of the wrong shape.
  tensor_ref<const T> short_do = d_o;
  short_do.dims.s = 63;
  expect_refused(gpu::attend_backward_cuda<T>(c.p, q, k, v, o, short_do, dev.lse.data(), dq, dk, dv, dense{}),
                 errc::invalid_argument, "d_o");
  // A block_q that splits the kernel's 64-row q tile.
  const block_layout odd = dense_layout(block_geometry{64, 64, 32, 64, 1, 1});
  expect_refused(gpu::attend_backward_cuda<T>(c.p, q, k, v, o, d_o, dev.lse.data(), dq, dk, dv, block_sparse{odd}),
                 errc::unsupported, "block_q");
  REQUIRE(gpu::synchronize().ok());
  dev.read();
  CHECK(unchanged(c.dq.buf, dq0));
  CHECK(unchanged(c.dk.buf, dk0));
  CHECK(unchanged(c.dv.buf, dv0));

  // f32 and head_dim 256: unsupported, nothing written.
  backward_case<float> cf(problem{1, 1, 1, 16, 16, 32}, layout::bhsd, rng);
  const std::vector<float> dqf0 = cf.dq.buf;
  bwd_device<float> devf(cf);
  expect_refused(devf.run(dense{}), errc::unsupported, "f16 and bf16");
  backward_case<T> c256(problem{1, 1, 1, 16, 16, 256}, layout::bhsd, rng);
  const std::vector<T> dq256 = c256.dq.buf;
  bwd_device<T> dev256(c256);
  expect_refused(dev256.run(dense{}), errc::unsupported, "head_dim");
  REQUIRE(gpu::synchronize().ok());
  devf.read();
  dev256.read();
  CHECK(unchanged(cf.dq.buf, dqf0));
  CHECK(unchanged(c256.dq.buf, dq256));
}
