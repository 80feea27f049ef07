# Resolves FSDP_WITH_CUDA / FSDP_WITH_MPI (AUTO|ON|OFF) into FSDP_HAVE_* flags.
# The CUDA device, NCCL communicator and MPI communicator are delivered by later
# work; until their sources exist, ON fails loudly rather than building a library
# that silently lacks them, and AUTO records that they are not built.
foreach(opt FSDP_WITH_CUDA FSDP_WITH_MPI)
  if(NOT ${opt} MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "${opt} must be AUTO, ON or OFF, not '${${opt}}'")
  endif()
endforeach()

set(FSDP_HAVE_CUDA OFF)
set(FSDP_HAVE_MPI OFF)
if(NOT EXISTS "${PROJECT_SOURCE_DIR}/src/device/cuda")
  if(FSDP_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "FSDP_WITH_CUDA=ON, but this source tree has no CUDA device yet (src/device/cuda); use AUTO or OFF")
  endif()
  message(STATUS "libfsdp: CUDA device not in this source tree; building CPU only")
endif()
if(NOT EXISTS "${PROJECT_SOURCE_DIR}/src/comm/mpi")
  if(FSDP_WITH_MPI STREQUAL "ON")
    message(FATAL_ERROR "FSDP_WITH_MPI=ON, but this source tree has no MPI communicator yet (src/comm/mpi); use AUTO or OFF")
  endif()
  message(STATUS "libfsdp: MPI communicator not in this source tree; building without it")
endif()
