// src/comm/nccl/nccl_lib.h - NCCL opened at run time (dlopen), so that
// libfsdp.so loads on machines without NCCL (as it does without CUDA: the
// runtime is static and the driver is opened when a GPU is used) and finds
// the NCCL the machine has: libnccl.so.2 on the loader's path, or the file
// FSDP_NCCL_LIBRARY names (e.g. a Python package's nvidia/nccl/lib). nccl.h
// gives the types and the signatures; nccl() gives the functions.
#pragma once

#include <nccl.h>

namespace fsdp::comm {

struct NcclApi {
  decltype(&::ncclGetUniqueId) GetUniqueId;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&::ncclCommAbort) CommAbort;
  decltype(&::ncclCommDestroy) CommDestroy;
  decltype(&::ncclCommUserRank) CommUserRank;
  decltype(&::ncclCommSplit) CommSplit;
  decltype(&::ncclAllGather) AllGather;
  decltype(&::ncclReduceScatter) ReduceScatter;
  decltype(&::ncclAllReduce) AllReduce;
  decltype(&::ncclBroadcast) Broadcast;
  decltype(&::ncclSend) Send;
  decltype(&::ncclRecv) Recv;
  decltype(&::ncclGroupStart) GroupStart;
  decltype(&::ncclGroupEnd) GroupEnd;
  decltype(&::ncclGetErrorString) GetErrorString;
  decltype(&::ncclGetLastError) GetLastError;
};

// The functions of the NCCL this process loaded (once, on first use). Throws
// UNSUPPORTED naming the file and dlerror() when none can be loaded or it
// lacks a function (an NCCL older than 2.18, which has ncclCommSplit and
// non-blocking communicators).
const NcclApi& nccl();

}  // namespace fsdp::comm
