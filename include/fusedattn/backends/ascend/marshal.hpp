/// @file marshal.hpp
/// How one fusedattn call maps onto CANN's attention operators, decided without calling CANN: the layout string
/// (BNSD or BSND) and each operand's strided view, the query rows that see a key, the sparse mode and token bounds
/// of a band mask, and the choice between aclnnFlashAttentionScore and aclnnIncreFlashAttentionV4. Plain data.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../../core/plan.hpp"
#include "../../core/problem.hpp"
#include "../../core/status.hpp"
#include "../../core/tensor.hpp"
#include "../../core/types.hpp"
#include "../../core/validate.hpp"
#include "../../kernels/block_sparse.hpp"
#include "../../kernels/mask.hpp"

namespace fusedattn {
namespace ascend_backend {

/// The two inputLayout values fusedattn's strided views map onto.
enum class layout_kind { bnsd, bsnd };
inline const char* layout_name(layout_kind l) { return l == layout_kind::bnsd ? "BNSD" : "BSND"; }

/// aclnnFlashAttentionScore's sparseMode values used here (CANN's sparse_mode table).
inline constexpr std::int64_t sparse_default = 0;            ///< no mask, or a full mask with matching token bounds
inline constexpr std::int64_t sparse_all_mask = 1;           ///< a full [Sq, Skv] (or [B|1, N|1, Sq, Skv]) mask
inline constexpr std::int64_t sparse_left_up_causal = 2;     ///< j <= i; the compressed 2048×2048 mask
inline constexpr std::int64_t sparse_right_down_causal = 3;  ///< j <= i + Skv − Sq; the compressed mask
inline constexpr std::int64_t sparse_band = 4;  ///< −preTokens <= j − i − (Skv − Sq) <= nextTokens; the compressed mask
/// preTokens / nextTokens where the sparse mode ignores them (CANN's own default).
inline constexpr std::int64_t unbounded_tokens = 2147483647;
/// Side of the compressed causal mask of sparse modes 2, 3 and 4: mask[i][j] = 1 (masked) iff j > i.
inline constexpr std::int64_t compressed_mask_side = 2048;
/// Floats per query row of aclnnFlashAttentionScore's softmaxMax and softmaxSum outputs ([B, N, Sq, 8] each).
inline constexpr std::int64_t softmax_stat_width = 8;

/// Limits of the operators as documented (Atlas A2): aclnnFlashAttentionScore takes N <= 256 query heads and
/// S <= 1M; aclnnIncreFlashAttentionV4 takes B <= 65536, D <= 512 and at most 64 query heads per key/value head.
inline constexpr index_t fa_max_heads = 256;
inline constexpr index_t fa_max_seq = index_t(1) << 20;
inline constexpr index_t fa_max_batch = index_t(2) << 20;
inline constexpr index_t ifa_max_batch = 65536;
inline constexpr index_t ifa_max_head_dim = 512;
inline constexpr index_t ifa_max_group = 64;

/// Strides of the batch, head and sequence axes (logical order) as CANN is given them.
using axis_strides = std::array<index_t, 3>;

/// True when the rows of `t` nest in `l`'s axis order: each outer axis steps over everything the inner ones cover
/// (padding allowed). `st` receives the strides, with an axis of extent 1 given the stride it would have packed.
template <class T>
bool nested_strides(const tensor_ref<T>& t, layout_kind l, axis_strides& st) {
  static constexpr int bnsd_inner_to_outer[3] = {2, 1, 0};  // s, h, b
  static constexpr int bsnd_inner_to_outer[3] = {1, 2, 0};  // h, s, b
  const int* order = l == layout_kind::bnsd ? bnsd_inner_to_outer : bsnd_inner_to_outer;
  const index_t ext[3] = {t.dims.b, t.dims.h, t.dims.s};
  const index_t given[3] = {t.stride.b, t.stride.h, t.stride.s};
  index_t covered = t.dims.d;  // elements one step of the next axis must pass over
  for (int k = 0; k < 3; ++k) {
    const int a = order[k];
    const index_t s = ext[a] == 1 ? covered : given[a];
    if (s < covered) return false;
    st[static_cast<std::size_t>(a)] = s;
    if (!detail::mul_ok(s, ext[a], covered)) return false;
  }
  return true;
}

/// "b 8192, h 64, s 512": a view's strides for messages.
template <class T>
std::string strides_text(const tensor_ref<T>& t) {
  return "b " + std::to_string(t.stride.b) + ", h " + std::to_string(t.stride.h) + ", s " + std::to_string(t.stride.s);
}

/// The layout q, k, v and o share, with each one's strides; errc::unsupported naming the operand otherwise.
template <class T>
status choose_layout(const tensor_ref<const T>& q, const tensor_ref<const T>& k, const tensor_ref<const T>& v,
                     const tensor_ref<T>& o, layout_kind& layout, std::array<axis_strides, 4>& st) {
  const tensor_ref<const T> views[4] = {q, k, v, o};
  const char* names[4] = {"q", "k", "v", "o"};
  bool fits[2][4];
  for (int l = 0; l < 2; ++l)
    for (int i = 0; i < 4; ++i) fits[l][i] = nested_strides(views[i], layout_kind(l), st[static_cast<std::size_t>(i)]);
  for (int l = 0; l < 2; ++l) {
    if (fits[l][0] && fits[l][1] && fits[l][2] && fits[l][3]) {
      layout = layout_kind(l);
      for (int i = 0; i < 4; ++i) nested_strides(views[i], layout, st[static_cast<std::size_t>(i)]);
      return {};
    }
  }
  for (int i = 0; i < 4; ++i)
    if (!fits[0][i] && !fits[1][i])
      return {errc::unsupported, std::string("policy::ascend: ") + names[i] + "'s strides (" + strides_text(views[i]) +
                                     ") lay its rows out neither B·N·S·D nor B·S·N·D, the two inputLayouts CANN's "
                                     "attention operators read strided views of"};
  const int a = fits[0][0] ? 0 : 1;  // q fits one layout, another operand only the other
  for (int i = 1; i < 4; ++i)
    if (fits[a][i] != fits[a][0])
      return {errc::unsupported, std::string("policy::ascend: q is laid out ") + (a == 0 ? "B·N·S·D" : "B·S·N·D") +
                                     " but " + names[i] + " is " + (a == 0 ? "B·S·N·D" : "B·N·S·D") +
                                     "; aclnnFlashAttentionScore takes one inputLayout for query, key, value and output"};
  return {errc::unsupported, "policy::ascend: q, k, v and o share no layout"};
}

/// A 4-D (or 3-D) view as aclCreateTensor takes it: extents and strides in the layout's axis order, an element
/// offset from a 32-byte aligned base address (CANN asks tensor addresses to be 32-byte aligned) and a 1-D storage
/// of `storage` elements from that base.
struct tensor_desc {
  std::array<std::int64_t, 4> dims{};
  std::array<std::int64_t, 4> strides{};
  std::uint64_t rank = 4;
  std::int64_t offset = 0;
  std::int64_t storage = 0;
  void* base = nullptr;
};

/// Alignment CANN asks of a tensor's address.
inline constexpr std::uintptr_t tensor_alignment = 32;

/// Fills `d.base` and `d.offset` for data at `ptr` (elements of `elem` bytes) plus `elements`, and `d.storage` from
/// the extents and strides. False when `ptr` is not a multiple of `elem` past the aligned base.
inline bool place(tensor_desc& d, const void* ptr, std::size_t elem, std::int64_t elements) {
  const auto a = reinterpret_cast<std::uintptr_t>(ptr);
  const std::uintptr_t base = a & ~(tensor_alignment - 1);
  if ((a - base) % elem != 0) return false;
  d.base = reinterpret_cast<void*>(base);
  d.offset = static_cast<std::int64_t>((a - base) / elem) + elements;
  std::int64_t span = 1;
  for (std::uint64_t i = 0; i < d.rank; ++i)
    if (d.dims[i] == 0) span = 0;
  if (span != 0)
    for (std::uint64_t i = 0; i < d.rank; ++i) span += (d.dims[i] - 1) * d.strides[i];
  d.storage = d.offset + span;
  return true;
}

/// Rows [s_begin, s_begin + s_count) of a (b, h, s, d) view with strides `st`, in `layout`'s axis order.
template <class T>
tensor_desc describe(const tensor_ref<T>& t, const axis_strides& st, layout_kind layout, index_t s_begin,
                     index_t s_count) {
  tensor_desc d;
  if (layout == layout_kind::bnsd) {
    d.dims = {t.dims.b, t.dims.h, s_count, t.dims.d};
    d.strides = {st[0], st[1], st[2], 1};
  } else {
    d.dims = {t.dims.b, s_count, t.dims.h, t.dims.d};
    d.strides = {st[0], st[2], st[1], 1};
  }
  const bool ok = place(d, t.data, sizeof(T), s_begin * st[2]);
  FUSEDATTN_ASSERT(ok);
  (void)ok;
  return d;
}

/// How a band mask runs on aclnnFlashAttentionScore. Only query rows [row_begin, row_end) see a key (the others get
/// O = 0 and lse = −inf from fusedattn, never from the operator, which documents no result for a fully masked row);
/// the operator sees those rows as its whole query, with the band re-expressed for them.
struct band_plan {
  index_t row_begin = 0;
  index_t row_end = 0;
  std::int64_t sparse_mode = sparse_default;
  std::int64_t pre_tokens = unbounded_tokens;
  std::int64_t next_tokens = unbounded_tokens;
  bool compressed_mask = false;  ///< sparse modes 2, 3, 4 read the 2048×2048 causal mask
  kv_span keys{};                ///< keys of row row_begin (the decode operator's range when one row remains)

