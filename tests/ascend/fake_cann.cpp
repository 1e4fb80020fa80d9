// The recording fake of CANN (fake_cann.hpp): host memory stands for device memory, operators run at launch.
#include "fake_cann.hpp"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Core>

struct aclTensor {
  fake_cann::tensor_record r;
};
struct aclScalar {
  double value = 0;
  aclDataType dtype = ACL_DT_UNDEFINED;
};
struct aclIntArray {
  std::vector<std::int64_t> values;
};
struct aclTensorList {
  std::vector<aclTensor*> tensors;
};
struct aclOpExecutor {
  std::string name;
  std::uint64_t workspace = 0;
  std::function<void()> run;
  bool repeatable = false;
};

namespace fake_cann {
namespace {

journal g_log;
failures g_fail;
std::string g_error;
std::set<void*> g_allocations;
std::set<const void*> g_checked_masks;
int g_objects = 0;
int g_executors = 0;

constexpr aclnnStatus err_nullptr = 161001;
constexpr aclnnStatus err_param = 161002;
constexpr aclnnStatus err_inner = 561002;
constexpr aclError err_memory = 207001;
constexpr std::int64_t workspace_bytes = 4096;

aclnnStatus fail(std::string message, aclnnStatus code = err_param) {
  g_error = std::move(message);
  return code;
}

std::size_t dtype_size(aclDataType t) {
  switch (t) {
    case ACL_FLOAT: return 4;
    case ACL_FLOAT16:
    case ACL_BF16: return 2;
    case ACL_UINT8:
    case ACL_BOOL: return 1;
    default: return 0;
  }
}

/// Address of element `idx` (one index per view dimension).
char* address(const tensor_record& t, const std::int64_t* idx) {
  std::int64_t e = t.offset;
  for (std::size_t i = 0; i < t.dims.size(); ++i) e += idx[i] * t.strides[i];
  return static_cast<char*>(t.data) + e * static_cast<std::int64_t>(dtype_size(t.dtype));
}

double read(const tensor_record& t, const std::int64_t* idx) {
  const char* p = address(t, idx);
  switch (t.dtype) {
    case ACL_FLOAT: { float x; std::memcpy(&x, p, 4); return x; }
    case ACL_FLOAT16: { Eigen::half x; std::memcpy(&x, p, 2); return static_cast<double>(x); }
    case ACL_BF16: { Eigen::bfloat16 x; std::memcpy(&x, p, 2); return static_cast<double>(x); }
    case ACL_UINT8:
    case ACL_BOOL: return static_cast<double>(*reinterpret_cast<const std::uint8_t*>(p));
    default: return std::numeric_limits<double>::quiet_NaN();
  }
}

void write(const tensor_record& t, const std::int64_t* idx, double v) {
  char* p = address(t, idx);
  switch (t.dtype) {
    case ACL_FLOAT: { const float x = static_cast<float>(v); std::memcpy(p, &x, 4); break; }
    case ACL_FLOAT16: { const Eigen::half x(static_cast<float>(v)); std::memcpy(p, &x, 2); break; }
    case ACL_BF16: { const Eigen::bfloat16 x(static_cast<float>(v)); std::memcpy(p, &x, 2); break; }
    default: break;
  }
}

/// Every element of the view lies inside the storage, and the address is 32-byte aligned.
bool placed(const tensor_record& t) {
  if (reinterpret_cast<std::uintptr_t>(t.data) % 32 != 0 || t.offset < 0) return false;
  std::int64_t storage = 1, last = t.offset;
  for (std::int64_t s : t.storage) storage *= s;
  for (std::size_t i = 0; i < t.dims.size(); ++i) {
    if (t.dims[i] == 0) return true;
    last += (t.dims[i] - 1) * t.strides[i];
  }
  return last < storage;
}

/// Strides are the row-major ones of the dims (what "contiguous" means to CANN).
bool contiguous(const tensor_record& t) {
  std::int64_t expect = 1;
  for (std::size_t i = t.dims.size(); i-- > 0;) {
    if (t.dims[i] != 1 && t.strides[i] != expect) return false;
    expect *= t.dims[i];
  }
  return true;
}

/// Calls f(idx) for every index of `dims`.
template <class F>
void for_each_index(const std::vector<std::int64_t>& dims, F&& f) {
  std::vector<std::int64_t> idx(dims.size(), 0);
  for (std::int64_t d : dims)
    if (d == 0) return;
  while (true) {
    f(idx.data());
    std::size_t i = dims.size();
    while (i > 0) {
      --i;
      if (++idx[i] < dims[i]) break;
      idx[i] = 0;
      if (i == 0) return;
    }
    if (dims.empty()) return;
  }
}

/// (b, n, s, d) → the index of a BNSD or BSND view.
struct axes {
  bool bsnd = false;
  void at(std::int64_t* idx, std::int64_t b, std::int64_t n, std::int64_t s, std::int64_t d) const {
    idx[0] = b;
    idx[1] = bsnd ? s : n;
    idx[2] = bsnd ? n : s;
    idx[3] = d;
  }
  std::int64_t n(const tensor_record& t) const { return bsnd ? t.dims[2] : t.dims[1]; }
  std::int64_t s(const tensor_record& t) const { return bsnd ? t.dims[1] : t.dims[2]; }
};

/// One attention row in float64: keys j with allowed(j), scaled by `scale`. Returns false when no key is allowed.
template <class Allowed>
bool attention_row(const tensor_record& q, const tensor_record& k, const tensor_record& v, const axes& ax,
                   std::int64_t b, std::int64_t n1, std::int64_t n2, std::int64_t i, std::int64_t skv, double scale,
                   Allowed&& allowed, std::vector<double>& out, double& m, double& l) {
  const std::int64_t d = q.dims[3];
  std::int64_t idx[4];
  std::vector<double> s(static_cast<std::size_t>(skv));
  m = -std::numeric_limits<double>::infinity();
  bool any = false;
  for (std::int64_t j = 0; j < skv; ++j) {
    if (!allowed(j)) continue;
    double dot = 0;
    for (std::int64_t c = 0; c < d; ++c) {
      ax.at(idx, b, n1, i, c);
      const double x = read(q, idx);
      ax.at(idx, b, n2, j, c);
      dot += x * read(k, idx);
    }
    s[static_cast<std::size_t>(j)] = scale * dot;
    m = std::max(m, s[static_cast<std::size_t>(j)]);
    any = true;
  }
  if (!any) return false;
  l = 0;
  out.assign(static_cast<std::size_t>(d), 0.0);
  for (std::int64_t j = 0; j < skv; ++j) {
    if (!allowed(j)) continue;
    const double e = std::exp(s[static_cast<std::size_t>(j)] - m);
    l += e;
    for (std::int64_t c = 0; c < d; ++c) {
      ax.at(idx, b, n2, j, c);
      out[static_cast<std::size_t>(c)] += e * read(v, idx);
    }
  }
  for (double& x : out) x /= l;
  return true;
}

aclOpExecutor* executor(const char* name, std::function<void()> run) {
  ++g_executors;
  return new aclOpExecutor{name, static_cast<std::uint64_t>(workspace_bytes), std::move(run)};
}

aclnnStatus launch(const char* name, void* workspace, std::uint64_t bytes, aclOpExecutor* ex, aclrtStream stream) {
  g_log.launches.push_back(name);
  g_log.streams.push_back(stream);
  if (ex == nullptr) return fail(std::string(name) + ": null executor", err_nullptr);
  const bool failed = g_fail.launch == name;
  const bool bad_workspace = ex->name != name || bytes != ex->workspace || (bytes > 0 && workspace == nullptr) ||
                             (bytes > 0 && g_allocations.count(workspace) == 0);
  if (!failed && !bad_workspace) ex->run();
  delete ex;
  --g_executors;
  if (failed) return fail(g_fail.message, 507015);
  if (bad_workspace) return fail(std::string(name) + ": workspace does not match its GetWorkspaceSize", err_param);
  return ACL_SUCCESS;
}

bool injected(const char* get_name) { return g_fail.get_workspace == get_name; }

/// The compressed mask of sparse modes 2–4: [2048, 2048], 1 strictly above the diagonal.
bool compressed_mask_ok(const tensor_record& m) {
  if (m.dims != std::vector<std::int64_t>{2048, 2048} || (m.dtype != ACL_UINT8 && m.dtype != ACL_BOOL) || !placed(m))
    return false;
  if (g_checked_masks.count(m.data) != 0) return true;
  bool ok = true;
  for (std::int64_t i = 0; i < 2048 && ok; ++i)
    for (std::int64_t j = 0; j < 2048 && ok; ++j) {
      const std::int64_t idx[2] = {i, j};
      ok = read(m, idx) == (j > i ? 1.0 : 0.0);
    }
  if (ok) g_checked_masks.insert(m.data);
  return ok;
}

}  // namespace

journal& log() { return g_log; }
failures& inject() { return g_fail; }
void reset() {
  g_log = journal{};
  g_fail = failures{};
  g_error.clear();
}
int live_allocations() { return static_cast<int>(g_allocations.size()); }
int live_objects() { return g_objects; }
int pending_executors() { return g_executors; }

}  // namespace fake_cann

