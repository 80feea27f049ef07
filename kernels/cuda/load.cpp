// kernels/cuda/load.cpp - loads every libfsdp kernel into the current
// context up front (launch.h, load_kernels): each translation unit's kernels
// are one module; its functions are enumerated and loaded through the
// driver's entry points, which the static runtime hands out (libfsdp does not
// link libcuda).
#include <cuda.h>

#include <vector>

#include "launch.h"

namespace fsdp::kernels::cuda {
namespace {

// The driver functions this needs, from CUDA 12.4 on (any driver that runs
// CUDA 13 code has them).
struct Driver {
  CUresult (*func_get_module)(CUmodule*, CUfunction) = nullptr;
  CUresult (*module_get_function_count)(unsigned int*, CUmodule) = nullptr;
  CUresult (*module_enumerate_functions)(CUfunction*, unsigned int, CUmodule) = nullptr;
  CUresult (*func_load)(CUfunction) = nullptr;
};

template <class F>
cudaError_t entry_point(const char* symbol, F* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &p, 12040, cudaEnableDefault, &found);
  if (e != cudaSuccess) return e;
  if (found != cudaDriverEntryPointSuccess || p == nullptr) return cudaErrorSymbolNotFound;
  *fn = reinterpret_cast<F>(p);
  return cudaSuccess;
}

cudaError_t load_module_of(const Driver& d, const void* kernel, const char** what) {
  cudaFunction_t f = nullptr;
  *what = "cudaGetFuncBySymbol";
  cudaError_t e = cudaGetFuncBySymbol(&f, kernel);
  if (e != cudaSuccess) return e;
  CUmodule m = nullptr;
  unsigned int count = 0;
  *what = "cuFuncGetModule";
  if (d.func_get_module(&m, reinterpret_cast<CUfunction>(f)) != CUDA_SUCCESS) return cudaErrorInvalidResourceHandle;
  *what = "cuModuleGetFunctionCount";
  if (d.module_get_function_count(&count, m) != CUDA_SUCCESS) return cudaErrorInvalidResourceHandle;
  std::vector<CUfunction> fs(count);
  *what = "cuModuleEnumerateFunctions";
  if (count > 0 && d.module_enumerate_functions(fs.data(), count, m) != CUDA_SUCCESS) {
    return cudaErrorInvalidResourceHandle;
  }
  *what = "cuFuncLoad";
  for (CUfunction fn : fs) {
    if (d.func_load(fn) != CUDA_SUCCESS) return cudaErrorInvalidResourceHandle;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t load_kernels(const char** what) {
  Driver d;
  const std::pair<const char*, cudaError_t> entries[] = {
      {"cuFuncGetModule", entry_point("cuFuncGetModule", &d.func_get_module)},
      {"cuModuleGetFunctionCount", entry_point("cuModuleGetFunctionCount", &d.module_get_function_count)},
      {"cuModuleEnumerateFunctions", entry_point("cuModuleEnumerateFunctions", &d.module_enumerate_functions)},
      {"cuFuncLoad", entry_point("cuFuncLoad", &d.func_load)},
  };
  for (const auto& [symbol, e] : entries) {
    if (e != cudaSuccess) {
      *what = symbol;
      return e;
    }
  }
  for (const void* k : {elementwise_module_kernel(), norm_module_kernel()}) {
    cudaError_t e = load_module_of(d, k, what);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace fsdp::kernels::cuda
