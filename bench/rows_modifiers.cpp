// The score modifiers' rows, flash/f32/<mask>+<modifier>/<shape>/threads:1: attend on policy::cpu<> with softcap
// (cap 30), ALiBi (slopes 2^(−8(h+1)/H)) or sinks (logit 1) on the mask, beside the plain flash row of the same shape
// and mask, so that one run gives each modifier's cost as a ratio of two rows. FLOPs and bytes as the flash row's.
#include "rows.hpp"

#include <cmath>

namespace fusedattn::bench {
namespace {

enum class modifier { softcap, alibi, sinks };

const char* modifier_label(modifier m) {
  return m == modifier::softcap ? "softcap" : m == modifier::alibi ? "alibi" : "sinks";
}

void modifier_row(benchmark::State& state, row_spec r, modifier mod) {
  using model = kernel_model<policy::cpu<>>;
  const problem p = r.sh.to_problem();
  const band_choice mask = to_mask(r.mask);
  const band_mask bound = std::visit([&](const auto& m) { return bind(m, p); }, mask);
  std::vector<float> slopes(static_cast<std::size_t>(p.heads)), logits(static_cast<std::size_t>(p.heads), 1.0f);
  for (index_t h = 0; h < p.heads; ++h)
    slopes[static_cast<std::size_t>(h)] = std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(p.heads));
  operands<float> x(p);
  const policy::cpu<> pol = model::make(r.threads);
  const auto q = bhsd<const float>(x.q.data(), p.q_dims()), k = bhsd<const float>(x.k.data(), p.kv_dims()),
             v = bhsd<const float>(x.v.data(), p.kv_dims());
  const auto o = bhsd(x.o.data(), p.o_dims());
  const auto call = [&] {
    return std::visit(
        [&](const auto& m) {
          if (mod == modifier::softcap) return attend(pol, p, q, k, v, o, m | softcap{30.0f});
          if (mod == modifier::alibi) return attend(pol, p, q, k, v, o, m | alibi{slopes.data()});
          return attend(pol, p, q, k, v, o, m | sinks{logits.data()});
        },
        mask);
  };
  if (const status st = call(); !st) {  // untimed: first touch of the scratch and operands
    state.SkipWithError(st.what());
    return;
  }
  for (auto _ : state) {
    const status st = call();
    if (!st) {
      state.SkipWithError(st.what());
      break;
    }
    benchmark::DoNotOptimize(x.o.data());
    benchmark::ClobberMemory();
  }
  const double density = model::density(bound, p);
  set_counters(state, p, r.threads, density, cost::flops(p, density), model::bytes<float>(p, bound),
               cost::compulsory_bytes(p, sizeof(float)));
  state.counters["bf16_dot"] = 0;
  state.SetLabel(row_label(r) + "+" + modifier_label(mod));
}
}  // namespace

void register_modifier_rows(const plan& pl) {
  for (const shape& sh : {square(1, 1, 4096, 64), square(1, 32, 1024, 128)})
    for (mask_kind m : {mask_kind::dense, mask_kind::causal}) {
      if (m == mask_kind::causal && !pl.full) continue;  // the plain causal rows are in the full set only
      const row_spec r{sh, scalar::f32, m, 1};
      for (modifier mod : {modifier::softcap, modifier::alibi, modifier::sinks}) {
        const std::string name = "flash/f32/" + std::string(mask_label(m)) + "+" + modifier_label(mod) + "/" +
                                 shape_name(sh) + "/threads:1";
        benchmark::RegisterBenchmark(name.c_str(), modifier_row, r, mod)->UseRealTime()->Unit(benchmark::kMicrosecond);
      }
    }
}
}  // namespace fusedattn::bench
