// src/base/ring.h - Ring: a FIFO queue in one vector that doubles when full
// and is never shrunk, so that a queue pushed and popped at a steady rate
// allocates nothing once it has held its deepest backlog (std::deque
// allocates and frees a block every few elements). A push may move the
// elements: hold no reference across one.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace fsdp::base {

template <typename T>
class Ring {
 public:
  explicit Ring(size_t capacity = 16) : items_(capacity == 0 ? 1 : capacity) {}

  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  // The i-th oldest element.
  T& operator[](size_t i) { return items_[(head_ + i) % items_.size()]; }
  T& front() { return items_[head_]; }
  void push_back(T value) {
    if (size_ == items_.size()) {
      std::vector<T> bigger(items_.size() * 2);
      for (size_t i = 0; i < size_; ++i) bigger[i] = std::move((*this)[i]);
      items_.swap(bigger);
      head_ = 0;
    }
    items_[(head_ + size_++) % items_.size()] = std::move(value);
  }
  void pop_front() {
    items_[head_] = T();
    head_ = (head_ + 1) % items_.size();
    --size_;
  }

 private:
  std::vector<T> items_;
  size_t head_ = 0;
  size_t size_ = 0;
};

}  // namespace fsdp::base
