// Catch2 main of the GPU tests: without a usable CUDA device every test reports itself skipped (exit code 77, which
// CTest's SKIP_RETURN_CODE turns into "Skipped") and prints why. Listing the tests needs no device.
#define CATCH_CONFIG_RUNNER
#include <cstdio>
#include <cstring>
#include <string>

#include <catch2/catch.hpp>

#include "gpu_entry.hpp"

int main(int argc, char* argv[]) {
  constexpr int skip_return_code = 77;
  bool listing = false;
  for (int i = 1; i < argc; ++i) listing = listing || std::strncmp(argv[i], "--list", 6) == 0;
  std::string why;
  if (!listing && !fusedattn::testing::gpu::device_available(why)) {
    std::printf("SKIPPED: %s; the GPU tests need an NVIDIA GPU of compute capability 8.0 or newer\n", why.c_str());
    return skip_return_code;
  }
  if (!listing) std::printf("cuda_kernel::flash runs %s here\n", fusedattn::testing::gpu::flash_kernel_name());
  return Catch::Session().run(argc, argv);
}
