/// @file fusedattn_cann_declarations.h
/// The CANN prototypes, types and enum values fusedattn's Ascend backend uses, transcribed from the CANN 8.x
/// documentation, for compiling the backend where the toolkit is absent (CI). Never installed; never used with CANN.
///
/// Sources (CANN commercial 8.0.0 / Community Edition 8.2 documentation, hiascend.com):
///   aclnnFlashAttentionScore, aclnnFlashAttentionScoreGetWorkspaceSize:
///     document/detail/zh/canncommercial/800/apiref/aolapi/context/aclnnFlashAttentionScore.md
///     (the same text in cann/ops-transformer attention/flash_attention_score/docs/aclnnFlashAttentionScore.md)
///   sparseMode values and their masks: cann/ops-transformer docs/zh/context/sparse_mode参数说明.md
///   aclnnIncreFlashAttentionV4: cann/ops-transformer attention/incre_flash_attention/docs/aclnnIncreFlashAttentionV4.md
///   aclCreateTensor, aclDestroyTensor, aclCreateIntArray, aclCreateScalar, aclCreateTensorList (and Destroy),
///   aclSetAclOpExecutorRepeatable, aclDestroyAclOpExecutor:
///     document/detail/zh/canncommercial/800/apiref/aolapi/operatorlist_00019.html (and the pages after it)
///   aclnnLog, aclnnInplaceAdd, aclnnInplaceZero, aclnnInplaceFillScalar: the aclnn math operator pages of the same
///     reference (aclnnop/aclnn_log.h, aclnn_add.h, aclnn_zero.h, aclnn_fill_scalar.h)
///   aclrtMalloc, aclrtFree, aclrtMemcpy, aclrtSynchronizeStream, aclrtGetDevice, aclGetRecentErrMsg, aclDataType,
///     aclFormat, aclrtMemMallocPolicy, aclrtMemcpyKind: AscendCL application development reference
///     (hicann/runtime docs/api_docs/aclDataType.md for the enum values)
#ifndef FUSEDATTN_CANN_DECLARATIONS_H
#define FUSEDATTN_CANN_DECLARATIONS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// ---- acl/acl_base.h, acl/acl_rt.h -------------------------------------------------------------------------------
typedef void* aclrtStream;
typedef int aclError;
#define ACL_SUCCESS 0

typedef enum {
  ACL_DT_UNDEFINED = -1,
  ACL_FLOAT = 0,
  ACL_FLOAT16 = 1,
  ACL_INT8 = 2,
  ACL_INT32 = 3,
  ACL_UINT8 = 4,
  ACL_INT16 = 6,
  ACL_UINT16 = 7,
  ACL_UINT32 = 8,
  ACL_INT64 = 9,
  ACL_UINT64 = 10,
  ACL_DOUBLE = 11,
  ACL_BOOL = 12,
  ACL_BF16 = 27,
} aclDataType;

typedef enum {
  ACL_FORMAT_UNDEFINED = -1,
  ACL_FORMAT_NCHW = 0,
  ACL_FORMAT_NHWC = 1,
  ACL_FORMAT_ND = 2,
} aclFormat;

typedef enum {
  ACL_MEM_MALLOC_HUGE_FIRST = 0,
  ACL_MEM_MALLOC_HUGE_ONLY = 1,
  ACL_MEM_MALLOC_NORMAL_ONLY = 2,
} aclrtMemMallocPolicy;

typedef enum {
  ACL_MEMCPY_HOST_TO_HOST = 0,
  ACL_MEMCPY_HOST_TO_DEVICE = 1,
  ACL_MEMCPY_DEVICE_TO_HOST = 2,
  ACL_MEMCPY_DEVICE_TO_DEVICE = 3,
} aclrtMemcpyKind;

aclError aclrtMalloc(void** devPtr, size_t size, aclrtMemMallocPolicy policy);
aclError aclrtFree(void* devPtr);
aclError aclrtMemcpy(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind);
aclError aclrtSynchronizeStream(aclrtStream stream);
aclError aclrtGetDevice(int32_t* deviceId);
const char* aclGetRecentErrMsg(void);

// ---- aclnn/acl_meta.h, aclnn/aclnn_base.h -----------------------------------------------------------------------
typedef int32_t aclnnStatus;
typedef struct aclOpExecutor aclOpExecutor;
typedef struct aclTensor aclTensor;
typedef struct aclScalar aclScalar;
typedef struct aclIntArray aclIntArray;
typedef struct aclTensorList aclTensorList;

