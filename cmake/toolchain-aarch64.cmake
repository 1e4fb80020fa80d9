# Cross toolchain for aarch64 Linux with Debian's g++-aarch64-linux-gnu; programs run under qemu-user.
#   cmake -S . -B build/arm -DCMAKE_TOOLCHAIN_FILE=cmake/toolchain-aarch64.cmake -DFUSEDATTN_NATIVE=OFF
# fusedattn's dependencies are header-only (Eigen, xsimd, xtl, Catch2 2.x): their Debian packages serve both
# architectures. Debian's cross compiler searches /usr/include after its own sysroot (multiarch layout), so the
# host packages' headers and CMake configs are used as they are; libraries (libgomp, libstdc++) come from the
# sysroot /usr/aarch64-linux-gnu only. CMAKE_CROSSCOMPILING_EMULATOR lets ctest and Catch2's test discovery run
# the test binaries; `-cpu max` gives qemu every Armv8/v9 extension it emulates (BF16 and I8MM among them).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(FUSEDATTN_AARCH64_TRIPLE aarch64-linux-gnu CACHE STRING "Target triple of the Debian cross compiler")
set(FUSEDATTN_AARCH64_SYSROOT /usr/${FUSEDATTN_AARCH64_TRIPLE} CACHE PATH "Target libraries (qemu's -L)")
set(CMAKE_C_COMPILER ${FUSEDATTN_AARCH64_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${FUSEDATTN_AARCH64_TRIPLE}-g++)

# Programs (the emulator, code generators) from the host; libraries from the target's sysroot; headers and CMake
# package configs from either (the header-only dependencies are installed once, for the host).
set(CMAKE_FIND_ROOT_PATH ${FUSEDATTN_AARCH64_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
# Debian installs xsimd's CMake config under the host's multiarch folder (/usr/lib/x86_64-linux-gnu/cmake), which a
# search for aarch64 does not look in.
if(NOT xsimd_DIR)
  file(GLOB fusedattn_xsimd_configs /usr/lib/*/cmake/xsimd/xsimdConfig.cmake)
  if(fusedattn_xsimd_configs)
    list(GET fusedattn_xsimd_configs 0 fusedattn_xsimd_config)
    get_filename_component(fusedattn_xsimd_dir ${fusedattn_xsimd_config} DIRECTORY)
    set(xsimd_DIR ${fusedattn_xsimd_dir} CACHE PATH "xsimd's CMake config (header-only, the host's package)")
  endif()
endif()

find_program(FUSEDATTN_QEMU_AARCH64 NAMES qemu-aarch64 qemu-aarch64-static)
if(FUSEDATTN_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${FUSEDATTN_QEMU_AARCH64} -L ${FUSEDATTN_AARCH64_SYSROOT} -cpu max
      CACHE STRING "How the host runs aarch64 programs")
endif()
