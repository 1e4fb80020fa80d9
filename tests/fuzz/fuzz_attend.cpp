// libFuzzer harness for fusedattn::attend. The bytes choose a scalar type, a small problem, a layout (axis order,
// padding, broadcast strides) per operand, a mask (band or block-sparse), a thread count, flash tile sizes, whether
// lse is wanted, the input values, and at most one "hostile" mutation (null pointer, shape mismatch, bad stride,
// aliasing, overlapping rows, overflow, bad threads, scale or mask, a block layout built for another problem).
// The bytes may also put a NaN into Q, K or V, or an infinity into V (one element; broadcast strides repeat it),
// make an extent 0 (valid: nothing written, or rows that see no key) or a block size near INT64_MAX. One input in
// 16 goes to fuzz_huge instead: extents, strides, block and tile sizes up to INT64_MAX, where fa::plan and attend
// must refuse alike (same status, nothing written) without overflow or an absurd allocation; one in 16 goes to
// fuzz_serving: attend_paged and attend_ragged on a small paged cache / ragged batch, with at most one bad index.
// Every CPU policy of tests/test_reliability_support.hpp then runs the call, and:
//   - a mutated (invalid) call must return invalid_argument and leave every buffer bitwise unchanged;
//   - a valid call must succeed, leave the inputs and the gaps of O untouched, and agree with the float64 oracle
//     within check.hpp's tolerance widened by the general logit-rounding bound;
//   - with a non-finite input, the outputs it reaches (docs/design.md, Numerics) must be NaN (non-finite for an
//     infinity in V), and every other output must be finite and agree with the oracle as above.
// Any violation aborts, which libFuzzer reports as a crash; ASan and UBSan catch memory and UB errors.
// Build: cmake -S . -B build/fuzz -DCMAKE_CXX_COMPILER=clang++-14 -DFUSEDATTN_BUILD_FUZZ=ON
// Run:   ./build/fuzz/tests/fuzz/fuzz_attend -max_total_time=60 build/fuzz/corpus tests/fuzz/corpus
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <fusedattn/dispatch/serving.hpp>

#include "support/oracle.hpp"
#include "test_reliability_support.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;

namespace {

/// Reads the fuzzer's bytes front to back; past the end every read is 0.
class byte_reader {
 public:
  byte_reader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  unsigned u8() { return pos_ < size_ ? data_[pos_++] : 0u; }
  /// A value in [0, n).
  index_t below(index_t n) { return static_cast<index_t>(u8()) % n; }
  std::uint64_t u64() {
    std::uint64_t x = 0;
    for (int i = 0; i < 8; ++i) x = (x << 8) | u8();
    return x;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_attend: %s\n", what.c_str());
  std::abort();
}

/// One operand: its own heap buffer sized to the view's span (so ASan sees any access outside it), a view with
/// the head dimension contiguous and the three outer axes nested in a byte-chosen order with byte-chosen
/// padding; inputs may also broadcast one axis (stride 0).
template <class T>
struct fuzz_operand {
  std::vector<T> buf;
  tensor_ref<T> view;

