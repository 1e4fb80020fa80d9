/// @file plan.hpp
/// What `fa::plan` answers about a call without running it: which kernel would run, how much scratch memory it
/// would take, and, when it is not the backend's fused (O(S)-memory) kernel, why not. Plain data.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>

#include "status.hpp"

namespace fusedattn {

/// The answer of `fa::plan(policy, problem, q, k, v, o, mask, lse)`.
struct kernel_plan {
  /// ok when attend() with the same arguments would run; otherwise the status attend() would return
  /// (and the fields below are empty).
  status st{};
  /// The kernel attend() would run, e.g. "cpu.flash<avx512f>", "cpu.naive", "cuda.flash_hopper", "cuda.naive".
  std::string kernel;
  /// Bytes of scratch memory the call would allocate (host memory for CPU policies, device memory for CUDA).
  std::size_t scratch_bytes = 0;
  /// True when `kernel` is the backend's fused kernel (memory O(S), no S_q×S_kv intermediate).
  bool fused = false;
  /// When not fused: why the policy chose (or was told to choose) another kernel; empty otherwise.
  std::string why;

  explicit operator bool() const noexcept { return st.ok(); }
};

/// One line for logs and reports: "cpu.flash<avx512f>, 1.53 MiB scratch", "cpu.naive, 16.1 MiB scratch (not
/// fused: ...)", or "refused: <status>".
inline std::string to_string(const kernel_plan& pl) {
  if (!pl.st.ok()) return std::string("refused: ") + to_string(pl.st.code()) + ": " + pl.st.message();
  char bytes[48];
  const double b = static_cast<double>(pl.scratch_bytes);
  if (b < 1024.0)
    std::snprintf(bytes, sizeof bytes, "%zu B", pl.scratch_bytes);
  else if (b < 1024.0 * 1024.0)
    std::snprintf(bytes, sizeof bytes, "%.3g KiB", b / 1024.0);
  else if (b < 1024.0 * 1024.0 * 1024.0)
    std::snprintf(bytes, sizeof bytes, "%.3g MiB", b / (1024.0 * 1024.0));
  else
    std::snprintf(bytes, sizeof bytes, "%.3g GiB", b / (1024.0 * 1024.0 * 1024.0));
  std::string line = pl.kernel + ", " + bytes + " scratch";
  if (!pl.fused) line += " (not fused: " + pl.why + ")";
  return line;
}

}  // namespace fusedattn