  index_t rows() const { return row_end - row_begin; }
};

/// The sparse mode and token bounds for band `m` (allowed iff lo <= j − i <= hi and 0 <= j < seq_kv).
inline band_plan plan_band(const band_mask& m) {
  band_plan b;
  const index_t sq = m.seq_q, skv = m.seq_kv;
  if (skv > 0 && m.lo <= m.hi) {
    // Row i sees a key iff i + hi >= 0 and i + lo <= skv − 1: an interval of rows.
    const index_t first = m.hi < 0 ? -m.hi : 0;
    const index_t end = skv - m.lo;  // lo > −2^61, so this cannot overflow
    b.row_begin = first < sq ? first : sq;
    b.row_end = end < b.row_begin ? b.row_begin : (end < sq ? end : sq);
  }
  const index_t rows = b.rows();
  if (rows == 0) return b;
  FUSEDATTN_ASSERT(!m.row_range(b.row_begin).empty() && !m.row_range(b.row_end - 1).empty());
  b.keys = m.row_range(b.row_begin);
  // The band of the operator's rows i' = i − row_begin, clamped to the differences j − i' that exist.
  const index_t lo_min = -(rows - 1), hi_max = skv - 1;
  index_t lo = m.lo + b.row_begin, hi = m.hi + b.row_begin;
  if (lo < lo_min) lo = lo_min;
  if (hi > hi_max) hi = hi_max;
  if (lo == lo_min && hi == hi_max) return b;  // every pair: no mask
  b.compressed_mask = true;
  if (lo == lo_min && hi == skv - rows) {
    b.sparse_mode = sparse_right_down_causal;
    b.next_tokens = 0;
  } else if (lo == lo_min && hi == 0) {
    b.sparse_mode = sparse_left_up_causal;
    b.next_tokens = 0;
  } else {
    // Band mode counts from the bottom-right corner: −pre <= (j − i') − (skv − rows) <= next.
    b.sparse_mode = sparse_band;
    b.pre_tokens = (skv - rows) - lo;
    b.next_tokens = hi - (skv - rows);
  }
  return b;
}

/// The CANN operator a call runs.
enum class op_kind { flash_attention_score, incre_flash_attention_v4 };
inline const char* kernel_name(op_kind k) {
  return k == op_kind::flash_attention_score ? "ascend.flash_attention_score" : "ascend.incre_flash_attention_v4";
}

/// aclDataType of a storage type, or ACL_DT_UNDEFINED (-1) for double, which the operators do not take.
template <class T>
constexpr int acl_dtype_code() {
  if constexpr (std::is_same_v<T, float>) return 0;             // ACL_FLOAT
  else if constexpr (std::is_same_v<T, Eigen::half>) return 1;  // ACL_FLOAT16
  else if constexpr (std::is_same_v<T, Eigen::bfloat16>) return 27;  // ACL_BF16
  else return -1;
}

/// The decode operator's view of K or V: the cache of `capacity` rows per head the view lies in, packed, starting at
/// key `keys.begin`; the operator reads the first keys.end − keys.begin rows of each (actualSeqLengths).
struct cache_view {
  index_t capacity = 0;
  bool ok = false;
};

/// The cache a K or V view lies in, when its rows are packed per head (only the head or batch stride may exceed what
/// the rows need, by whole rows): aclnnIncreFlashAttentionV4 reads contiguous tensors only.
template <class T>
cache_view packed_cache(const tensor_ref<const T>& t, const axis_strides& st, layout_kind layout) {
  const index_t d = t.dims.d, n = t.dims.h;
  cache_view c;
  if (layout == layout_kind::bnsd) {
    if (st[2] != d) return c;
    if (n == 1) {  // one head: the batch stride holds the capacity
      if (st[0] % d != 0) return c;
      c.capacity = t.dims.b == 1 ? t.dims.s : st[0] / d;
      c.ok = true;
      return c;
    }
    if (st[1] % d != 0) return c;
    c.capacity = st[1] / d;
    c.ok = st[0] == n * st[1];
  } else {
    if (st[1] != d || st[2] != n * d || st[0] % (n * d) != 0) return c;
    c.capacity = st[0] / (n * d);
    c.ok = true;
  }
  return c;
}

/// Everything a call needs decided before CANN is called; `st` is ok when attend would run.
struct call_plan {
  status st{};
  op_kind op = op_kind::flash_attention_score;
  layout_kind layout = layout_kind::bnsd;
  std::array<axis_strides, 4> strides{};  ///< q, k, v, o
  band_plan band{};                       ///< rows and sparse mode (block-sparse: every row, sparse_all_mask)
  bool block_sparse = false;
  index_t kv_capacity = 0;                ///< decode: rows per head of K and V as the operator sees them
  std::uint64_t scratch_bytes = 0;        ///< the backend's own device memory (operator workspaces not counted)
  std::string why;                        ///< why the call is not fused, when it is not
};

/// Bytes of the full mask a block-sparse call uploads (one byte per (pattern, i, j)), or 0 on overflow.
inline std::uint64_t block_mask_bytes(const block_sparse_mask& m, index_t batch, index_t heads) {
  const index_t patterns = m.pattern_heads > 1 ? batch * heads : m.pattern_batch;
  index_t n = 0;
  if (!detail::mul_ok(patterns, m.seq_q, n) || !detail::mul_ok(n, m.seq_kv, n)) return 0;
  return static_cast<std::uint64_t>(n);
}

/// Bytes of mask a call uploads besides the shared compressed one: none for a band.
inline std::uint64_t mask_upload_bytes(const band_mask&, index_t, index_t) { return 0; }
inline std::uint64_t mask_upload_bytes(const block_sparse_mask& m, index_t batch, index_t heads) {
  return block_mask_bytes(m, batch, heads);
}

/// The plan of a band-masked call: aclnnIncreFlashAttentionV4 for one query row of f16 / bf16 without lse (the
/// row's keys are a contiguous range, so K and V are narrowed to it and no mask is needed), else
/// aclnnFlashAttentionScore with the band's sparse mode.
template <class T>
void plan_mask(call_plan& c, const problem& p, const band_mask& m, const float* lse) {
  c.band = plan_band(m);
  const index_t rows = c.band.rows();
  const bool half = std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>;
  if (rows == 1 && p.seq_q == 1 && half && lse == nullptr && p.batch <= ifa_max_batch &&
      p.head_dim <= ifa_max_head_dim && p.group_size() <= ifa_max_group)
    c.op = op_kind::incre_flash_attention_v4;
}

/// The plan of a block-sparse call: sparse mode 1 with the layout expanded to a full mask, exact, but an
/// Sq×Skv-byte intermediate; a row that sees no key is refused (the operator documents no result for it).
template <class T>
void plan_mask(call_plan& c, const problem& p, const block_sparse_mask& m, const float*) {
  c.block_sparse = true;
  if (block_mask_bytes(m, p.batch, p.heads) == 0) {
    c.st = {errc::out_of_memory, "policy::ascend: the full mask of this block_sparse call would exceed 2^63 bytes"};
    return;
  }
  c.band.row_begin = 0;
  c.band.row_end = p.seq_q;
  c.band.sparse_mode = sparse_all_mask;
  const index_t patterns = m.pattern_batch * m.pattern_heads;
  for (index_t pt = 0; pt < patterns; ++pt) {
    const block_sparse_mask head = for_head(m, pt / m.pattern_heads, pt % m.pattern_heads);
    for (index_t i = 0; i < p.seq_q; ++i)
      if (head.num_segments(i, i + 1) == 0) {
        c.st = {errc::unsupported,
                "policy::ascend: block_sparse query row " + std::to_string(i) + " (pattern " + std::to_string(pt) +
                    ") sees no key; aclnnFlashAttentionScore documents no result for a fully masked row, so fusedattn "
                    "cannot give it O = 0 and lse = -inf there"};
        return;
      }
  }
  c.why = "block_sparse runs as a full Sq×Skv attention mask (sparseMode 1): CANN's fused attention has no block "
          "list input, so the layout becomes " + std::to_string(block_mask_bytes(m, p.batch, p.heads)) +
          " bytes of mask";
}

/// Decides how `attend` runs a validated call on policy::ascend; the status says why not when it cannot.
template <class T, class Bound>
call_plan make_plan(const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                    const tensor_ref<const T>& v, const tensor_ref<T>& o, const Bound& mask, const float* lse) {
  call_plan c;
  if constexpr (acl_dtype_code<T>() < 0) {
    c.st = {errc::unsupported, std::string("policy::ascend: CANN's fused attention takes f16, bf16 and f32; this call "
                                           "is ") + scalar_name<T>()};
    return c;
  }
  if (p.batch == 0 || p.heads == 0 || p.seq_q == 0) return c;  // nothing to compute or write
  if (p.heads > fa_max_heads) {
    c.st = {errc::unsupported, "policy::ascend: problem.heads is " + std::to_string(p.heads) +
                                   "; aclnnFlashAttentionScore takes at most " + std::to_string(fa_max_heads)};
    return c;
  }
  if (p.seq_q > fa_max_seq || p.seq_kv > fa_max_seq || p.batch > fa_max_batch) {
    c.st = {errc::unsupported, "policy::ascend: aclnnFlashAttentionScore takes sequences of at most 1048576 and "
                               "batches of at most 2097152; this call has seq_q " + std::to_string(p.seq_q) +
                                   ", seq_kv " + std::to_string(p.seq_kv) + ", batch " + std::to_string(p.batch)};
    return c;
  }
  if (status st = choose_layout(q, k, v, o, c.layout, c.strides); !st) {
    c.st = std::move(st);
    return c;
  }
  plan_mask<T>(c, p, mask, lse);
  if (!c.st) return c;
  if (c.op == op_kind::incre_flash_attention_v4) {
    // The decode operator reads packed tensors: q and o of one row per head, K and V as packed caches of one size.
    const auto packed_row = [&](const tensor_ref<const T>& t) {
      return (t.dims.h == 1 || t.stride.h == t.dims.d) && (t.dims.b == 1 || t.stride.b == t.dims.h * t.dims.d);
    };
    const cache_view kc = packed_cache(k, c.strides[1], c.layout), vc = packed_cache(v, c.strides[2], c.layout);
    if (!packed_row(q) || !packed_row(tensor_ref<const T>(o)) || !kc.ok || !vc.ok || kc.capacity != vc.capacity)
      c.op = op_kind::flash_attention_score;
    else
      c.kv_capacity = kc.capacity;
  }
  if (c.op == op_kind::flash_attention_score && c.band.rows() > 0) {
    const std::uint64_t stats = 2ull * static_cast<std::uint64_t>(p.batch * p.heads * c.band.rows()) *
                                softmax_stat_width * sizeof(float);
    c.scratch_bytes = stats + mask_upload_bytes(mask, p.batch, p.heads);
  }
  return c;
}

}  // namespace ascend_backend
}  // namespace fusedattn
