# FindAscendCANN: the parts of Huawei's CANN toolkit that fusedattn's Ascend backend uses (AscendCL and the aclnn
# operator API). Looks in ASCEND_TOOLKIT_HOME, then ASCEND_HOME_PATH (CMake variables or environment variables, as
# CANN's set_env.sh exports them), then /usr/local/Ascend/ascend-toolkit/latest.
#
# Defines AscendCANN_FOUND, AscendCANN_INCLUDE_DIR and the imported targets AscendCANN::ascendcl,
# AscendCANN::opapi and AscendCANN::nnopbase (each carrying the toolkit's include directory).
set(_fusedattn_cann_hints)
foreach(_var ASCEND_TOOLKIT_HOME ASCEND_HOME_PATH)
  if(DEFINED ${_var})
    list(APPEND _fusedattn_cann_hints "${${_var}}")
  endif()
  if(DEFINED ENV{${_var}})
    list(APPEND _fusedattn_cann_hints "$ENV{${_var}}")
  endif()
endforeach()
list(APPEND _fusedattn_cann_hints /usr/local/Ascend/ascend-toolkit/latest)

find_path(AscendCANN_INCLUDE_DIR acl/acl.h HINTS ${_fusedattn_cann_hints} PATH_SUFFIXES include NO_DEFAULT_PATH)
find_path(AscendCANN_ACLNNOP_INCLUDE_DIR aclnnop/aclnn_flash_attention_score.h
          HINTS ${_fusedattn_cann_hints} PATH_SUFFIXES include NO_DEFAULT_PATH)
foreach(_lib ascendcl opapi nnopbase)
  find_library(AscendCANN_${_lib}_LIBRARY ${_lib} HINTS ${_fusedattn_cann_hints} PATH_SUFFIXES lib64 lib
               NO_DEFAULT_PATH)
endforeach()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(AscendCANN
  REQUIRED_VARS AscendCANN_INCLUDE_DIR AscendCANN_ACLNNOP_INCLUDE_DIR AscendCANN_ascendcl_LIBRARY
                AscendCANN_opapi_LIBRARY AscendCANN_nnopbase_LIBRARY)

if(AscendCANN_FOUND)
  foreach(_lib ascendcl opapi nnopbase)
    if(NOT TARGET AscendCANN::${_lib})
      add_library(AscendCANN::${_lib} SHARED IMPORTED)
      set_target_properties(AscendCANN::${_lib} PROPERTIES
        IMPORTED_LOCATION "${AscendCANN_${_lib}_LIBRARY}"
        INTERFACE_INCLUDE_DIRECTORIES "${AscendCANN_INCLUDE_DIR};${AscendCANN_ACLNNOP_INCLUDE_DIR}")
    endif()
  endforeach()
endif()
mark_as_advanced(AscendCANN_INCLUDE_DIR AscendCANN_ACLNNOP_INCLUDE_DIR AscendCANN_ascendcl_LIBRARY
                 AscendCANN_opapi_LIBRARY AscendCANN_nnopbase_LIBRARY)
unset(_fusedattn_cann_hints)
