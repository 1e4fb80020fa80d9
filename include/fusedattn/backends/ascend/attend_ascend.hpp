/// @file attend_ascend.hpp
/// The Ascend side of `attend`: runs a validated call on CANN's fused attention operators through their two-phase
/// API (GetWorkspaceSize, then the launch on the policy's stream) and assembles lse from the softmax statistics.
/// Included by dispatch/attend.hpp when FUSEDATTN_WITH_ASCEND is 1; marshal.hpp decides, this file calls CANN.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "../../core/plan.hpp"
#include "../../core/problem.hpp"
#include "../../core/status.hpp"
#include "../../core/tensor.hpp"
#include "../../dispatch/policy.hpp"
#include "../../kernels/block_sparse.hpp"
#include "../../kernels/mask.hpp"
#include "acl_api.hpp"
#include "marshal.hpp"

namespace fusedattn {
namespace ascend_backend {

/// One prepared operator: its executor and workspace, launched later by launch_all. An executor that is never
/// launched (a later step of the call failed) is released the documented way: made repeatable, then destroyed.
struct prepared_op {
  const char* name = nullptr;
  aclnnStatus (*launch)(void*, uint64_t, aclOpExecutor*, aclrtStream) = nullptr;
  aclOpExecutor* executor = nullptr;  ///< null once launched (the launch releases it)
  device_buffer workspace;

  prepared_op() = default;
  prepared_op(const prepared_op&) = delete;
  prepared_op& operator=(const prepared_op&) = delete;
  prepared_op(prepared_op&& o) noexcept
      : name(o.name), launch(o.launch), executor(std::exchange(o.executor, nullptr)),
        workspace(std::move(o.workspace)) {}
  ~prepared_op() {
    if (executor != nullptr && aclSetAclOpExecutorRepeatable(executor) == ACL_SUCCESS)
      (void)aclDestroyAclOpExecutor(executor);
  }
};

/// The CANN objects of one call, kept until its stream has finished.
struct call_state {
  std::vector<acl_tensor> tensors;
  std::vector<acl_scalar> scalars;
  std::vector<acl_int_array> int_arrays;
  std::vector<acl_tensor_list> lists;
  std::vector<device_buffer> buffers;
  std::vector<prepared_op> ops;