  fuzz_operand(dims4 d, byte_reader& r, bool may_broadcast) {
    static constexpr int orders[6][3] = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
    const int* order = orders[r.below(6)];  // outermost to innermost among b (0), h (1), s (2)
    const index_t ext[3] = {d.b, d.h, d.s};
    index_t st[3] = {0, 0, 0};
    index_t inner = d.d;  // elements one step of the next axis must clear
    for (int k = 2; k >= 0; --k) {
      const int axis = order[k];
      st[axis] = inner + r.below(4);  // padding of 0..3 elements
      inner = st[axis] * ext[axis];
    }
    if (may_broadcast && r.below(4) == 0) st[r.below(3)] = 0;
    view = {nullptr, d, {st[0], st[1], st[2], 1}};
    buf.resize(static_cast<std::size_t>(span_elements(view)));
    view.data = buf.data();
  }
};

/// Fills the elements a view covers (broadcast elements repeatedly) with uniform values in [−amp, amp].
template <class T>
void fill(const tensor_ref<T>& t, std::mt19937_64& rng, double amp) {
  std::uniform_real_distribution<double> u(-amp, amp);
  for (index_t b = 0; b < t.dims.b; ++b)
    for (index_t h = 0; h < t.dims.h; ++h)
      for (index_t i = 0; i < t.dims.s; ++i)
        for (index_t c = 0; c < t.dims.d; ++c) t.row(b, h, i)[c] = static_cast<T>(u(rng));
}

/// A quiet NaN of T (through float, which every T converts from).
template <class T>
T nan_of() {
  return static_cast<T>(std::numeric_limits<float>::quiet_NaN());
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

/// The hostile mutations; `none` leaves the call valid.
enum class mutation {
  none,
  null_q,
  null_o,
  shape_mismatch,
  non_unit_d_stride,
  negative_stride,
  o_aliases_input,
  lse_aliases,
  o_rows_overlap,
  bad_threads,
  bad_scale,
  bad_window,
  head_dim_too_large,
  heads_not_multiple,
  offset_overflow,
  bad_alignment,
  layout_mismatch,
  count
};

template <class T, class Policy>
void run_policy(const Policy& pol, const problem& p, const tensor_ref<const T>& q, const tensor_ref<const T>& k,
                const tensor_ref<const T>& v, const tensor_ref<T>& o, const any_mask& mask, float* lse, bool valid,
                std::vector<std::vector<T>*> watched, std::vector<float>* lse_buf, fuzz_operand<T>& o_op) {
  std::vector<std::vector<T>> before;
  for (auto* w : watched) before.push_back(*w);
  const std::vector<float> lse_before = lse_buf ? *lse_buf : std::vector<float>();
  const std::vector<T> o_before = o_op.buf;
  const status st = attend(pol, p, q, k, v, o, mask, lse);
  const std::string who = policy_name<Policy>() + " " + scalar_name<T>() + ": " + st.what();
  if (!valid) {
    if (st.code() != errc::invalid_argument) fail(who + " (an invalid call was not rejected)");
    for (std::size_t i = 0; i < watched.size(); ++i)
      if (!same_bits(*watched[i], before[i])) fail(who + " (a rejected call wrote memory)");
    if (!same_bits(o_op.buf, o_before)) fail(who + " (a rejected call wrote O)");
    if (lse_buf && !same_bits(*lse_buf, lse_before)) fail(who + " (a rejected call wrote lse)");
    return;
  }
  if (!st.ok()) fail(who + " (a valid call failed)");
  for (std::size_t i = 0; i < watched.size(); ++i)
    if (!same_bits(*watched[i], before[i])) fail(who + " (an input was written)");

  // Gaps of O (elements outside the view) keep their old bits.
  std::vector<char> in_view(o_op.buf.size(), 0);
  for (index_t b = 0; b < p.batch; ++b)
    for (index_t h = 0; h < p.heads; ++h)
      for (index_t i = 0; i < p.seq_q; ++i)
        for (index_t c = 0; c < p.head_dim; ++c)
          in_view[static_cast<std::size_t>(o.offset(b, h, i) + c)] = 1;
  for (std::size_t i = 0; i < in_view.size(); ++i)
    if (!in_view[i] && std::memcmp(&o_op.buf[i], &o_before[i], sizeof(T)) != 0) fail(who + " (a gap of O was written)");

  // Against the float64 oracle; the plain same-precision loop sets the tolerance as in check.hpp.
  std::visit(
      [&](const auto& m) {
        const auto bound = bind(m, p);
        // The outputs a non-finite input reaches (docs/design.md, Numerics), from the values the views hold.
        auto is_nan = [](T x) { return std::isnan(static_cast<double>(x)); };
        auto row_nan = [&](const T* r) { return std::any_of(r, r + p.head_dim, is_nan); };
        const std::size_t rows = static_cast<std::size_t>(p.batch * p.heads * p.seq_q);
        std::vector<char> nan_row(rows, 0);
        std::vector<char> bad_elem(rows * static_cast<std::size_t>(p.head_dim), 0);
        for (index_t b = 0; b < p.batch; ++b)
          for (index_t h = 0; h < p.heads; ++h) {
            const auto head_mask = for_head(bound, b, h);
            const index_t g = p.kv_head(h);
            for (index_t i = 0; i < p.seq_q; ++i) {
              const std::size_t row = static_cast<std::size_t>((b * p.heads + h) * p.seq_q + i);
              bool any_key = false, nan = false;
              for (index_t j = 0; j < p.seq_kv; ++j) {
                if (!head_mask.allowed(i, j)) continue;
                any_key = true;
                nan |= row_nan(k.row(b, g, j));
                const T* vr = v.row(b, g, j);
                for (index_t c = 0; c < p.head_dim; ++c)
                  if (!std::isfinite(static_cast<double>(vr[c]))) bad_elem[row * static_cast<std::size_t>(p.head_dim) + c] = 1;
              }
              nan |= any_key && row_nan(q.row(b, h, i));  // a row that sees no key is 0 / −inf whatever q holds
              nan_row[row] = nan;
            }
          }
        const reference ref = reference_attention<double>(p, q, k, v, bound);
        const reference plain = reference_attention<accum_t<T>>(p, q, k, v, bound);
        double plain_err = 0, plain_lse_err = 0, err = 0, lse_err = 0;
        for (std::size_t i = 0; i < ref.o.size(); ++i)
          if (!nan_row[i / static_cast<std::size_t>(p.head_dim)] && !bad_elem[i])
            plain_err = std::max(plain_err, std::abs(static_cast<double>(static_cast<T>(plain.o[i])) - ref.o[i]));
        for (std::size_t i = 0; i < ref.lse.size(); ++i)
          if (std::isfinite(ref.lse[i]) && !nan_row[i])
            plain_lse_err = std::max(plain_lse_err, std::abs(static_cast<double>(static_cast<float>(plain.lse[i])) - ref.lse[i]));
        const rounding_bounds rb = measure_rounding_bounds(p, q, k, v, bound);
        const double eps_t = static_cast<double>(Eigen::NumTraits<T>::epsilon());
        const double eps_f = static_cast<double>(Eigen::NumTraits<float>::epsilon());
        const auto [o_tol, lse_tol] = widen_tolerances<accum_t<T>>(
            2 * plain_err + 8 * eps_t * std::max(1.0, rb.value), 2 * plain_lse_err + 64 * eps_f * std::max(1.0, rb.logit),
            rb, logit_rounding::general, p.head_dim);
        for (index_t b = 0; b < p.batch; ++b)
          for (index_t h = 0; h < p.heads; ++h)
            for (index_t i = 0; i < p.seq_q; ++i) {
              const std::size_t row = static_cast<std::size_t>((b * p.heads + h) * p.seq_q + i);
              for (index_t c = 0; c < p.head_dim; ++c) {
                const double x = static_cast<double>(o.row(b, h, i)[c]);
                const std::size_t at = row * static_cast<std::size_t>(p.head_dim) + c;
                if (nan_row[row]) {
                  if (!std::isnan(x)) fail(who + " O element not NaN although a NaN input reaches its row");
                  continue;
                }
                if (bad_elem[at]) {
                  if (std::isfinite(x)) fail(who + " O element finite although a non-finite V value reaches it");
                  continue;
                }
                const double e = std::isfinite(x) ? std::abs(x - ref.o[at]) : std::numeric_limits<double>::infinity();
                err = std::max(err, e);
              }
              if (lse && nan_row[row]) {
                if (!std::isnan(lse[row])) fail(who + " lse not NaN although a NaN input reaches its row");
              } else if (lse) {
                const double x = lse[row], y = ref.lse[row];
                if (std::isinf(y)) {
                  if (x != y) lse_err = std::numeric_limits<double>::infinity();
                } else {
                  lse_err = std::max(lse_err, std::isfinite(x) ? std::abs(x - y) : std::numeric_limits<double>::infinity());
                }
              }
            }
        if (!(err <= o_tol))
          fail(who + " O error " + std::to_string(err) + " > tolerance " + std::to_string(o_tol));
        if (!(lse_err <= lse_tol))
          fail(who + " lse error " + std::to_string(lse_err) + " > tolerance " + std::to_string(lse_tol));
      },
      mask);
}

template <class T>
void fuzz_huge(byte_reader& r);
template <class T>
void fuzz_serving(byte_reader& r);

template <class T>
void fuzz_one(byte_reader& r) {
  const index_t route = r.below(16);
  if (route == 15) return fuzz_huge<T>(r);
  if (route == 14) return fuzz_serving<T>(r);
  // Problem: small enough that the oracle and every kernel take microseconds. Now and then an extent is 0 (valid:
  // nothing to write, or rows that see no key).
  problem p;
  const bool zeros = r.below(8) == 7;
  p.batch = zeros && r.below(4) == 0 ? 0 : 1 + r.below(2);
  p.heads_kv = 1 + r.below(3);
  p.heads = zeros && r.below(4) == 0 ? 0 : p.heads_kv * (1 + r.below(3));
  p.seq_q = zeros && r.below(3) == 0 ? 0 : 1 + r.below(12);
  p.seq_kv = zeros && r.below(2) == 0 ? 0 : 1 + r.below(12);
  p.head_dim = 1 + r.below(20);
  const bool empty = p.batch == 0 || p.heads == 0 || p.seq_q == 0 || p.seq_kv == 0;
  static constexpr double scales[] = {0.01, 0.5, 1.0, 3.0, 1e3};
  if (r.below(3) == 0) p.scale = scales[r.below(5)];
  const int threads = 1 + static_cast<int>(r.below(4));
  // Flash tile sizes: 0 lets the heuristic choose; small ones put every tail inside these tiny problems.
  const tile_sizes tiles{r.below(3) ? 0 : 1 + r.below(17), r.below(3) ? 0 : 1 + r.below(33), r.below(4)};
  const bool want_lse = r.below(2) == 0;

  any_mask mask = dense{};
  const align al = r.below(2) ? align::bottom_right : align::top_left;
  // A block-sparse layout: blocks of 1..5 rows/keys, one pattern per head and batch entry or shared, random
  // active blocks, and a band rule inside the blocks. It must outlive the call (block_sparse views it).
  // Block sizes are now and then near INT64_MAX (one block per row / column: no count may overflow).
  const auto block_size = [&] { return r.below(8) == 0 ? INT64_MAX - r.below(4) : 1 + r.below(5); };
  const index_t block_q = block_size(), block_kv = block_size();
  block_geometry geometry{p.seq_q, p.seq_kv, block_q, block_kv, r.below(2) && p.batch > 0 ? p.batch : 1,
                          r.below(2) && p.heads > 0 ? p.heads : 1};
  const double sparsity = static_cast<double>(r.below(5)) / 4;
  const std::uint64_t layout_seed = r.u8();
  block_sparse::element_rule within = dense{};
  switch (r.below(4)) {
    case 0: mask = dense{}; break;
    case 1: mask = causal{al}; break;
    case 2: mask = window{r.below(9), r.below(9), al}; break;
    default: within = r.below(2) ? block_sparse::element_rule(causal{al}) : window{r.below(9), r.below(9), al}; break;
  }
  const bool sparse = std::holds_alternative<dense>(mask) && within.index() != 0;

  fuzz_operand<T> q(p.q_dims(), r, true), k(p.kv_dims(), r, true), v(p.kv_dims(), r, true), o(p.o_dims(), r, false);
  static constexpr double amps[] = {1.0, 1.0, 4.0, 30.0};
  std::mt19937_64 rng(r.u64());
  const double amp = amps[r.below(4)];
  fill(q.view, rng, amp);
  fill(k.view, rng, amp);
  fill(v.view, rng, 1.0);
  // At most one non-finite input element (as `none` most of the time): NaN in Q, K or V, or ±inf in V.
  switch (empty ? 11 : r.below(12)) {
    case 0: q.view.row(r.below(p.batch), r.below(p.heads), r.below(p.seq_q))[r.below(p.head_dim)] = nan_of<T>(); break;
    case 1: k.view.row(r.below(p.batch), r.below(p.heads_kv), r.below(p.seq_kv))[r.below(p.head_dim)] = nan_of<T>(); break;
    case 2: v.view.row(r.below(p.batch), r.below(p.heads_kv), r.below(p.seq_kv))[r.below(p.head_dim)] = nan_of<T>(); break;
    case 3: {
      const double inf = r.below(2) ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
      v.view.row(r.below(p.batch), r.below(p.heads_kv), r.below(p.seq_kv))[r.below(p.head_dim)] = static_cast<T>(inf);
      break;
    }
    default: break;
  }
  std::uniform_real_distribution<double> junk(50, 60);
  for (T& x : o.buf) x = static_cast<T>(junk(rng));
  std::vector<float> lse_buf(static_cast<std::size_t>(p.lse_size()), 77.0f);

  tensor_ref<const T> qv = q.view, kv = k.view, vv = v.view;
  tensor_ref<T> ov = o.view;
  float* lse = want_lse ? lse_buf.data() : nullptr;
  problem pc = p;
  int threads_c = threads;

  // At most one hostile mutation; each one below makes the call invalid (checked against the docs' rules).
  // (None with a zero extent: a null or aliasing view of no element is valid.)
  const auto mut = empty ? mutation::none : static_cast<mutation>(r.below(2 * static_cast<index_t>(mutation::count)));
  bool valid = true;
  switch (mut) {
    case mutation::null_q: qv.data = nullptr; valid = false; break;
    case mutation::null_o: ov.data = nullptr; valid = false; break;
    case mutation::shape_mismatch: {
      tensor_ref<const T>* ins[3] = {&qv, &kv, &vv};
      tensor_ref<const T>* t = ins[r.below(3)];
      index_t* dims[4] = {&t->dims.b, &t->dims.h, &t->dims.s, &t->dims.d};
      *dims[r.below(4)] += 1 + r.below(3);  // larger than the buffer: must be rejected before any read
      valid = false;
      break;
    }
    case mutation::non_unit_d_stride: ov.stride.d = 2 + r.below(3); valid = false; break;
    case mutation::negative_stride: kv.stride.s = -1 - r.below(100); valid = false; break;
    case mutation::o_aliases_input: {
      const std::vector<T>* bufs[3] = {&q.buf, &k.buf, &v.buf};
      const std::vector<T>& in = *bufs[r.below(3)];
      ov.data = const_cast<T*>(in.data()) + r.below(static_cast<index_t>(in.size()));
      valid = false;
      break;
    }
    case mutation::lse_aliases:
      if (r.below(2)) lse = reinterpret_cast<float*>(o.buf.data());
      else lse = reinterpret_cast<float*>(const_cast<T*>(v.buf.data()));
      valid = false;
      break;
    case mutation::o_rows_overlap: {
      index_t* st[3] = {&ov.stride.b, &ov.stride.h, &ov.stride.s};
      const index_t ext[3] = {p.batch, p.heads, p.seq_q};
      const int axis = static_cast<int>(r.below(3));
      for (int a = 0; a < 3; ++a) {
        const int ax = (axis + a) % 3;
        if (ext[ax] > 1) {
          *st[ax] = 0;  // two indices of this axis share a row
          valid = false;
          break;
        }
      }
      break;
    }
    case mutation::bad_threads: threads_c = -static_cast<int>(r.below(3)); valid = false; break;
    case mutation::bad_scale: {
      // 1e300 is a valid scale for double accumulation (not fuzzed: its logits overflow), invalid for float.
      static constexpr double bad[] = {0.0, -1.0, std::numeric_limits<double>::quiet_NaN(),
                                       std::numeric_limits<double>::infinity(), 1e300};
      const double s = bad[r.below(5)];
      if (!(s == 1e300 && std::is_same_v<accum_t<T>, double>)) {
        pc.scale = s;
        valid = false;
      }
      break;
    }
    case mutation::bad_window: mask = window{-1 - r.below(5), r.below(5), al}; valid = false; break;
    case mutation::head_dim_too_large: pc.head_dim = max_head_dim + 1 + r.below(100); valid = false; break;
    case mutation::heads_not_multiple:  // if heads_kv + 1 still divides heads, K's extents mismatch instead
      pc.heads_kv = p.heads_kv + 1;
      valid = false;
      break;
    case mutation::offset_overflow: {
      tensor_ref<const T>* ins[3] = {&qv, &kv, &vv};
      auto* t = ins[r.below(3)];
      const index_t ext[3] = {t->dims.b, t->dims.h, t->dims.s};
      index_t* st[3] = {&t->stride.b, &t->stride.h, &t->stride.s};
      for (int a = 0; a < 3; ++a)
        if (ext[a] > 1) {
          // The last row's element offset, or its byte offset, no longer fits in 64 bits.
          const index_t limit = r.below(2) ? std::numeric_limits<index_t>::max()
                                           : std::numeric_limits<index_t>::max() / static_cast<index_t>(sizeof(T));
          const index_t per = limit / (ext[a] - 1);
          *st[a] = per == std::numeric_limits<index_t>::max() ? per : per + 1;
          valid = false;
          break;
        }
      break;
    }
    case mutation::bad_alignment: mask = causal{static_cast<align>(2 + r.below(3))}; valid = false; break;
    default: break;
  }

  if (mut == mutation::layout_mismatch) {
    // A layout built for another problem: a longer sequence, or more heads / batch entries than the problem has.
    switch (r.below(3)) {
      case 0: geometry.seq_q += 1 + r.below(3); break;
      case 1: geometry.seq_kv += 1 + r.below(3); break;
      default: geometry.heads = p.heads + 1; break;
    }
    valid = false;
  }
  const block_layout layout = random_layout(geometry, sparsity, layout_seed);
  if ((sparse && std::holds_alternative<dense>(mask)) || mut == mutation::layout_mismatch)
    mask = block_sparse(layout, within);

  std::vector<std::vector<T>*> watched = {&q.buf, &k.buf, &v.buf};
  for_each_cpu_policy([&](auto pol) {
    pol.threads = threads_c;
    set_tiles(pol, tiles);
    run_policy<T>(pol, pc, qv, kv, vv, ov, mask, lse, valid, watched, want_lse ? &lse_buf : nullptr, o);
  });
}

/// Serving calls: a small paged cache (attend_paged, both page layouts) and a ragged batch (attend_ragged), both
/// from the bytes, with at most one bad index (a page id out of range, a length beyond its pages, a block table too
/// short, offsets decreasing or not ending at the total). A bad call must return invalid_argument and write
/// nothing; a valid one must agree, sequence by sequence, with the float64 oracle on the keys gathered contiguously.
template <class T>
void fuzz_serving(byte_reader& r) {
  const index_t sequences = 1 + r.below(3), heads_kv = 1 + r.below(2), heads = heads_kv * (1 + r.below(4));
  const index_t d = 1 + r.below(20), seq_q = 1 + r.below(5), page_size = 8 * (1 + r.below(3));
  std::vector<std::int32_t> lens(static_cast<std::size_t>(sequences));
  for (auto& x : lens) x = static_cast<std::int32_t>(r.below(40));
  const index_t longest = std::max<index_t>(1, *std::max_element(lens.begin(), lens.end()));
  const index_t blocks = (longest + page_size - 1) / page_size, pages = sequences * blocks + r.below(3);
  const page_layout pl = r.below(2) ? page_layout::hnd : page_layout::nhd;
  const page_strides ps = page_strides_of(pl, page_size, heads_kv, d);
  std::vector<std::int32_t> table(static_cast<std::size_t>(sequences * blocks));
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = static_cast<std::int32_t>(i);
  std::mt19937_64 rng(r.u64());
  std::shuffle(table.begin(), table.end(), rng);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> kp(static_cast<std::size_t>(pages * ps.page)), vp(kp.size());
  for (auto& x : kp) x = static_cast<T>(u(rng));
  for (auto& x : vp) x = static_cast<T>(u(rng));
  problem p{sequences, heads, heads_kv, seq_q, longest, d};
  std::vector<T> q(static_cast<std::size_t>(sequences * heads * seq_q * d)), o(q.size(), T(50.0f));
  for (auto& x : q) x = static_cast<T>(u(rng));
  std::vector<float> lse(static_cast<std::size_t>(p.lse_size()), 77.0f);
  const align al = r.below(2) ? align::bottom_right : align::top_left;
  const any_mask mask = r.below(3) == 0 ? any_mask{dense{}} : r.below(2) ? any_mask{causal{al}}
                                                                         : any_mask{window{r.below(9), r.below(9), al}};
  // Keys of sequence b gathered into a contiguous (1, heads_kv, len, d) buffer.
  const auto gather = [&](const std::vector<T>& pool, index_t b) {
    const index_t len = lens[static_cast<std::size_t>(b)];
    std::vector<T> out(static_cast<std::size_t>(std::max<index_t>(1, heads_kv * len * d)));
    for (index_t h = 0; h < heads_kv; ++h)
      for (index_t j = 0; j < len; ++j)
        for (index_t c = 0; c < d; ++c)
          out[static_cast<std::size_t>((h * len + j) * d + c)] = pool[static_cast<std::size_t>(
              table[static_cast<std::size_t>(b * blocks + j / page_size)] * ps.page + h * ps.head +
              (j % page_size) * ps.token + c)];
    return out;
  };
  // O rows [q0, q0 + nq) of every head, viewed by `ov`, against the oracle on (q, k, v) of one sequence.
  const auto check = [&](const std::string& who, const problem& pb, const tensor_ref<const T>& qb,
                         const tensor_ref<const T>& kb, const tensor_ref<const T>& vb, const tensor_ref<T>& ob) {
    std::visit(
        [&](const auto& m) {
          const auto bound = bind(m, pb);
          const reference ref = reference_attention<double>(pb, qb, kb, vb, bound);
          const reference plain = reference_attention<accum_t<T>>(pb, qb, kb, vb, bound);
          double err = 0, plain_err = 0;
          for (index_t h = 0; h < pb.heads; ++h)
            for (index_t i = 0; i < pb.seq_q; ++i)
              for (index_t c = 0; c < pb.head_dim; ++c) {
                const std::size_t at = static_cast<std::size_t>((h * pb.seq_q + i) * pb.head_dim + c);
                const double x = static_cast<double>(ob.row(0, h, i)[c]);
                err = std::max(err, std::isfinite(x) ? std::abs(x - ref.o[at]) : std::numeric_limits<double>::infinity());
                plain_err = std::max(plain_err, std::abs(static_cast<double>(static_cast<T>(plain.o[at])) - ref.o[at]));
              }
          const double tol = 2 * plain_err + 8 * static_cast<double>(Eigen::NumTraits<T>::epsilon());
          if (!(err <= tol)) fail(who + " O error " + std::to_string(err) + " > tolerance " + std::to_string(tol));
        },
        mask);
  };

  // Paged, with at most one bad index.
  std::vector<std::int32_t> bad_table = table, bad_lens = lens;
  paged_kv<const T> kv = paged<const T>(kp.data(), vp.data(), pages, page_size, heads_kv, d, pl, bad_table.data(),
                                        blocks, bad_lens.data());
  bool valid = true;
  switch (r.below(8)) {
    case 0:
      if (lens[0] > 0) {
        bad_table[0] = r.below(2) ? static_cast<std::int32_t>(pages + r.below(3)) : -1 - static_cast<std::int32_t>(r.below(3));
        valid = false;
      }
      break;
    case 1: bad_lens[static_cast<std::size_t>(r.below(sequences))] = static_cast<std::int32_t>(blocks * page_size + 1 + r.below(9)); valid = false; break;
    case 2:
      if (longest > page_size) {
        kv.blocks_per_seq = blocks - 1;
        valid = false;
      }
      break;
    case 3: bad_lens[static_cast<std::size_t>(r.below(sequences))] = -1; valid = false; break;
    default: break;
  }
  const std::vector<T> o_before = o;
  const std::vector<float> lse_before = lse;
  for_each_cpu_policy([&](auto pol) {
    if constexpr (detail::is_cpu_flash<decltype(pol)>::value) {
      std::fill(o.begin(), o.end(), T(50.0f));
      const std::string who = policy_name<decltype(pol)>() + " " + scalar_name<T>() + " paged";
      const status st = std::visit(
          [&](const auto& m) {
            if constexpr (detail::is_band_mask_v<std::decay_t<decltype(m)>>)
              return attend_paged(pol, p, bhsd<const T>(q.data(), p.q_dims()), kv, bhsd(o.data(), p.o_dims()), m,
                                  lse.data());
            else
              return status::invalid("not a band mask");
          },
          mask);
      if (!valid) {
        if (st.code() != errc::invalid_argument) fail(who + ": a bad cache was not rejected");
        if (!same_bits(o, std::vector<T>(o.size(), T(50.0f))) || lse != lse_before) fail(who + ": a rejected call wrote");
        return;
      }
      if (!st.ok()) fail(who + ": a valid call failed: " + st.what());
      for (index_t b = 0; b < sequences; ++b) {
        const index_t len = lens[static_cast<std::size_t>(b)];
        const problem pb{1, heads, heads_kv, seq_q, std::max<index_t>(len, 1), d};
        const tensor_ref<T> ob = bhsd(o.data() + b * heads * seq_q * d, pb.o_dims());
        if (len == 0) {
          for (index_t x = 0; x < heads * seq_q * d; ++x)
            if (static_cast<double>(ob.data[x]) != 0.0) fail(who + ": a sequence without keys got O != 0");
          continue;
        }
        const std::vector<T> kb = gather(kp, b), vb = gather(vp, b);
        check(who, pb, bhsd<const T>(q.data() + b * heads * seq_q * d, pb.q_dims()),
              bhsd<const T>(kb.data(), pb.kv_dims()), bhsd<const T>(vb.data(), pb.kv_dims()), ob);
      }
    }
  });

  // Ragged: the same sequences packed end to end (query rows 0..4 each), with at most one bad offset.
  std::vector<std::int32_t> cu_q{0}, cu_kv{0};
  for (index_t b = 0; b < sequences; ++b) {
    cu_q.push_back(cu_q.back() + static_cast<std::int32_t>(r.below(5)));
    cu_kv.push_back(cu_kv.back() + lens[static_cast<std::size_t>(b)]);
  }
  const problem pr{1, heads, heads_kv, std::max<index_t>(1, cu_q.back()), std::max<index_t>(1, cu_kv.back()), d};
  if (pr.seq_q != cu_q.back() || pr.seq_kv != cu_kv.back()) return;  // totals of 0: no ragged call
  std::vector<T> qr(static_cast<std::size_t>(pr.seq_q * heads * d)), kr(static_cast<std::size_t>(pr.seq_kv * heads_kv * d)),
      vr(kr.size()), orr(qr.size(), T(50.0f));
  for (auto* buf : {&qr, &kr, &vr})
    for (auto& x : *buf) x = static_cast<T>(u(rng));
  std::vector<std::int32_t> bq = cu_q, bkv = cu_kv;
  bool valid_r = true;
  switch (r.below(6)) {
    case 0: bq.back() += 1; valid_r = false; break;  // not ending at the total
    case 1:
      if (sequences > 1) {
        bkv[1] = bkv[2] + 1;  // decreasing
        valid_r = false;
      }
      break;
    case 2: bq[0] = 1; valid_r = false; break;  // not starting at 0
    default: break;
  }
  const ragged_batch rb{sequences, bq.data(), bkv.data()};
  std::vector<float> lse_r(static_cast<std::size_t>(pr.lse_size()), 77.0f);
  for_each_cpu_policy([&](auto pol) {
    std::fill(orr.begin(), orr.end(), T(50.0f));
    const std::string who = policy_name<decltype(pol)>() + " " + scalar_name<T>() + " ragged";
    const status st = std::visit(
        [&](const auto& m) {
          if constexpr (detail::is_band_mask_v<std::decay_t<decltype(m)>>)
            return attend_ragged(pol, pr, rb, bshd<const T>(qr.data(), pr.q_dims()),
                                 bshd<const T>(kr.data(), pr.kv_dims()), bshd<const T>(vr.data(), pr.kv_dims()),
                                 bshd(orr.data(), pr.o_dims()), m, lse_r.data());
          else
            return status::invalid("not a band mask");
        },
        mask);
    if (!valid_r) {
      if (st.code() != errc::invalid_argument) fail(who + ": bad offsets were not rejected");
      if (!same_bits(orr, std::vector<T>(orr.size(), T(50.0f)))) fail(who + ": a rejected call wrote");
      return;
    }
    if (st.code() == errc::unsupported) return;
    if (!st.ok()) fail(who + ": a valid call failed: " + st.what());
    for (index_t b = 0; b < sequences; ++b) {
      const index_t q0 = cu_q[static_cast<std::size_t>(b)], nq = cu_q[static_cast<std::size_t>(b) + 1] - q0;
      const index_t k0 = cu_kv[static_cast<std::size_t>(b)], nk = cu_kv[static_cast<std::size_t>(b) + 1] - k0;
      if (nq == 0 || nk == 0) continue;
      const problem pb{1, heads, heads_kv, nq, nk, d};
      check(who, pb, bshd<const T>(qr.data() + q0 * heads * d, pb.q_dims()),
            bshd<const T>(kr.data() + k0 * heads_kv * d, pb.kv_dims()),
            bshd<const T>(vr.data() + k0 * heads_kv * d, pb.kv_dims()), bshd(orr.data() + q0 * heads * d, pb.o_dims()));
    }
  });
}

/// A size drawn up to INT64_MAX: 0..3, small, near INT64_MAX, any 63-bit value, a power of two, or next to 2^48.
index_t any_size(byte_reader& r) {
  switch (r.below(6)) {
    case 0: return r.below(4);
    case 1: return 1 + r.below(64);
    case 2: return INT64_MAX - r.below(4);
    case 3: return static_cast<index_t>(r.u64() >> 1);
    case 4: return index_t(1) << r.below(63);
    default: return (index_t(1) << 48) - 1 + r.below(3);
  }
}

/// Absurd sizes: every extent, stride, block size and tile size up to INT64_MAX, views that broadcast one element
/// (stride 0) or carry any stride. fa::plan must answer without overflow (UBSan), out-of-bounds access (ASan) or an
/// allocation of the absurd size; wherever it refuses the call, attend must refuse it with the same status and
/// write nothing. A call plan accepts may be far too large to run, so attend runs only where plan refuses.
/// (seq_q stays below 2^20 or beyond 2^48: the flash plan lists its q-tiles, O(seq_q) work, legitimately.)
template <class T>
void fuzz_huge(byte_reader& r) {
  problem p;
  p.batch = any_size(r);
  p.heads_kv = any_size(r);
  p.heads = r.below(2) ? detail::mul_sat(p.heads_kv, 1 + r.below(3)) : any_size(r);
  switch (r.below(3)) {
    case 0: p.seq_q = static_cast<index_t>(r.u64() % (index_t(1) << 20)); break;
    case 1: p.seq_q = (index_t(1) << 48) + 1 + r.below(8); break;
    default: p.seq_q = INT64_MAX - r.below(4); break;
  }
  p.seq_kv = any_size(r);
  p.head_dim = r.below(2) ? 1 + r.below(max_head_dim) : any_size(r);
  if (r.below(4) == 0) p.scale = r.below(2) ? 1e-300 : -1e-300;
  std::vector<T> arena(64, T(0.25f));
  const std::vector<T> before = arena;
  std::vector<float> lse_arena(8, 5.0f);
  const auto view = [&](dims4 d, T* data) {
    switch (r.below(4)) {
      case 0: return bhsd(data, d);
      case 1: return bshd(data, d);
      case 2: return strided(data, d, {0, 0, 0, 1});
      default: return strided(data, d, {any_size(r), any_size(r), any_size(r), 1});
    }
  };
  const tensor_ref<const T> q = view(p.q_dims(), arena.data()), k = view(p.kv_dims(), arena.data()),
                            v = view(p.kv_dims(), arena.data());
  const tensor_ref<T> o = view(p.o_dims(), arena.data() + 8);
  float* lse = r.below(2) ? lse_arena.data() : nullptr;
  const tile_sizes tiles{r.below(2) ? 0 : any_size(r), r.below(2) ? 0 : any_size(r), r.below(2) ? 0 : any_size(r)};
  const int threads = r.below(2) ? 1 + static_cast<int>(r.below(8)) : static_cast<int>(r.u64() & 0x7fffffff);
  // Masks: a band with any bounds, or a layout with blocks up to INT64_MAX (built only when it has few blocks;
  // otherwise a view of the geometry alone, which validation refuses).
  const block_geometry g{p.seq_q, p.seq_kv, any_size(r), any_size(r), r.below(2) ? 1 : p.batch, r.below(2) ? 1 : p.heads};
  const bool small_layout = g.usable() && g.patterns() <= 4096 && g.rows() <= 4096 && g.n_kv_blocks() <= 4096 &&
                            g.rows() * g.n_kv_blocks() <= (index_t(1) << 16);
  const block_layout layout = small_layout ? dense_layout(g) : block_layout();
  block_layout_view geometry_only;
  geometry_only.geometry = g;
  any_mask mask = dense{};
  switch (r.below(4)) {
    case 0: mask = causal{r.below(2) ? align::top_left : align::bottom_right}; break;
    case 1: mask = window{any_size(r), any_size(r), r.below(2) ? align::top_left : align::bottom_right}; break;
    case 2: mask = small_layout ? block_sparse(layout) : block_sparse(geometry_only); break;
    default: break;
  }
  for_each_cpu_policy([&](auto pol) {
    pol.threads = threads;
    set_tiles(pol, tiles);
    const kernel_plan pl = plan(pol, p, q, k, v, o, mask, lse);
    const std::string who = policy_name<decltype(pol)>() + " " + scalar_name<T>() + " (absurd sizes): ";
    if (pl.st.ok()) {
      if (pl.kernel.empty()) fail(who + "plan accepted the call but names no kernel");
      return;
    }
    if (!pl.kernel.empty() || pl.scratch_bytes != 0) fail(who + "a refused plan carries a kernel");
    if (pl.st.message().empty()) fail(who + "a refused plan gives no reason");
    const status st = attend(pol, p, q, k, v, o, mask, lse);
    if (st.code() != pl.st.code() || st.message() != pl.st.message())
      fail(who + "plan said \"" + pl.st.message() + "\" but attend said \"" + st.message() + "\"");
    if (!same_bits(arena, before)) fail(who + "a refused call wrote memory");
    if (lse_arena != std::vector<float>(8, 5.0f)) fail(who + "a refused call wrote lse");
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  byte_reader r(data, size);
  switch (r.below(4)) {
    case 0: fuzz_one<float>(r); break;
    case 1: fuzz_one<double>(r); break;
    case 2: fuzz_one<Eigen::half>(r); break;
    default: fuzz_one<Eigen::bfloat16>(r); break;
  }
  return 0;
}
