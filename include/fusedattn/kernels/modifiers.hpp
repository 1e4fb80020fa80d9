/// @file modifiers.hpp
/// Score modifiers as users spell them: `fa::softcap{cap}`, `fa::alibi{slopes}`, `fa::sinks{logits}`, combined
/// with any mask by `|` into a `fa::modified<Mask>`, which attend / plan / backward / serving take as their mask.
/// Their arithmetic is core/score_mod.hpp; here are the spelling, the checks and the binding.
#pragma once

#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <variant>

#include "../core/problem.hpp"
#include "../core/score_mod.hpp"
#include "../core/status.hpp"
#include "block_sparse.hpp"
#include "mask.hpp"

namespace fusedattn {

/// Soft-capping of the scaled score: s → cap · tanh(s / cap) (Gemma 2, Grok). cap: finite, > 0.
struct softcap {
  float cap = 0.f;
};

/// ALiBi: adds −slopes[h] · |j − pos(i)| to head h's scaled score, pos(i) = i (top_left) or i + seq_kv − seq_q
/// (bottom_right); under a causal mask of the same alignment that is the linear bias slope · (j − pos(i)) of
/// Press et al. `slopes`: one float per query head, in the memory of the policy that runs the call (host for CPU,
/// device for CUDA), finite; it must outlive the call.
struct alibi {
  const float* slopes = nullptr;
  align alignment = align::top_left;
};

/// Attention sinks: one logit per query head that joins every row's softmax denominator and has no value row
/// (gpt-oss, StreamingLLM). In the scaled-score domain; one float per query head, in the policy's memory.
/// `grad`, when not null, receives dL/d logits from attend_backward (heads floats, overwritten); attend ignores it.
struct sinks {
  const float* logits = nullptr;
  float* grad = nullptr;
};

/// The modifiers of one call, unbound (what `|` collects).
struct score_mods {
  bool has_softcap = false;
  float softcap = 0.f;
  bool has_alibi = false;
  const float* alibi_slopes = nullptr;
  align alibi_alignment = align::top_left;
  bool has_sinks = false;
  const float* sink_logits = nullptr;
  float* sink_grad = nullptr;
};

/// A mask with score modifiers: what `mask | fa::softcap{30}` makes. Masking is decided by `mask` first; the
/// modifiers change the scores of the allowed keys (core/score_mod.hpp states the arithmetic).
template <class Mask>
struct modified {
  Mask mask{};
  score_mods mods{};
};

/// A mask chosen at run time.
using any_mask = std::variant<dense, causal, window, block_sparse>;

namespace detail {
template <class M>
struct is_modified : std::false_type {};
template <class M>
struct is_modified<modified<M>> : std::true_type {};
template <class M>
inline constexpr bool is_modified_v = is_modified<M>::value;
/// A mask the entry points resolve with std::visit first: any_mask, or an any_mask with modifiers.
template <class M>
struct is_runtime_mask : std::is_same<M, any_mask> {};
template <>
struct is_runtime_mask<modified<any_mask>> : std::true_type {};
template <class M>
inline constexpr bool is_runtime_mask_v = is_runtime_mask<M>::value;
/// Calls f with the concrete mask behind an any_mask (or modified<any_mask>, keeping the modifiers).
template <class F>
decltype(auto) visit_mask(const any_mask& m, F&& f) {
  return std::visit(f, m);
}
template <class F>
decltype(auto) visit_mask(const modified<any_mask>& m, F&& f) {
  return std::visit([&](const auto& inner) { return f(modified<std::decay_t<decltype(inner)>>{inner, m.mods}); },
                    m.mask);
}

template <class Mask>
modified<Mask> as_modified(const Mask& m) {
  return modified<Mask>{m, {}};
}
template <class Mask>
modified<Mask> as_modified(const modified<Mask>& m) {
  return m;
}
}  // namespace detail

/// mask | softcap{c}, mask | alibi{s}, mask | sinks{l}: any mask (dense, causal, window, block_sparse, any_mask or
/// an already modified one) with one more modifier. Naming the same modifier twice keeps the last.
template <class Mask>
auto operator|(const Mask& m, softcap c) -> decltype(detail::as_modified(m)) {
  auto r = detail::as_modified(m);
  r.mods.has_softcap = true;
  r.mods.softcap = c.cap;
  return r;
}
template <class Mask>
auto operator|(const Mask& m, alibi a) -> decltype(detail::as_modified(m)) {
  auto r = detail::as_modified(m);
  r.mods.has_alibi = true;
  r.mods.alibi_slopes = a.slopes;
  r.mods.alibi_alignment = a.alignment;
  return r;
}
template <class Mask>
auto operator|(const Mask& m, sinks s) -> decltype(detail::as_modified(m)) {
  auto r = detail::as_modified(m);
  r.mods.has_sinks = true;
  r.mods.sink_logits = s.logits;
  r.mods.sink_grad = s.grad;
  return r;
}

/// Binds the modifiers to a problem.
inline bound_mods bind(const score_mods& m, const problem& p) {
  bound_mods r;
  r.softcap = m.softcap;
  r.alibi_slopes = m.alibi_slopes;
  r.alibi_offset = m.alibi_alignment == align::bottom_right ? p.seq_kv - p.seq_q : 0;
  r.sink_logits = m.sink_logits;
  r.sink_grad = m.sink_grad;
  return r;
}
/// Where a bound mask keeps its modifiers (a backend's own bound mask adds an overload).
inline bound_mods& mods_ref(band_mask& m) { return m.mods; }
inline bound_mods& mods_ref(block_sparse_mask& m) { return m.band.mods; }

/// Binds a modified mask: the inner mask's bound form, carrying the bound modifiers.
template <class Mask>
auto bind(const modified<Mask>& m, const problem& p) {
  auto r = bind(m.mask, p);
  mods_ref(r) = bind(m.mods, p);
  return r;
}

template <class Mask>
const char* mask_name(const modified<Mask>& m) {
  return mask_name(m.mask);
}

namespace detail {
/// The refusal of a kernel that does not apply score modifiers (yet): errc::unsupported naming it, or ok when the
/// call has none.
inline status mods_unsupported(const bound_mods& m, const char* kernel) {
  if (!m.any()) return {};
  return {errc::unsupported, std::string(kernel) + " does not apply score modifiers (softcap, alibi, sinks)"};
}
}  // namespace detail

}  // namespace fusedattn