  /// aclCreateTensor for `d`; errc::backend_error naming `what` when CANN refuses it.
  status tensor(const tensor_desc& d, aclDataType dtype, const char* what, aclTensor*& out) {
    const std::int64_t storage[1] = {d.storage};
    out = aclCreateTensor(d.dims.data(), d.rank, dtype, d.strides.data(), d.offset, ACL_FORMAT_ND, storage, 1, d.base);
    if (out == nullptr) return null_from((std::string("aclCreateTensor(") + what + ")").c_str());
    tensors.emplace_back(out);
    return {};
  }
  status scalar(float value, aclScalar*& out) {
    out = aclCreateScalar(&value, ACL_FLOAT);
    if (out == nullptr) return null_from("aclCreateScalar");
    scalars.emplace_back(out);
    return {};
  }
  status buffer(std::uint64_t bytes, const char* what, void*& out) {
    device_buffer b;
    if (status st = b.allocate(bytes, what); !st) return st;
    out = b.get();
    buffers.push_back(std::move(b));
    return {};
  }
  /// Phase one of an operator: `get_workspace(&bytes, &executor)`, then its workspace from the backend's allocator.
  template <class GetWorkspace>
  status prepare(const char* get_name, const char* name, aclnnStatus (*launch)(void*, uint64_t, aclOpExecutor*,
                                                                               aclrtStream),
                 GetWorkspace&& get_workspace) {
    std::uint64_t bytes = 0;
    aclOpExecutor* executor = nullptr;
    if (status st = from_acl(get_workspace(&bytes, &executor), get_name); !st) return st;
    prepared_op op;
    op.name = name;
    op.launch = launch;
    op.executor = executor;  // released by op's destructor if the workspace cannot be had
    if (status st = op.workspace.allocate(bytes, name); !st) return st;
    ops.push_back(std::move(op));
    return {};
  }
  /// Phase two of every prepared operator, in order, then waits for the stream: the workspaces are freed after.
  status launch_all(aclrtStream stream) {
    for (prepared_op& op : ops) {
      aclOpExecutor* executor = std::exchange(op.executor, nullptr);
      status st = from_acl(op.launch(op.workspace.get(), op.workspace.bytes(), executor, stream), op.name);
      if (!st) {
        (void)aclrtSynchronizeStream(stream);  // operators already queued still use their workspaces
        return st;
      }
    }
    return from_acl(aclrtSynchronizeStream(stream), "aclrtSynchronizeStream");
  }
};

/// The 2048×2048 compressed causal mask of sparse modes 2, 3 and 4 (1 above the diagonal), made once per device and
/// kept for the life of the process.
inline status compressed_causal_mask(void*& out) {
  static std::mutex mutex;
  static auto* const per_device = new std::map<std::int32_t, void*>();  // never destroyed: the masks outlive it
  std::int32_t device = 0;
  if (status st = from_acl(aclrtGetDevice(&device), "aclrtGetDevice"); !st) return st;
  const std::lock_guard<std::mutex> lock(mutex);
  if (auto it = per_device->find(device); it != per_device->end()) {
    out = it->second;
    return {};
  }
  constexpr std::int64_t n = compressed_mask_side;
  std::vector<std::uint8_t> host(static_cast<std::size_t>(n * n));
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < n; ++j) host[static_cast<std::size_t>(i * n + j)] = j > i ? 1 : 0;
  device_buffer mask;
  if (status st = mask.allocate(host.size(), "2048x2048 causal mask"); !st) return st;
  if (status st = from_acl(aclrtMemcpy(mask.get(), host.size(), host.data(), host.size(), ACL_MEMCPY_HOST_TO_DEVICE),
                           "aclrtMemcpy(causal mask)");
      !st)
    return st;
  out = mask.release();
  (*per_device)[device] = out;
  return {};
}

/// The full mask of a block-sparse call (1 = masked), uploaded to a buffer of the call: [Sq, Skv] for one pattern,
/// [B, 1, Sq, Skv] for one per batch entry, [B, N, Sq, Skv] otherwise.
inline status block_sparse_mask_tensor(const problem& p, const block_sparse_mask& m, call_state& cs,
                                       aclTensor*& out) {
  const bool per_head = m.pattern_heads > 1;
  const index_t nb = per_head ? p.batch : m.pattern_batch, nh = per_head ? p.heads : 1;
  std::vector<std::uint8_t> host(static_cast<std::size_t>(nb * nh * p.seq_q * p.seq_kv));
  for (index_t b = 0; b < nb; ++b)
    for (index_t h = 0; h < nh; ++h) {
      const block_sparse_mask head = for_head(m, b, h);
      std::uint8_t* rows = host.data() + static_cast<std::size_t>((b * nh + h) * p.seq_q * p.seq_kv);
      for (index_t i = 0; i < p.seq_q; ++i)
        for (index_t j = 0; j < p.seq_kv; ++j) rows[i * p.seq_kv + j] = head.allowed(i, j) ? 0 : 1;
    }
  void* dev = nullptr;
  if (status st = cs.buffer(host.size(), "block-sparse mask", dev); !st) return st;
  if (status st = from_acl(aclrtMemcpy(dev, host.size(), host.data(), host.size(), ACL_MEMCPY_HOST_TO_DEVICE),
                           "aclrtMemcpy(block-sparse mask)");
      !st)
    return st;
  tensor_desc d;
  if (nb == 1 && nh == 1) {
    d.rank = 2;
    d.dims = {p.seq_q, p.seq_kv, 0, 0};
    d.strides = {p.seq_kv, 1, 0, 0};
  } else {
    d.dims = {nb, nh, p.seq_q, p.seq_kv};
    d.strides = {nh * p.seq_q * p.seq_kv, p.seq_q * p.seq_kv, p.seq_kv, 1};
  }
  place(d, dev, 1, 0);
  return cs.tensor(d, ACL_UINT8, "atten_mask", out);
}

inline status mask_tensor(const problem&, const band_mask&, const band_plan& band, call_state& cs,
                          aclTensor*& out) {
  out = nullptr;
  if (!band.compressed_mask) return {};
  void* dev = nullptr;
  if (status st = compressed_causal_mask(dev); !st) return st;
  tensor_desc d;
  d.rank = 2;
  d.dims = {compressed_mask_side, compressed_mask_side, 0, 0};
  d.strides = {compressed_mask_side, 1, 0, 0};
  place(d, dev, 1, 0);
  return cs.tensor(d, ACL_UINT8, "atten_mask", out);
}
inline status mask_tensor(const problem& p, const block_sparse_mask& m, const band_plan&, call_state& cs,
                          aclTensor*& out) {
  return block_sparse_mask_tensor(p, m, cs, out);
}

/// A [B, N, rows] view of lse (laid out [b][h][i]) from row `row_begin`.
inline tensor_desc lse_view(const problem& p, float* lse, index_t row_begin, index_t rows) {
  tensor_desc d;
  d.rank = 3;
  d.dims = {p.batch, p.heads, rows, 0};
  d.strides = {p.heads * p.seq_q, p.seq_q, 1, 0};
  place(d, lse, sizeof(float), row_begin);
  return d;
}

/// The rows no key is visible to: O = 0 and lse = −inf, by aclnnInplaceZero and aclnnInplaceFillScalar.
template <class T>
status prepare_empty_rows(const call_plan& c, const problem& p, const tensor_ref<T>& o, float* lse, aclDataType dtype,
                          call_state& cs) {
  const index_t ranges[2][2] = {{0, c.band.row_begin}, {c.band.row_end, p.seq_q}};
  for (const auto& r : ranges) {
    const index_t count = r[1] - r[0];
    if (count <= 0) continue;
    aclTensor* ov = nullptr;
    if (status st = cs.tensor(describe(o, c.strides[3], c.layout, r[0], count), dtype, "o rows without keys", ov); !st)
      return st;
    if (status st = cs.prepare("aclnnInplaceZeroGetWorkspaceSize", "aclnnInplaceZero", aclnnInplaceZero,
                               [&](std::uint64_t* ws, aclOpExecutor** ex) {
                                 return aclnnInplaceZeroGetWorkspaceSize(ov, ws, ex);
                               });
        !st)
      return st;
    if (lse == nullptr) continue;
    aclTensor* lv = nullptr;
    if (status st = cs.tensor(lse_view(p, lse, r[0], count), ACL_FLOAT, "lse rows without keys", lv); !st) return st;
    aclScalar* minus_inf = nullptr;
    if (status st = cs.scalar(-std::numeric_limits<float>::infinity(), minus_inf); !st) return st;
    if (status st = cs.prepare("aclnnInplaceFillScalarGetWorkspaceSize", "aclnnInplaceFillScalar",
                               aclnnInplaceFillScalar,
                               [&](std::uint64_t* ws, aclOpExecutor** ex) {
                                 return aclnnInplaceFillScalarGetWorkspaceSize(lv, minus_inf, ws, ex);
                               });
        !st)
      return st;
  }
  return {};
}

/// aclnnFlashAttentionScore on rows [row_begin, row_end), then lse = max + log(sum) from its softmax statistics
/// ([B, N, rows, 8] floats each; column 0 read) by aclnnLog and aclnnInplaceAdd.
template <class T, class Bound>
status prepare_flash(const call_plan& c, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                     const tensor_ref<const T>& v, const tensor_ref<T>& o, const Bound& mask, float* lse,
                     aclDataType dtype, call_state& cs) {
  const index_t r0 = c.band.row_begin, rows = c.band.rows();
  aclTensor *tq = nullptr, *tk = nullptr, *tv = nullptr, *to = nullptr, *tmask = nullptr, *tmax = nullptr,
            *tsum = nullptr;
  if (status st = cs.tensor(describe(q, c.strides[0], c.layout, r0, rows), dtype, "q", tq); !st) return st;
  if (status st = cs.tensor(describe(k, c.strides[1], c.layout, 0, p.seq_kv), dtype, "k", tk); !st) return st;
  if (status st = cs.tensor(describe(v, c.strides[2], c.layout, 0, p.seq_kv), dtype, "v", tv); !st) return st;
  if (status st = cs.tensor(describe(o, c.strides[3], c.layout, r0, rows), dtype, "o", to); !st) return st;
  if (status st = mask_tensor(p, mask, c.band, cs, tmask); !st) return st;
  // softmaxMax and softmaxSum: required outputs, [B, N, rows, 8] floats each, in one buffer.
  const index_t stat_elems = p.batch * p.heads * rows * softmax_stat_width;
  void* stats = nullptr;
  if (status st = cs.buffer(2 * static_cast<std::uint64_t>(stat_elems) * sizeof(float), "softmax max and sum", stats);
      !st)
    return st;
  tensor_desc sd;
  sd.dims = {p.batch, p.heads, rows, softmax_stat_width};
  sd.strides = {p.heads * rows * softmax_stat_width, rows * softmax_stat_width, softmax_stat_width, 1};
  place(sd, stats, sizeof(float), 0);
  if (status st = cs.tensor(sd, ACL_FLOAT, "softmax_max", tmax); !st) return st;
  place(sd, stats, sizeof(float), stat_elems);
  if (status st = cs.tensor(sd, ACL_FLOAT, "softmax_sum", tsum); !st) return st;
  char layout[5];
  for (int i = 0; i < 5; ++i) layout[i] = layout_name(c.layout)[i];
  const double scale = p.softmax_scale();
  const double keep_prob = 1.0;
  const std::int64_t inner_precise = 0;
  if (status st = cs.prepare("aclnnFlashAttentionScoreGetWorkspaceSize", "aclnnFlashAttentionScore",
                             aclnnFlashAttentionScore,
                             [&](std::uint64_t* ws, aclOpExecutor** ex) {
                               return aclnnFlashAttentionScoreGetWorkspaceSize(
                                   tq, tk, tv, nullptr, nullptr, nullptr, tmask, nullptr, scale, keep_prob,
                                   c.band.pre_tokens, c.band.next_tokens, p.heads, layout, inner_precise,
                                   c.band.sparse_mode, tmax, tsum, nullptr, to, ws, ex);
                             });
      !st)
    return st;
  if (lse == nullptr) return {};
  // lse[b][h][r0 + i] = log(sum[b][h][i][0]) + max[b][h][i][0]
  tensor_desc stat_col;
  stat_col.rank = 3;
  stat_col.dims = {p.batch, p.heads, rows, 0};
  stat_col.strides = {p.heads * rows * softmax_stat_width, rows * softmax_stat_width, softmax_stat_width, 0};
  aclTensor *sum_col = nullptr, *max_col = nullptr, *lse_rows = nullptr;
  place(stat_col, stats, sizeof(float), stat_elems);
  if (status st = cs.tensor(stat_col, ACL_FLOAT, "softmax_sum column", sum_col); !st) return st;
  place(stat_col, stats, sizeof(float), 0);
  if (status st = cs.tensor(stat_col, ACL_FLOAT, "softmax_max column", max_col); !st) return st;
  if (status st = cs.tensor(lse_view(p, lse, r0, rows), ACL_FLOAT, "lse", lse_rows); !st) return st;
  aclScalar* one = nullptr;
  if (status st = cs.scalar(1.0f, one); !st) return st;
  if (status st = cs.prepare("aclnnLogGetWorkspaceSize", "aclnnLog", aclnnLog,
                             [&](std::uint64_t* ws, aclOpExecutor** ex) {
                               return aclnnLogGetWorkspaceSize(sum_col, lse_rows, ws, ex);
                             });
      !st)
    return st;
  return cs.prepare("aclnnInplaceAddGetWorkspaceSize", "aclnnInplaceAdd", aclnnInplaceAdd,
                    [&](std::uint64_t* ws, aclOpExecutor** ex) {
                      return aclnnInplaceAddGetWorkspaceSize(lse_rows, max_col, one, ws, ex);
                    });
}

/// aclnnIncreFlashAttentionV4 for one query row: K and V as packed caches of kv_capacity rows per head starting at
/// the row's first key, read for keys.end − keys.begin rows (actualSeqLengths, one per batch entry).
template <class T>
status prepare_decode(const call_plan& c, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                      const tensor_ref<const T>& v, const tensor_ref<T>& o, aclDataType dtype, call_state& cs) {
  aclTensor *tq = nullptr, *to = nullptr;
  if (status st = cs.tensor(describe(q, c.strides[0], c.layout, 0, 1), dtype, "q", tq); !st) return st;
  if (status st = cs.tensor(describe(o, c.strides[3], c.layout, 0, 1), dtype, "o", to); !st) return st;
  const kv_span keys = c.band.keys;
  aclTensorList* lists[2] = {nullptr, nullptr};
  const tensor_ref<const T>* kv[2] = {&k, &v};
  const char* names[2] = {"k", "v"};
  for (int i = 0; i < 2; ++i) {
    tensor_desc d = describe(*kv[i], c.strides[1 + i], c.layout, keys.begin, c.kv_capacity);
    const std::int64_t storage[1] = {d.storage};
    acl_tensor t(aclCreateTensor(d.dims.data(), d.rank, dtype, d.strides.data(), d.offset, ACL_FORMAT_ND, storage, 1,
                                 d.base));
    if (t.get() == nullptr) return null_from((std::string("aclCreateTensor(") + names[i] + ")").c_str());
    const aclTensor* members[1] = {t.get()};
    lists[i] = aclCreateTensorList(members, 1);
    if (lists[i] == nullptr) return null_from("aclCreateTensorList");
    t.release();  // the list owns it now
    cs.lists.emplace_back(lists[i]);
  }
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(p.batch), keys.end - keys.begin);
  aclIntArray* actual = aclCreateIntArray(lengths.data(), lengths.size());
  if (actual == nullptr) return null_from("aclCreateIntArray");
  cs.int_arrays.emplace_back(actual);
  char layout[5];
  for (int i = 0; i < 5; ++i) layout[i] = layout_name(c.layout)[i];
  const double scale = p.softmax_scale();
  const std::int64_t block_size = 0, inner_precise = 0;  // no paged cache; high precision
  return cs.prepare("aclnnIncreFlashAttentionV4GetWorkspaceSize", "aclnnIncreFlashAttentionV4",
                    aclnnIncreFlashAttentionV4, [&](std::uint64_t* ws, aclOpExecutor** ex) {
                      return aclnnIncreFlashAttentionV4GetWorkspaceSize(
                          tq, lists[0], lists[1], nullptr, nullptr, actual, nullptr, nullptr, nullptr, nullptr,
                          nullptr, nullptr, nullptr, nullptr, nullptr, p.heads, scale, layout, p.heads_kv, block_size,
                          inner_precise, to, ws, ex);
                    });
}

