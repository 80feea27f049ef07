// src/device/factory.h - the compute device a context runs on, made from its
// options without the engine naming a device's class: the CPU device, or the
// CUDA device where the build has it.
#pragma once

#include <memory>

#include "device.h"

namespace fsdp::device {

// The CPU device (`cuda_ordinal` < 0; `cpu_threads` workers) or CUDA device
// `cuda_ordinal`. Throws UNSUPPORTED for CUDA in a build without it or on a
// machine where no GPU can be used, INVALID_ARGUMENT for an ordinal out of
// range.
std::unique_ptr<Device> make_compute_device(int cuda_ordinal, int cpu_threads);

}  // namespace fsdp::device
