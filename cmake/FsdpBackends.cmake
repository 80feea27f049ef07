# Resolves FSDP_WITH_CUDA / FSDP_WITH_MPI (AUTO|ON|OFF) into FSDP_HAVE_* flags.
# MPI: AUTO builds the mpi communicator when find_package(MPI) finds it, ON
# requires it, OFF leaves it out (comm=mpi is then FSDP_ERR_UNSUPPORTED). The
# CUDA: AUTO builds the CUDA device (src/device/cuda) and its kernels
# (kernels/cuda) when CMake finds nvcc and the CUDA toolkit, ON requires them,
# OFF leaves them out (device=cuda is then FSDP_ERR_UNSUPPORTED). The kernels
# are compiled for CMAKE_CUDA_ARCHITECTURES (default 80;90: A100, H100/H200).
foreach(opt FSDP_WITH_CUDA FSDP_WITH_MPI FSDP_WITH_NCCL)
  if(NOT ${opt} MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "${opt} must be AUTO, ON or OFF, not '${${opt}}'")
  endif()
endforeach()

set(FSDP_HAVE_CUDA OFF)
set(FSDP_HAVE_MPI OFF)
set(FSDP_HAVE_NCCL OFF)
if(NOT FSDP_WITH_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    find_package(CUDAToolkit)
  endif()
  if(CMAKE_CUDA_COMPILER AND CUDAToolkit_FOUND)
    # CMake's CUDAARCHS variable picks others (CI compiles for one: .ci/run).
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND "$ENV{CUDAARCHS}" STREQUAL "")
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    if(FSDP_CCACHE_EXE AND NOT CMAKE_CUDA_COMPILER_LAUNCHER)
      set(CMAKE_CUDA_COMPILER_LAUNCHER ${FSDP_CCACHE_EXE})
    endif()
    enable_language(CUDA)
    set(FSDP_HAVE_CUDA ON)
    message(STATUS "libfsdp: building the CUDA device (CUDA ${CUDAToolkit_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES})")
  elseif(FSDP_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "FSDP_WITH_CUDA=ON, but CMake found no CUDA compiler and toolkit (set CMAKE_CUDA_COMPILER or CUDAToolkit_ROOT)")
  else()
    message(STATUS "libfsdp: no CUDA toolkit found; building without the CUDA device")
  endif()
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

# NCCL: the nccl communicator, with the CUDA device only. AUTO builds it when
# nccl.h is found (the CUDA toolkit's folders, NCCL_ROOT, or a Python
# package's nvidia/nccl through CMAKE_PREFIX_PATH), ON requires it. The
# library itself is opened at run time (src/comm/nccl/nccl_lib.h), so that
# libfsdp.so loads where NCCL is not installed.
if(NOT FSDP_WITH_NCCL STREQUAL "OFF" AND FSDP_HAVE_CUDA)
  find_path(FSDP_NCCL_INCLUDE_DIR nccl.h HINTS ${NCCL_ROOT} ENV NCCL_ROOT ${CUDAToolkit_INCLUDE_DIRS}
            PATH_SUFFIXES include)
  if(FSDP_NCCL_INCLUDE_DIR)
    set(FSDP_HAVE_NCCL ON)
    add_library(fsdp_nccl INTERFACE IMPORTED)
    target_include_directories(fsdp_nccl INTERFACE ${FSDP_NCCL_INCLUDE_DIR})
    target_link_libraries(fsdp_nccl INTERFACE ${CMAKE_DL_LIBS})
    message(STATUS "libfsdp: building the nccl communicator (nccl.h in ${FSDP_NCCL_INCLUDE_DIR}; libnccl.so.2 opened at run time)")
  elseif(FSDP_WITH_NCCL STREQUAL "ON")
    message(FATAL_ERROR "FSDP_WITH_NCCL=ON, but nccl.h was not found (set NCCL_ROOT)")
  else()
    message(STATUS "libfsdp: NCCL not found; building without the nccl communicator")
  endif()
elseif(FSDP_WITH_NCCL STREQUAL "ON")
  message(FATAL_ERROR "FSDP_WITH_NCCL=ON needs the CUDA device (FSDP_WITH_CUDA)")
endif()
