// The backward pass's rows, flash_bwd/<type>/<mask>/<shape>/threads:N: attend_backward on policy::cpu<> with O and
// lse from one forward call, timed alone. FLOPs 2.5 × the forward's (10·b·h·s_q·s_kv·d × the allowed fraction);
// bytes as docs/roofline.md, "Backward pass", models them.
#include "rows.hpp"

#include <cmath>

namespace fusedattn::bench {
namespace {

/// Modelled traffic of the CPU backward pass (docs/roofline.md, "Backward pass"): Q, K, V, O, dO read and dQ, dK,
/// dV written once (compulsory), plus per visited (q tile, kv tile) pair the packed Q and dO tiles read and the
/// partial dQ rows read and written, all in the accumulation type; K and V stay in cache for the kv tile's whole
/// column walk.
template <class T>
double backward_bytes(const problem& p, double density) {
  using Acc = accum_t<T>;
  const double kv_tiles = std::ceil(static_cast<double>(p.seq_kv) /
                                    static_cast<double>(cpu::backward_kv_tile_keys(p.head_dim)));
  const double elements = static_cast<double>(p.batch * p.heads * p.seq_q) * static_cast<double>(p.head_dim);
  const double compulsory = 2.0 * cost::compulsory_bytes(p, sizeof(T));
  return compulsory + density * kv_tiles * elements * 4.0 * sizeof(Acc);
}

template <class T>
void backward_row(benchmark::State& state, row_spec r) {
  const problem p = r.sh.to_problem();
  const band_choice mask = to_mask(r.mask);
  const band_mask bound = std::visit([&](const auto& m) { return bind(m, p); }, mask);
  operands<T> x(p);
  std::vector<T> d_o(x.o.size()), dq(x.q.size()), dk(x.k.size()), dv(x.v.size());
  {
    std::vector<float> tmp(d_o.size());
    fill_uniform(tmp.data(), tmp.size(), 7);
    for (std::size_t i = 0; i < tmp.size(); ++i) d_o[i] = static_cast<T>(tmp[i]);
  }
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()));
  policy::cpu<> pol;
  pol.threads = r.threads;
  const auto q = bhsd<const T>(x.q.data(), p.q_dims()), k = bhsd<const T>(x.k.data(), p.kv_dims()),
             v = bhsd<const T>(x.v.data(), p.kv_dims()), o = bhsd<const T>(x.o.data(), p.o_dims()),
             g = bhsd<const T>(d_o.data(), p.o_dims());
  const auto call = [&] {
    return std::visit(
        [&](const auto& m) {
          return attend_backward(pol, p, q, k, v, o, g, lse.data(), bhsd(dq.data(), p.q_dims()),
                                 bhsd(dk.data(), p.kv_dims()), bhsd(dv.data(), p.kv_dims()), m);
        },
        mask);
  };
  const status fwd = std::visit(
      [&](const auto& m) { return attend(pol, p, q, k, v, bhsd(x.o.data(), p.o_dims()), m, lse.data()); }, mask);
  if (!fwd) {
    state.SkipWithError(fwd.what());
    return;
  }
  if (!time_calls(state, call, dq.data())) return;
  const double density = cost::density(bound, p);
  set_counters(state, p, r.threads, density, 2.5 * cost::flops(p, density), backward_bytes<T>(p, density),
               2.0 * cost::compulsory_bytes(p, sizeof(T)));
  state.SetLabel(row_label(r));
}

/// Shapes of the backward rows: S 1024–4096, head_dim 64 and 128, enough heads for every thread.
std::vector<shape> backward_shapes() {
  return {square(1, 8, 1024, 64), square(1, 4, 2048, 64), square(1, 2, 4096, 64),
          square(1, 8, 1024, 128), square(1, 4, 2048, 128), square(1, 2, 4096, 128)};
}

}  // namespace

void register_backward_rows(const plan& pl) {
  const std::vector<int> threads = pl.max_threads > 1 ? std::vector<int>{1, pl.max_threads} : std::vector<int>{1};
  for (const shape& sh : backward_shapes())
    for (scalar t : pl.full ? std::vector<scalar>{scalar::f32, scalar::f16} : std::vector<scalar>{scalar::f32})
      for (mask_kind m : {mask_kind::dense, mask_kind::causal})
        for (int th : threads) {
          const row_spec r{sh, t, m, th};
          const std::string name = row_name("flash_bwd", r);
          benchmark::internal::Benchmark* b =
              t == scalar::f32 ? benchmark::RegisterBenchmark(name.c_str(), backward_row<float>, r)
                               : benchmark::RegisterBenchmark(name.c_str(), backward_row<Eigen::half>, r);
          b->UseRealTime()->Unit(benchmark::kMicrosecond);
        }
}

}  // namespace fusedattn::bench