using namespace fake_cann;

extern "C" {

aclError aclrtMalloc(void** devPtr, size_t size, aclrtMemMallocPolicy) {
  if (++g_log.mallocs == g_fail.malloc_at) {
    g_error = g_fail.message;
    *devPtr = nullptr;
    return err_memory;
  }
  const std::size_t rounded = (size + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
  if (p == nullptr) return err_memory;
  g_allocations.insert(p);
  *devPtr = p;
  return ACL_SUCCESS;
}
aclError aclrtFree(void* devPtr) {
  if (g_allocations.erase(devPtr) == 0) return fail("aclrtFree of memory aclrtMalloc did not give", 107000);
  std::free(devPtr);
  return ACL_SUCCESS;
}
aclError aclrtMemcpy(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind) {
  if (count > destMax || kind != ACL_MEMCPY_HOST_TO_DEVICE || g_allocations.count(dst) == 0)
    return fail("aclrtMemcpy: unexpected copy", 107000);
  std::memcpy(dst, src, count);
  return ACL_SUCCESS;
}
aclError aclrtSynchronizeStream(aclrtStream) {
  ++g_log.syncs;
  return ACL_SUCCESS;
}
aclError aclrtGetDevice(int32_t* deviceId) {
  *deviceId = 0;
  return ACL_SUCCESS;
}
const char* aclGetRecentErrMsg(void) { return g_error.c_str(); }

aclTensor* aclCreateTensor(const int64_t* viewDims, uint64_t viewDimsNum, aclDataType dataType, const int64_t* stride,
                           int64_t offset, aclFormat format, const int64_t* storageDims, uint64_t storageDimsNum,
                           void* tensorData) {
  auto* t = new aclTensor;
  t->r.dims.assign(viewDims, viewDims + viewDimsNum);
  t->r.strides.assign(stride, stride + viewDimsNum);
  t->r.storage.assign(storageDims, storageDims + storageDimsNum);
  t->r.offset = offset;
  t->r.dtype = dataType;
  t->r.format = format;
  t->r.data = tensorData;
  bool ok = offset >= 0 && dtype_size(dataType) != 0 && reinterpret_cast<std::uintptr_t>(tensorData) % 32 == 0;
  for (std::uint64_t i = 0; i < viewDimsNum; ++i) ok = ok && viewDims[i] >= 0 && stride[i] >= 0;
  if (!ok) {
    delete t;
    g_error = "aclCreateTensor: negative extent, stride or offset, unknown data type, or an address not 32-byte aligned";
    return nullptr;
  }
  ++g_objects;
  return t;
}
aclnnStatus aclDestroyTensor(const aclTensor* tensor) {
  delete tensor;
  --g_objects;
  return ACL_SUCCESS;
}
aclIntArray* aclCreateIntArray(const int64_t* value, uint64_t size) {
  ++g_objects;
  return new aclIntArray{std::vector<std::int64_t>(value, value + size)};
}
aclnnStatus aclDestroyIntArray(const aclIntArray* array) {
  delete array;
  --g_objects;
  return ACL_SUCCESS;
}
aclScalar* aclCreateScalar(void* value, aclDataType dataType) {
  if (dataType != ACL_FLOAT) return nullptr;
  float v;
  std::memcpy(&v, value, sizeof v);
  ++g_objects;
  return new aclScalar{v, dataType};
}
aclnnStatus aclDestroyScalar(const aclScalar* scalar) {
  delete scalar;
  --g_objects;
  return ACL_SUCCESS;
}
aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor* executor) {
  if (executor == nullptr) return fail("aclSetAclOpExecutorRepeatable: null executor", 561103);
  executor->repeatable = true;
  return ACL_SUCCESS;
}
aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor* executor) {
  if (executor == nullptr || !executor->repeatable)
    return fail("aclDestroyAclOpExecutor: the executor is not repeatable", 561103);
  delete executor;
  --g_executors;
  return ACL_SUCCESS;
}
aclTensorList* aclCreateTensorList(const aclTensor* const* value, uint64_t size) {
  auto* l = new aclTensorList;
  for (uint64_t i = 0; i < size; ++i) l->tensors.push_back(const_cast<aclTensor*>(value[i]));
  ++g_objects;
  return l;
}
aclnnStatus aclDestroyTensorList(const aclTensorList* array) {
  for (aclTensor* t : array->tensors) aclDestroyTensor(t);
  delete array;
  --g_objects;
  return ACL_SUCCESS;
}

