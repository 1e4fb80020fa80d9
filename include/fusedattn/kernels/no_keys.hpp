/// @file no_keys.hpp
/// The CPU result of a call whose problem has seq_kv = 0: every query row sees no key, so O = 0 and lse = −inf, or
/// the head's sink logit with attention sinks (the same values a row that the mask leaves without keys gets). No
/// attention kernel runs.
#pragma once

#include <limits>

#include "../core/problem.hpp"
#include "../core/score_mod.hpp"
#include "../core/status.hpp"
#include "../core/tensor.hpp"

namespace fusedattn {
namespace kernels {

/// Writes O = 0 into every element of `o` and −inf (or head h's sink logit, when `mods` has sinks) into every lse
/// entry (when `lse` is given). Preconditions: validated; host memory.
template <class T>
status no_key_rows(const problem& p, const tensor_ref<T>& o, float* lse, const bound_mods& mods = {}) {
  for (index_t b = 0; b < p.batch; ++b)
    for (index_t h = 0; h < p.heads; ++h)
      for (index_t i = 0; i < p.seq_q; ++i) {
        T* r = o.row(b, h, i);
        for (index_t c = 0; c < p.head_dim; ++c) r[c] = T(0);
        if (lse) lse[(b * p.heads + h) * p.seq_q + i] = mods.sink<float>(h);
      }
  return {};
}

}  // namespace kernels
}  // namespace fusedattn
