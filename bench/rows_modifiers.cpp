// The score modifiers' rows, flash/f32/<mask>+<modifier>/<shape>/threads:1: the flash row body (attention_row on
// policy::cpu<>) with softcap (cap 30), ALiBi (slopes 2^(−8(h+1)/H)) or sinks (logit 1) on the mask, beside the plain
// flash row of the same shape and mask, so that one run gives each modifier's cost as a ratio of two rows. FLOPs and
// bytes as the flash row's.
#include "rows.hpp"

namespace fusedattn::bench {

void register_modifier_rows(const plan& pl) {
  for (const shape& sh : {square(1, 1, 4096, 64), square(1, 32, 1024, 128)})
    for (mask_kind m : {mask_kind::dense, mask_kind::causal}) {
      if (m == mask_kind::causal && !pl.full) continue;  // the plain causal rows are in the full set only
      for (score_mod mod : {score_mod::softcap, score_mod::alibi, score_mod::sinks})
        register_flash_row(row_spec{sh, scalar::f32, m, 1, mod});
    }
}
}  // namespace fusedattn::bench
