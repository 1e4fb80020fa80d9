/// @file fusedattn.hpp
/// Umbrella header: include this one. Fused scaled-dot-product attention for C++17,
/// O = softmax(scale · Q·Kᵀ + mask) · V, on the CPU (and CUDA / Ascend when compiled in).
#pragma once

#include "config.hpp"
#include "core/cost_model.hpp"
#include "core/plan.hpp"
#include "core/problem.hpp"
#include "core/status.hpp"
#include "core/tensor.hpp"
#include "core/types.hpp"
#include "core/validate.hpp"
#include "cpu/micro_kernels.hpp"
#include "cpu/simd.hpp"
#include "cpu/tiles.hpp"
#include "kernels/mask.hpp"
#include "kernels/decode.hpp"
#include "kernels/flash.hpp"
#include "kernels/kv_source.hpp"
#include "kernels/softmax.hpp"
#include "kernels/tile_loop.hpp"
#include "kernels/naive.hpp"
#include "dispatch/policy.hpp"
#include "dispatch/plan.hpp"
#include "dispatch/attend.hpp"
#include "dispatch/kv_storage.hpp"
#include "dispatch/serving.hpp"
#include "dispatch/backward.hpp"
#include "dist/merge.hpp"  // merge_partials only: the rest of dist/ (MPI, NCCL) is included explicitly
