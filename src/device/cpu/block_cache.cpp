// src/device/cpu/block_cache.cpp - see block_cache.h.
#include "block_cache.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>

namespace fsdp::device {
namespace {

constexpr size_t kAlign = 64;

// Inserts (key, value) into `map` in a spare node when there is one.
template <typename Map, typename K, typename V>
void insert_reusing(Map& map, std::vector<typename Map::node_type>& spares, K key, V value) {
  if (spares.empty()) {
    map.emplace(key, value);
    return;
  }
  typename Map::node_type node = std::move(spares.back());
  spares.pop_back();
  node.key() = key;
  node.mapped() = value;
  map.insert(std::move(node));
}

size_t rounded(size_t nbytes) { return nbytes == 0 ? kAlign : (nbytes + kAlign - 1) / kAlign * kAlign; }

// aligned_alloc takes whole multiples of the alignment (a sanitizer refuses others).
void* aligned(size_t nbytes) { return std::aligned_alloc(kAlign, rounded(nbytes)); }

}  // namespace

HostMemory plain_host_memory() { return {aligned, std::free}; }

BlockCache::BlockCache(bool enabled, HostMemory system) : enabled_(enabled), system_(system) {
  // Spare nodes for more blocks than a step takes, made now rather than when
  // the first blocks of a size go back.
  constexpr int kSpareNodes = 64;
  for (int i = 0; i < kSpareNodes; ++i) {
    spare_cached_.push_back(free_.extract(free_.emplace(size_t(0), nullptr)));
    spare_in_use_.push_back(in_use_.extract(in_use_.emplace(reinterpret_cast<void*>(uintptr_t(i) + 1), 0).first));
  }
  in_use_.reserve(kSpareNodes);
}

BlockCache::~BlockCache() {
  for (auto& kv : free_) system_.free(kv.second);
  for (auto& kv : zero_) system_.free(kv.second);
  // Blocks still in use belong to buffers that outlive the device: a bug the
  // owners' destructors would show; they are not freed here twice.
}

void* BlockCache::take_locked(std::multimap<size_t, void*>& from, size_t n) {
  auto it = from.find(n);
  if (it == from.end()) return nullptr;
  void* p = it->second;
  spare_cached_.push_back(from.extract(it));
  cached_ -= n;
  return p;
}

void* BlockCache::alloc(size_t nbytes, bool want_zero, bool* is_zero) {
  size_t n = rounded(nbytes);
  if (is_zero != nullptr) *is_zero = false;
  if (!enabled_) return system_.alloc(n);
  std::lock_guard<std::mutex> lock(mu_);
  void* p = take_locked(want_zero ? zero_ : free_, n);
  if (p != nullptr) {
    if (is_zero != nullptr) *is_zero = want_zero;
  } else if ((p = take_locked(want_zero ? free_ : zero_, n)) != nullptr) {
    if (is_zero != nullptr) *is_zero = !want_zero;
  } else {
    // A new block: make room under the bound first (the peak in use plus the
    // largest block), so that the footprint grows only when the bytes in use
    // do. The one block of slack lets scratch blocks of a few sizes that are
    // never in use together stay cached together, instead of each evicting
    // the other on every use (a reduction's scratch, unit after unit).
    largest_ = std::max(largest_, n);
    trim_locked(std::max(peak_, used_ + n) + largest_ - n);
    p = system_.alloc(n);
    if (p == nullptr && cached_ > 0) {
      trim_locked(used_);  // out of memory: give every cached block back and retry
      p = system_.alloc(n);
    }
    if (p == nullptr) return nullptr;
  }
  insert_reusing(in_use_, spare_in_use_, p, n);
  used_ += n;
  peak_ = std::max(peak_, used_);
  return p;
}

void BlockCache::free(void* ptr) noexcept { release(ptr, false); }
void BlockCache::free_zeroed(void* ptr) noexcept { release(ptr, true); }

void BlockCache::release(void* ptr, bool zero) noexcept {
  if (ptr == nullptr) return;
  if (!enabled_) {
    system_.free(ptr);
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = in_use_.find(ptr);
  if (it == in_use_.end()) {
    system_.free(ptr);  // not ours (cannot happen through CpuDevice); the system's then
    return;
  }
  size_t n = it->second;
  spare_in_use_.push_back(in_use_.extract(it));
  used_ -= n;
  insert_reusing(zero ? zero_ : free_, spare_cached_, n, ptr);
  cached_ += n;
}

void BlockCache::trim_locked(size_t limit) {
  for (auto* from : {&free_, &zero_}) {
    while (!from->empty() && cached_ + used_ > limit) {
      auto last = std::prev(from->end());  // the largest block
      cached_ -= last->first;
      system_.free(last->second);
      spare_cached_.push_back(from->extract(last));
    }
  }
}

}  // namespace fsdp::device
