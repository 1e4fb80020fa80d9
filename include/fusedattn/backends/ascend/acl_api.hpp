/// @file acl_api.hpp
/// The CANN side of the Ascend backend: the toolkit headers, owning handles for aclTensor / aclIntArray / aclScalar /
/// aclTensorList, the backend's device allocator (aclrtMalloc) and the conversion of CANN errors into statuses.
/// Included only when FUSEDATTN_WITH_ASCEND is 1.
#pragma once

#if defined(FUSEDATTN_ASCEND_USE_DECLARATIONS)
// CI without the toolkit: the transcribed prototypes (tests/ascend/include), never installed.
#include <fusedattn_cann_declarations.h>
#else
#include <acl/acl.h>
#include <aclnnop/aclnn_add.h>
#include <aclnnop/aclnn_fill_scalar.h>
#include <aclnnop/aclnn_flash_attention_score.h>
#include <aclnnop/aclnn_incre_flash_attention_v4.h>
#include <aclnnop/aclnn_log.h>
#include <aclnnop/aclnn_zero.h>
#endif

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "../../config.hpp"
#include "../../core/status.hpp"

namespace fusedattn {
namespace ascend_backend {

/// The text CANN keeps about its most recent error ("" when it has none).
inline std::string recent_error_text() {
  const char* msg = aclGetRecentErrMsg();
  return msg != nullptr ? std::string(msg) : std::string();
}

/// ok for ACL_SUCCESS, else errc::backend_error naming the call, its code and CANN's recent error text.
inline status from_acl(std::int64_t code, const char* call) {
  if (code == ACL_SUCCESS) return {};
  std::string text = recent_error_text();
  return {errc::backend_error, std::string(call) + " returned " + std::to_string(code) +
                                   (text.empty() ? std::string() : ": " + text)};
}

/// errc::backend_error for a CANN constructor that returned null.
inline status null_from(const char* call) {
  std::string text = recent_error_text();
  return {errc::backend_error, std::string(call) + " returned null" + (text.empty() ? std::string() : ": " + text)};
}

/// An owning CANN handle destroyed by `Destroy` (aclDestroyTensor, ...).
template <class Handle, aclnnStatus (*Destroy)(const Handle*)>
class owned {
 public:
  owned() = default;
  explicit owned(Handle* h) : h_(h) {}
  owned(const owned&) = delete;
  owned& operator=(const owned&) = delete;
  owned(owned&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  owned& operator=(owned&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  ~owned() { reset(); }

  Handle* get() const { return h_; }
  /// Gives up ownership (an aclTensorList takes its tensors).
  Handle* release() { return std::exchange(h_, nullptr); }
  void reset() {
    if (h_ != nullptr) (void)Destroy(h_);
    h_ = nullptr;
  }

 private:
  Handle* h_ = nullptr;
};

using acl_tensor = owned<aclTensor, aclDestroyTensor>;
using acl_int_array = owned<aclIntArray, aclDestroyIntArray>;
using acl_scalar = owned<aclScalar, aclDestroyScalar>;
using acl_tensor_list = owned<aclTensorList, aclDestroyTensorList>;

/// Device memory from aclrtMalloc, freed with aclrtFree: the backend's allocator for operator workspaces, the softmax
/// statistics and masks. Zero bytes holds no memory.
class device_buffer {
 public:
  device_buffer() = default;
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  device_buffer(device_buffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(o.bytes_) {}
  ~device_buffer() {
    if (ptr_ != nullptr) (void)aclrtFree(ptr_);
  }

  /// Allocates `bytes`; errc::out_of_memory naming `what` when aclrtMalloc fails (nothing is held then).
  status allocate(std::uint64_t bytes, const char* what) {
    FUSEDATTN_ASSERT(ptr_ == nullptr);
    if (bytes == 0) return {};
    void* p = nullptr;
    const aclError code = aclrtMalloc(&p, static_cast<std::size_t>(bytes), ACL_MEM_MALLOC_HUGE_FIRST);
    if (code != ACL_SUCCESS || p == nullptr) {
      std::string text = recent_error_text();
      return {errc::out_of_memory, std::string("aclrtMalloc of ") + std::to_string(bytes) + " bytes (" + what +
                                       ") failed with " + std::to_string(code) +
                                       (text.empty() ? std::string() : ": " + text)};
    }
    ptr_ = p;
    bytes_ = bytes;
    return {};
  }

  void* get() const { return ptr_; }
  std::uint64_t bytes() const { return bytes_; }
  /// Keeps the memory for the rest of the process (the per-device mask cache).
  void* release() { return std::exchange(ptr_, nullptr); }

 private:
  void* ptr_ = nullptr;
  std::uint64_t bytes_ = 0;
};

}  // namespace ascend_backend
}  // namespace fusedattn