aclnnStatus aclnnFlashAttentionScoreGetWorkspaceSize(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* realShiftOptional,
    const aclTensor* dropMaskOptional, const aclTensor* paddingMaskOptional, const aclTensor* attenMaskOptional,
    const aclIntArray* prefixOptional, double scaleValue, double keepProb, int64_t preTokens, int64_t nextTokens,
    int64_t headNum, char* inputLayout, int64_t innerPrecise, int64_t sparseMode, const aclTensor* softmaxMaxOut,
    const aclTensor* softmaxSumOut, const aclTensor* softmaxOutOut, const aclTensor* attentionOutOut,
    uint64_t* workspaceSize, aclOpExecutor** executor_out) {
  if (!query || !key || !value || !softmaxMaxOut || !softmaxSumOut || !attentionOutOut || !inputLayout ||
      !workspaceSize || !executor_out)
    return fail("aclnnFlashAttentionScoreGetWorkspaceSize: a required argument is null", err_nullptr);
  flash_call c;
  c.q = query->r;
  c.k = key->r;
  c.v = value->r;
  c.out = attentionOutOut->r;
  c.softmax_max = softmaxMaxOut->r;
  c.softmax_sum = softmaxSumOut->r;
  c.has_mask = attenMaskOptional != nullptr;
  if (c.has_mask) c.mask = attenMaskOptional->r;
  c.other_inputs = realShiftOptional || dropMaskOptional || paddingMaskOptional || prefixOptional || softmaxOutOut;
  c.scale = scaleValue;
  c.keep_prob = keepProb;
  c.pre_tokens = preTokens;
  c.next_tokens = nextTokens;
  c.head_num = headNum;
  c.inner_precise = innerPrecise;
  c.sparse_mode = sparseMode;
  c.layout = inputLayout;
  g_log.flash.push_back(c);
  if (injected("aclnnFlashAttentionScoreGetWorkspaceSize")) return fail(g_fail.message, err_inner);

  if (c.layout != "BNSD" && c.layout != "BSND") return fail("inputLayout " + c.layout + " is not BNSD or BSND");
  const axes ax{c.layout == "BSND"};
  for (const tensor_record* t : {&c.q, &c.k, &c.v, &c.out, &c.softmax_max, &c.softmax_sum})
    if (t->dims.size() != 4 || !placed(*t)) return fail("a tensor is not 4-D or lies outside its storage");
  if (c.q.dtype != c.k.dtype || c.k.dtype != c.v.dtype || c.out.dtype != c.q.dtype ||
      (c.q.dtype != ACL_FLOAT && c.q.dtype != ACL_FLOAT16 && c.q.dtype != ACL_BF16))
    return fail("query, key, value and out must share FLOAT16, BFLOAT16 or FLOAT32");
  const std::int64_t B = c.q.dims[0], N1 = ax.n(c.q), N2 = ax.n(c.k), Sq = ax.s(c.q), Skv = ax.s(c.k), D = c.q.dims[3];
  if (c.q.dims != c.out.dims || c.k.dims != c.v.dims || c.k.dims[0] != B || c.k.dims[3] != D)
    return fail("query/out or key/value shapes differ");
  if (headNum != N1 || N2 == 0 || N1 % N2 != 0 || N1 > 256) return fail("headNum or N1/N2 is wrong");
  const std::vector<std::int64_t> stat{B, N1, Sq, 8};
  if (c.softmax_max.dims != stat || c.softmax_sum.dims != stat || c.softmax_max.dtype != ACL_FLOAT ||
      c.softmax_sum.dtype != ACL_FLOAT)
    return fail("softmaxMax / softmaxSum must be FLOAT [B, N, Sq, 8]");
  if (keepProb != 1.0 || c.other_inputs) return fail("unexpected dropout, pse, padding or prefix input");
  if (sparseMode < 0 || sparseMode > 4) return fail("sparseMode " + std::to_string(sparseMode) + " is not 0..4");
  if (sparseMode == 0 && c.has_mask) return fail("sparse mode 0 with a mask: fusedattn never passes one");
  if (sparseMode >= 2 && !(c.has_mask && compressed_mask_ok(c.mask)))
    return fail("sparse modes 2, 3, 4 need the 2048x2048 compressed causal mask");
  if (sparseMode == 4 && preTokens + nextTokens < 0) return fail("band: preTokens and nextTokens do not intersect");
  if (sparseMode == 1) {
    const auto& m = c.mask.dims;
    const bool shape_ok = c.has_mask && placed(c.mask) && (c.mask.dtype == ACL_UINT8 || c.mask.dtype == ACL_BOOL) &&
                          ((m.size() == 2 && m[0] == Sq && m[1] == Skv) ||
                           (m.size() == 4 && (m[0] == B || m[0] == 1) && (m[1] == N1 || m[1] == 1) && m[2] == Sq &&
                            m[3] == Skv));
    if (!shape_ok) return fail("sparse mode 1 needs a [Sq, Skv] or [B|1, N|1, Sq, Skv] mask");
  }
  *workspaceSize = workspace_bytes;
  *executor_out = executor("aclnnFlashAttentionScore", [c, ax, B, N1, N2, Sq, Skv, D]() {
    const std::int64_t group = N1 / N2;
    std::vector<double> row;
    std::int64_t idx[4];
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t n = 0; n < N1; ++n)
        for (std::int64_t i = 0; i < Sq; ++i) {
          const auto allowed = [&](std::int64_t j) {
            switch (c.sparse_mode) {
              case 1: {
                std::int64_t mi[4];
                if (c.mask.dims.size() == 2) {
                  mi[0] = i;
                  mi[1] = j;
                } else {
                  mi[0] = c.mask.dims[0] == 1 ? 0 : b;
                  mi[1] = c.mask.dims[1] == 1 ? 0 : n;
                  mi[2] = i;
                  mi[3] = j;
                }
                return read(c.mask, mi) == 0.0;
              }
              case 2: return j <= i;
              case 3: return j <= i + Skv - Sq;
              case 4: {
                const std::int64_t diff = j - i - (Skv - Sq);
                return -c.pre_tokens <= diff && diff <= c.next_tokens;
              }
              default: return true;
            }
          };
          double m = 0, l = 0;
          const bool any = attention_row(c.q, c.k, c.v, ax, b, n, n / group, i, Skv, c.scale, allowed, row, m, l);
          for (std::int64_t d = 0; d < D; ++d) {
            ax.at(idx, b, n, i, d);
            // A fully masked row: CANN documents no result; the fake writes NaN so that a caller relying on it fails.
            write(c.out, idx, any ? row[static_cast<std::size_t>(d)] : std::numeric_limits<double>::quiet_NaN());
          }
          for (std::int64_t e = 0; e < 8; ++e) {
            const std::int64_t si[4] = {b, n, i, e};
            write(c.softmax_max, si, any ? m : std::numeric_limits<double>::quiet_NaN());
            write(c.softmax_sum, si, any ? l : std::numeric_limits<double>::quiet_NaN());
          }
        }
  });
  return ACL_SUCCESS;
}
aclnnStatus aclnnFlashAttentionScore(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                                     const aclrtStream stream) {
  return launch("aclnnFlashAttentionScore", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnIncreFlashAttentionV4GetWorkspaceSize(
    const aclTensor* query, const aclTensorList* key, const aclTensorList* value, const aclTensor* pseShift,
    const aclTensor* attenMask, const aclIntArray* actualSeqLengths, const aclTensor* dequantScale1,
    const aclTensor* quantScale1, const aclTensor* dequantScale2, const aclTensor* quantScale2,
    const aclTensor* quantOffset2, const aclTensor* antiquantScale, const aclTensor* antiquantOffset,
    const aclTensor* blocktable, const aclTensor* kvPaddingSize, int64_t numHeads, double scaleValue,
    char* inputLayout, int64_t numKeyValueHeads, int64_t blockSize, int64_t innerPrecise,
    const aclTensor* attentionOut, uint64_t* workspaceSize, aclOpExecutor** executor_out) {
  if (!query || !key || !value || !attentionOut || !inputLayout || !workspaceSize || !executor_out)
    return fail("aclnnIncreFlashAttentionV4GetWorkspaceSize: a required argument is null", err_nullptr);
  decode_call c;
  c.q = query->r;
  c.out = attentionOut->r;
  for (const aclTensor* t : key->tensors) c.k.push_back(t->r);
  for (const aclTensor* t : value->tensors) c.v.push_back(t->r);
  if (actualSeqLengths) c.actual_seq_lengths = actualSeqLengths->values;
  c.other_inputs = pseShift || attenMask || dequantScale1 || quantScale1 || dequantScale2 || quantScale2 ||
                   quantOffset2 || antiquantScale || antiquantOffset || blocktable || kvPaddingSize;
  c.scale = scaleValue;
  c.num_heads = numHeads;
  c.num_kv_heads = numKeyValueHeads;
  c.block_size = blockSize;
  c.inner_precise = innerPrecise;
  c.layout = inputLayout;
  g_log.decode.push_back(c);
  if (injected("aclnnIncreFlashAttentionV4GetWorkspaceSize")) return fail(g_fail.message, err_inner);

  if (c.layout != "BNSD" && c.layout != "BSND") return fail("inputLayout " + c.layout + " is not BNSD or BSND");
  const axes ax{c.layout == "BSND"};
  if (c.k.size() != 1 || c.v.size() != 1) return fail("key and value lists must hold one tensor");
  const tensor_record k = c.k[0], v = c.v[0];
  for (const tensor_record* t : {&c.q, &c.out, &c.k[0], &c.v[0]})
    if (t->dims.size() != 4 || !placed(*t) || !contiguous(*t))
      return fail("IncreFlashAttention takes contiguous 4-D tensors only");
  if (c.q.dtype != k.dtype || k.dtype != v.dtype || c.out.dtype != c.q.dtype ||
      (c.q.dtype != ACL_FLOAT16 && c.q.dtype != ACL_BF16))
    return fail("query, key, value and out must share FLOAT16 or BFLOAT16");
  const std::int64_t B = c.q.dims[0], N1 = ax.n(c.q), N2 = ax.n(k), S = ax.s(k), D = c.q.dims[3];
  if (ax.s(c.q) != 1 || c.q.dims != c.out.dims || k.dims != v.dims || k.dims[0] != B || k.dims[3] != D)
    return fail("query S must be 1; query/out and key/value shapes must agree");
  if (numHeads != N1 || numKeyValueHeads != N2 || N1 % N2 != 0 || N1 / N2 > 64) return fail("head counts are wrong");
  if (c.other_inputs || blockSize != 0) return fail("unexpected optional input");
  if (c.actual_seq_lengths.size() != static_cast<std::size_t>(B)) return fail("actualSeqLengths must hold B values");
  for (std::int64_t a : c.actual_seq_lengths)
    if (a < 1 || a > S) return fail("actualSeqLengths out of range");
  *workspaceSize = workspace_bytes;
  *executor_out = executor("aclnnIncreFlashAttentionV4", [c, k, v, ax, B, N1, N2, D]() {
    std::vector<double> row;
    std::int64_t idx[4];
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t n = 0; n < N1; ++n) {
        const std::int64_t len = c.actual_seq_lengths[static_cast<std::size_t>(b)];
        double m = 0, l = 0;
        attention_row(c.q, k, v, ax, b, n, n / (N1 / N2), 0, len, c.scale, [](std::int64_t) { return true; }, row, m,
                      l);
        for (std::int64_t d = 0; d < D; ++d) {
          ax.at(idx, b, n, 0, d);
          write(c.out, idx, row[static_cast<std::size_t>(d)]);
        }
      }
  });
  return ACL_SUCCESS;
}
aclnnStatus aclnnIncreFlashAttentionV4(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                                       const aclrtStream stream) {
  return launch("aclnnIncreFlashAttentionV4", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnLogGetWorkspaceSize(const aclTensor* self, aclTensor* out, uint64_t* workspaceSize,
                                     aclOpExecutor** executor_out) {
  if (injected("aclnnLogGetWorkspaceSize")) return fail(g_fail.message, err_inner);
  if (!self || !out || self->r.dims != out->r.dims || !placed(self->r) || !placed(out->r))
    return fail("aclnnLog: self and out must have one shape");
  *workspaceSize = workspace_bytes;
  const tensor_record s = self->r, o = out->r;
  *executor_out = executor("aclnnLog", [s, o]() {
    for_each_index(s.dims, [&](const std::int64_t* idx) { write(o, idx, std::log(static_cast<float>(read(s, idx)))); });
  });
  return ACL_SUCCESS;
}
aclnnStatus aclnnLog(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor, aclrtStream stream) {
  return launch("aclnnLog", workspace, workspaceSize, executor, stream);
}
aclnnStatus aclnnInplaceAddGetWorkspaceSize(const aclTensor* selfRef, const aclTensor* other, const aclScalar* alpha,
                                            uint64_t* workspaceSize, aclOpExecutor** executor_out) {
  if (injected("aclnnInplaceAddGetWorkspaceSize")) return fail(g_fail.message, err_inner);
  if (!selfRef || !other || !alpha || selfRef->r.dims != other->r.dims || !placed(selfRef->r) || !placed(other->r))
    return fail("aclnnInplaceAdd: self and other must have one shape");
  *workspaceSize = workspace_bytes;
  const tensor_record s = selfRef->r, o = other->r;
  const double a = alpha->value;
  *executor_out = executor("aclnnInplaceAdd", [s, o, a]() {
    for_each_index(s.dims, [&](const std::int64_t* idx) {
      write(s, idx, static_cast<float>(read(s, idx)) + static_cast<float>(a) * static_cast<float>(read(o, idx)));
    });
  });
  return ACL_SUCCESS;
}
aclnnStatus aclnnInplaceAdd(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor, aclrtStream stream) {
  return launch("aclnnInplaceAdd", workspace, workspaceSize, executor, stream);
}
aclnnStatus aclnnInplaceZeroGetWorkspaceSize(aclTensor* selfRef, uint64_t* workspaceSize,
                                             aclOpExecutor** executor_out) {
  if (injected("aclnnInplaceZeroGetWorkspaceSize")) return fail(g_fail.message, err_inner);
  if (!selfRef || !placed(selfRef->r)) return fail("aclnnInplaceZero: bad tensor");
  *workspaceSize = 0;
  const tensor_record s = selfRef->r;
  *executor_out = executor("aclnnInplaceZero", [s]() {
    for_each_index(s.dims, [&](const std::int64_t* idx) { write(s, idx, 0.0); });
  });
  (*executor_out)->workspace = 0;
  return ACL_SUCCESS;
}
aclnnStatus aclnnInplaceZero(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor, aclrtStream stream) {
  return launch("aclnnInplaceZero", workspace, workspaceSize, executor, stream);
}
aclnnStatus aclnnInplaceFillScalarGetWorkspaceSize(aclTensor* selfRef, const aclScalar* value, uint64_t* workspaceSize,
                                                   aclOpExecutor** executor_out) {
  if (injected("aclnnInplaceFillScalarGetWorkspaceSize")) return fail(g_fail.message, err_inner);
  if (!selfRef || !value || !placed(selfRef->r)) return fail("aclnnInplaceFillScalar: bad tensor");
  *workspaceSize = workspace_bytes;
  const tensor_record s = selfRef->r;
  const double x = value->value;
  *executor_out = executor("aclnnInplaceFillScalar", [s, x]() {
    for_each_index(s.dims, [&](const std::int64_t* idx) { write(s, idx, x); });
  });
  return ACL_SUCCESS;
}
aclnnStatus aclnnInplaceFillScalar(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                                   aclrtStream stream) {
  return launch("aclnnInplaceFillScalar", workspace, workspaceSize, executor, stream);
}

}  // extern "C"
