// The naive kernel's rows, in a file of their own so that the kernels' instantiations compile in parallel.
#include "rows.hpp"

namespace fusedattn::bench {
void register_naive_row(const row_spec& r) { register_row<policy::cpu_naive>(r); }
}  // namespace fusedattn::bench
