# Resolves FSDP_WITH_CUDA / FSDP_WITH_MPI (AUTO|ON|OFF) into FSDP_HAVE_* flags.
# MPI: AUTO builds the mpi communicator when find_package(MPI) finds it, ON
# requires it, OFF leaves it out (comm=mpi is then FSDP_ERR_UNSUPPORTED). The
# CUDA device and NCCL communicator are delivered by later work; until their
# sources exist, ON fails loudly rather than building a library that silently
# lacks them.
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
if(NOT FSDP_WITH_MPI STREQUAL "OFF")
  if(FSDP_WITH_MPI STREQUAL "ON")
    find_package(MPI REQUIRED COMPONENTS C)
  else()
    find_package(MPI COMPONENTS C)
  endif()
  if(MPI_C_FOUND)
    set(FSDP_HAVE_MPI ON)
    message(STATUS "libfsdp: building the mpi communicator (MPI ${MPI_C_VERSION}: ${MPI_C_LIBRARIES})")
  else()
    message(STATUS "libfsdp: MPI not found; building without the mpi communicator (apt-get install libopenmpi-dev)")
  endif()
endif()
