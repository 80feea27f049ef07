// src/core/ckpt_stage.h - how checkpoint code moves a device's memory to and
// from files: HostStage, host memory a device's memory is staged through, and
// write_from, which streams device memory into a file writer through it.
// Private to the checkpoint code of src/core.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "../base/error.h"
#include "../ckpt/meta.h"
#include "../ckpt/safetensors.h"
#include "../device/device.h"
#include "memory.h"

namespace fsdp::core {

inline constexpr size_t kStageBytes = 8u << 20;

// Host memory that a device's memory is staged through for files: the
// device's own host memory (pinned on a GPU, which copies to and from it at
// full speed), taken on first use and grown as asked.
class HostStage {
 public:
  // Counted in `tracker` (scratch, host pool) where one is given.
  explicit HostStage(const device::Device& dev, MemoryTracker* tracker = nullptr)
      : mem_(dev.host_memory()), tracker_(tracker) {}
  ~HostStage() { release(); }
  HostStage(const HostStage&) = delete;
  HostStage& operator=(const HostStage&) = delete;
  // At least `nbytes` (the contents are not kept when it grows).
  void* get(size_t nbytes) {
    if (nbytes > nbytes_) {
      release();
      data_ = mem_.alloc(nbytes);
      if (data_ == nullptr) {
        fail(FSDP_ERR_OUT_OF_MEMORY, "checkpoint: could not allocate " + std::to_string(nbytes) +
                                         " bytes of host memory to stage device memory through");
      }
      nbytes_ = nbytes;
      if (tracker_ != nullptr) tracker_->add(MemCategory::kScratch, device::Pool::kHost, nbytes_);
    }
    return data_;
  }

 private:
  void release() {
    if (data_ == nullptr) return;
    mem_.free(data_);
    if (tracker_ != nullptr) tracker_->sub(MemCategory::kScratch, device::Pool::kHost, nbytes_);
    data_ = nullptr;
    nbytes_ = 0;
  }
  device::HostMemory mem_;
  MemoryTracker* tracker_;
  void* data_ = nullptr;
  size_t nbytes_ = 0;
};

// Streams `nbytes` of `dev` memory into the writer (staged through `stage`
// in pieces when the device's memory is not host-visible).

inline void write_from(ckpt::Writer& w, device::Device* dev, HostStage& stage, const void* src, size_t nbytes) {
  if (dev->host_visible()) {
    w.write(src, nbytes);
    return;
  }
  size_t piece = std::min(nbytes, kStageBytes);
  char* buf = static_cast<char*>(stage.get(piece));
  for (size_t off = 0; off < nbytes; off += piece) {
    size_t k = std::min(piece, nbytes - off);
    dev->copy_to_host(buf, static_cast<const char*>(src) + off, k);
    w.write(buf, k);
  }
}

// The ranks' file records (gather_strings of files_to_json) into the
// metadata's file list, in rank order (checkpoint_save.cpp).
void add_file_records(const std::vector<std::string>& records, ckpt::Meta* meta);

}  // namespace fsdp::core