/// policy::ascend's attend after validation: plan, create every tensor, prepare every operator (workspaces
/// allocated), and only then launch them; returns after the stream has finished the call.
template <class T, class Bound>
status attend(const policy::ascend& pol, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
              const tensor_ref<const T>& v, const tensor_ref<T>& o, const Bound& mask, float* lse) {
  const call_plan c = make_plan(p, q, k, v, o, mask, lse);
  if (!c.st) return c.st;
  if (p.batch == 0 || p.heads == 0 || p.seq_q == 0) return {};
  if constexpr (acl_dtype_code<T>() >= 0) {
    const auto dtype = static_cast<aclDataType>(acl_dtype_code<T>());
    try {
      call_state cs;
      if (c.band.rows() > 0) {
        status st = c.op == op_kind::incre_flash_attention_v4
                        ? prepare_decode(c, p, q, k, v, o, dtype, cs)
                        : prepare_flash(c, p, q, k, v, o, mask, lse, dtype, cs);
        if (!st) return st;
      }
      if (status st = prepare_empty_rows(c, p, o, lse, dtype, cs); !st) return st;
      return cs.launch_all(static_cast<aclrtStream>(pol.stream));
    } catch (const std::bad_alloc&) {
      return {errc::out_of_memory, "policy::ascend: host memory for the call's CANN descriptions ran out"};
    }
  } else {
    return c.st;
  }
}

}  // namespace ascend_backend