aclTensor* aclCreateTensor(const int64_t* viewDims, uint64_t viewDimsNum, aclDataType dataType, const int64_t* stride,
                           int64_t offset, aclFormat format, const int64_t* storageDims, uint64_t storageDimsNum,
                           void* tensorData);
aclnnStatus aclDestroyTensor(const aclTensor* tensor);
aclIntArray* aclCreateIntArray(const int64_t* value, uint64_t size);
aclnnStatus aclDestroyIntArray(const aclIntArray* array);
aclScalar* aclCreateScalar(void* value, aclDataType dataType);
aclnnStatus aclDestroyScalar(const aclScalar* scalar);
/// An executor that is never launched is released by making it repeatable and destroying it.
aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor* executor);
aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor* executor);
/// The list owns its tensors: aclDestroyTensorList destroys them too.
aclTensorList* aclCreateTensorList(const aclTensor* const* value, uint64_t size);
aclnnStatus aclDestroyTensorList(const aclTensorList* array);

// ---- aclnnop/aclnn_flash_attention_score.h ----------------------------------------------------------------------
aclnnStatus aclnnFlashAttentionScoreGetWorkspaceSize(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* realShiftOptional,
    const aclTensor* dropMaskOptional, const aclTensor* paddingMaskOptional, const aclTensor* attenMaskOptional,
    const aclIntArray* prefixOptional, double scaleValue, double keepProb, int64_t preTokens, int64_t nextTokens,
    int64_t headNum, char* inputLayout, int64_t innerPrecise, int64_t sparseMode, const aclTensor* softmaxMaxOut,
    const aclTensor* softmaxSumOut, const aclTensor* softmaxOutOut, const aclTensor* attentionOutOut,
    uint64_t* workspaceSize, aclOpExecutor** executor);
aclnnStatus aclnnFlashAttentionScore(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                                     const aclrtStream stream);

// ---- aclnnop/aclnn_incre_flash_attention_v4.h -------------------------------------------------------------------
aclnnStatus aclnnIncreFlashAttentionV4GetWorkspaceSize(
    const aclTensor* query, const aclTensorList* key, const aclTensorList* value, const aclTensor* pseShift,
    const aclTensor* attenMask, const aclIntArray* actualSeqLengths, const aclTensor* dequantScale1,
    const aclTensor* quantScale1, const aclTensor* dequantScale2, const aclTensor* quantScale2,
    const aclTensor* quantOffset2, const aclTensor* antiquantScale, const aclTensor* antiquantOffset,
    const aclTensor* blocktable, const aclTensor* kvPaddingSize, int64_t numHeads, double scaleValue,
    char* inputLayout, int64_t numKeyValueHeads, int64_t blockSize, int64_t innerPrecise,
    const aclTensor* attentionOut, uint64_t* workspaceSize, aclOpExecutor** executor);
aclnnStatus aclnnIncreFlashAttentionV4(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                                       const aclrtStream stream);

// ---- aclnnop/aclnn_log.h, aclnn_add.h, aclnn_zero.h, aclnn_fill_scalar.h ---------------------------------------
aclnnStatus aclnnLogGetWorkspaceSize(const aclTensor* self, aclTensor* out, uint64_t* workspaceSize,
                                     aclOpExecutor** executor);
aclnnStatus aclnnLog(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor, aclrtStream stream);
aclnnStatus aclnnInplaceAddGetWorkspaceSize(const aclTensor* selfRef, const aclTensor* other, const aclScalar* alpha,
                                            uint64_t* workspaceSize, aclOpExecutor** executor);
aclnnStatus aclnnInplaceAdd(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor, aclrtStream stream);
aclnnStatus aclnnInplaceZeroGetWorkspaceSize(aclTensor* selfRef, uint64_t* workspaceSize, aclOpExecutor** executor);
aclnnStatus aclnnInplaceZero(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor, aclrtStream stream);
aclnnStatus aclnnInplaceFillScalarGetWorkspaceSize(aclTensor* selfRef, const aclScalar* value, uint64_t* workspaceSize,
                                                   aclOpExecutor** executor);
aclnnStatus aclnnInplaceFillScalar(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                                   aclrtStream stream);

#ifdef __cplusplus
}
#endif

#endif  // FUSEDATTN_CANN_DECLARATIONS_H
