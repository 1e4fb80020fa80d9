/// @file gpu_check.hpp
/// The device check of the Catch2 GPU test files: whether a case can run here, with the reason it is skipped.
#pragma once

#include <string>

#include <catch2/catch.hpp>

#include "gpu_entry.hpp"

namespace fusedattn::testing {

/// True when a CUDA device can run the tests; otherwise warns "skipped: <why>" and returns false.
inline bool have_device() {
  std::string why;
  if (gpu::device_available(why)) return true;
  WARN("skipped: " << why);
  return false;
}

}  // namespace fusedattn::testing
