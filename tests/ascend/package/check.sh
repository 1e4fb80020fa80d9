#!/usr/bin/env bash
# Installs fusedattn with FUSEDATTN_WITH_ASCEND=ON against a stand-in CANN toolkit (the transcribed declarations as
# its headers acl/acl.h and aclnnop/*.h, the recording fake as libascendcl.so) and builds and runs a program that
# finds fusedattn::ascend through find_package: checks FindAscendCANN, the exported target and the include path of
# a real toolkit. Usage: tests/ascend/package/check.sh [work-dir]   (default: build/ci-ascend)
set -euo pipefail
src=$(cd "$(dirname "$0")/../../.." && pwd)
work=$(realpath -m "${1:-$src/build/ci-ascend}")
rm -rf "$work"
mkdir -p "$work/toolkit/include/acl" "$work/toolkit/include/aclnnop" "$work/toolkit/lib64"
cp "$src/tests/ascend/include/fusedattn_cann_declarations.h" "$work/toolkit/include/"
for h in acl/acl.h aclnnop/aclnn_add.h aclnnop/aclnn_fill_scalar.h aclnnop/aclnn_flash_attention_score.h \
         aclnnop/aclnn_incre_flash_attention_v4.h aclnnop/aclnn_log.h aclnnop/aclnn_zero.h; do
  echo '#include <fusedattn_cann_declarations.h>' > "$work/toolkit/include/$h"
done
c++ -std=c++17 -O2 -fPIC -shared $(pkg-config --cflags eigen3) -I"$work/toolkit/include" \
  "$src/tests/ascend/fake_cann.cpp" -o "$work/toolkit/lib64/libascendcl.so"
echo 'void fusedattn_standin(void) {}' > "$work/empty.c"
for lib in opapi nnopbase; do cc -shared -fPIC "$work/empty.c" -o "$work/toolkit/lib64/lib$lib.so"; done
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DFUSEDATTN_WITH_CUDA=OFF -DFUSEDATTN_WITH_ASCEND=ON \
  -DASCEND_TOOLKIT_HOME="$work/toolkit" -DFUSEDATTN_BUILD_TESTS=OFF -DFUSEDATTN_BUILD_BENCH=OFF \
  -DFUSEDATTN_BUILD_EXAMPLES=OFF -DCMAKE_INSTALL_PREFIX="$work/prefix" >/dev/null
cmake --install "$work/build" >/dev/null
ASCEND_TOOLKIT_HOME="$work/toolkit" cmake -S "$src/tests/ascend/package" -B "$work/consumer" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/consumer" -j2 >/dev/null
"$work/consumer/ascend_package_check"
