/// @file status.hpp
/// The result of every public entry point: ok, or an error code with a sentence that names the offending
/// field and value. fusedattn throws no exceptions of its own and never aborts on bad input.
#pragma once

#include <string>
#include <utility>

namespace fusedattn {

/// What kind of failure a status reports.
enum class errc {
  ok = 0,
  invalid_argument,  ///< a size, stride, pointer, mask or option is wrong; nothing was written
  unsupported,       ///< valid input that this backend or build cannot run (e.g. built without CUDA)
  out_of_memory,     ///< scratch memory could not be allocated; nothing was written
  backend_error,     ///< a CUDA / cuBLAS / Ascend call failed; the message carries the driver's text
};

/// Name of an error code ("invalid_argument", ...).
inline const char* to_string(errc c) {
  switch (c) {
    case errc::ok: return "ok";
    case errc::invalid_argument: return "invalid_argument";
    case errc::unsupported: return "unsupported";
    case errc::out_of_memory: return "out_of_memory";
    case errc::backend_error: return "backend_error";
  }
  return "unknown";
}

/// Outcome of a call. Converts to `true` on success; `what()` tells why not.
/// @code
///   auto st = fusedattn::attend(...);
///   if (!st) std::fprintf(stderr, "fusedattn: %s\n", st.what());
/// @endcode
class [[nodiscard]] status {
 public:
  /// A successful status.
  status() = default;
  /// A failed status with a code and a reason.
  status(errc code, std::string message) : code_(code), message_(std::move(message)) {}

  /// Success.
  static status success() { return {}; }
  /// An invalid-argument failure (the most common kind).
  static status invalid(std::string message) { return {errc::invalid_argument, std::move(message)}; }

  explicit operator bool() const noexcept { return code_ == errc::ok; }
  bool ok() const noexcept { return code_ == errc::ok; }
  errc code() const noexcept { return code_; }
  /// The reason, or "ok".
  const char* what() const noexcept { return ok() ? "ok" : message_.c_str(); }
  const std::string& message() const noexcept { return message_; }

 private:
  errc code_ = errc::ok;
  std::string message_;
};

}  // namespace fusedattn
