/// @file fake_cann.hpp
/// A recording fake of the CANN functions the Ascend backend calls, for the tests only (never installed): "device"
/// memory is host memory, every call is recorded with its arguments, the attention operators compute a float64
/// attention from the tensors they are given (per CANN's documented layout, sparse-mode and mask semantics), and
/// failures can be injected (an allocation, a GetWorkspaceSize, a launch) with an error text for aclGetRecentErrMsg.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <fusedattn_cann_declarations.h>

namespace fake_cann {

/// What aclCreateTensor was given.
struct tensor_record {
  std::vector<std::int64_t> dims;
  std::vector<std::int64_t> strides;
  std::int64_t offset = 0;
  std::vector<std::int64_t> storage;
  aclDataType dtype = ACL_DT_UNDEFINED;
  aclFormat format = ACL_FORMAT_UNDEFINED;
  void* data = nullptr;
};

/// One aclnnFlashAttentionScoreGetWorkspaceSize call.
struct flash_call {
  tensor_record q, k, v, out, softmax_max, softmax_sum;
  bool has_mask = false;
  tensor_record mask;
  bool other_inputs = false;  ///< pse, drop mask, padding mask, prefix or softmaxOut given
  double scale = 0, keep_prob = 0;
  std::int64_t pre_tokens = 0, next_tokens = 0, head_num = 0, inner_precise = 0, sparse_mode = 0;
  std::string layout;
};

/// One aclnnIncreFlashAttentionV4GetWorkspaceSize call.
struct decode_call {
  tensor_record q, out;
  std::vector<tensor_record> k, v;
  std::vector<std::int64_t> actual_seq_lengths;
  bool other_inputs = false;  ///< pse, mask, quantisation, block table or padding given
  double scale = 0;
  std::int64_t num_heads = 0, num_kv_heads = 0, block_size = 0, inner_precise = 0;
  std::string layout;
};

/// Everything recorded since reset().
struct journal {
  std::vector<flash_call> flash;
  std::vector<decode_call> decode;
  std::vector<std::string> launches;  ///< operator names in launch order
  std::vector<aclrtStream> streams;   ///< the stream of each launch
  int mallocs = 0;                    ///< aclrtMalloc calls
  int syncs = 0;                      ///< aclrtSynchronizeStream calls
};

/// Failures to inject; cleared by reset().
struct failures {
  int malloc_at = 0;              ///< the n-th aclrtMalloc (1-based, counted from reset) fails; 0: none
  std::string get_workspace;      ///< this GetWorkspaceSize function fails (e.g. "aclnnFlashAttentionScoreGetWorkspaceSize")
  std::string launch;             ///< this launch fails (e.g. "aclnnFlashAttentionScore")
  std::string message = "EZ9999: fake CANN failure";  ///< what aclGetRecentErrMsg returns after an injected failure
};

journal& log();
failures& inject();
/// Clears the journal and the injected failures (the per-device mask of the backend stays allocated).
void reset();
/// aclrtMalloc'd blocks not yet freed; aclTensor / aclScalar / aclIntArray / aclTensorList objects alive.
int live_allocations();
int live_objects();
/// Operators whose executor was made but never launched.
int pending_executors();

}  // namespace fake_cann