namespace detail {
/// policy::ascend: see ascend_backend::attend. Pointers must be device memory of the current device.
template <class T, class Bound>
status run(const policy::ascend& pol, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
           const tensor_ref<const T>& v, const tensor_ref<T>& o, const Bound& mask, float* lse) {
  if (status st = mods_unsupported(mods_of(mask), "the Ascend backend"); !st) return st;
  return ascend_backend::attend(pol, p, q, k, v, o, mask, lse);
}

/// fa::plan for policy::ascend: the operator attend would run, the backend's own device memory (the operators'
/// workspaces are known only from their GetWorkspaceSize, which plan does not call), and why a call is not fused.
template <class T, class Bound>
kernel_plan plan_run(const policy::ascend&, const problem& p, const tensor_ref<const T>& q,
                     const tensor_ref<const T>& k, const tensor_ref<const T>& v, const tensor_ref<T>& o,
                     const Bound& mask, const float* lse) {
  if (status st = mods_unsupported(mods_of(mask), "the Ascend backend"); !st) {
    kernel_plan r;
    r.st = std::move(st);
    return r;
  }
  ascend_backend::call_plan c = ascend_backend::make_plan(p, q, k, v, o, mask, lse);
  kernel_plan r;
  if (!c.st) {
    r.st = std::move(c.st);
    return r;
  }
  if (p.batch == 0 || p.heads == 0 || p.seq_q == 0) {
    r.kernel = "ascend.none";
    r.why = "nothing to compute: batch x heads x seq_q is 0, so nothing is written";
    return r;
  }
  if (c.band.rows() == 0) {
    r.kernel = "ascend.no_keys";
    r.why = "no query row sees a key: O is set to 0 (aclnnInplaceZero) and lse to -inf (aclnnInplaceFillScalar) "
            "without an attention operator";
    return r;
  }
  r.kernel = ascend_backend::kernel_name(c.op);
  r.scratch_bytes = static_cast<std::size_t>(c.scratch_bytes);
  r.fused = c.why.empty();
  r.why = std::move(c.why);
  return r;
}
}  // namespace detail
}  // namespace fusedattn
