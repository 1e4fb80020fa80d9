// The flash kernel's rows, in a file of their own so that the kernels' instantiations compile in parallel.
#include "rows.hpp"

namespace fusedattn::bench {

/// The AMX rows (flash_amx/bf16/...): policy::cpu_amx, modelled as the flash kernel.
template <>
struct kernel_model<policy::cpu_amx> : kernel_model<policy::cpu<cpu::avx512>> {
  static constexpr const char* name = "flash_amx";
  static policy::cpu_amx make(int threads) {
    policy::cpu_amx pol;
    pol.threads = threads;
    return pol;
  }
};

void register_flash_row(const row_spec& r) { register_row<policy::cpu<>>(r); }

void register_bf16_flash_rows(const plan& pl) {
  const bool dot = cpu::avx512bf16::available(), amx = cpu::amx::available();
  const std::vector<int> threads = pl.max_threads > 1 ? std::vector<int>{1, pl.max_threads} : std::vector<int>{1};
  for (const shape& sh : leaderboard_shapes()) {
    if (sh.s_q < 512) continue;
    for (mask_kind m : {mask_kind::dense, mask_kind::causal}) {
      if (m == mask_kind::causal && !pl.full) continue;
      for (int th : threads) {
        const row_spec r{sh, scalar::bf16, m, th};
        if (dot) register_row<policy::cpu_avx512bf16>(r);
        else register_row<policy::cpu<>>(r);
        if (amx) register_row<policy::cpu_amx>(r);
      }
    }
  }
}
}  // namespace fusedattn::bench
