// src/base/task.h - Task: a move-only void() callable that keeps callables of
// up to kInline bytes inside itself, so that queueing work on a stream costs
// no heap allocation (std::function allocates past two pointers' worth of
// captures). A larger callable still works, on the heap: the transition path
// keeps its captures small, and test_alloc pins that it does.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

namespace fsdp::base {

class Task {
 public:
  static constexpr size_t kInline = 120;

  Task() = default;
  Task(std::nullptr_t) {}  // NOLINT(google-explicit-constructor): an empty task, as for std::function
  template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, Task>>>
  Task(F&& f) {  // NOLINT(google-explicit-constructor): lambdas convert, as to std::function
    using Fn = std::decay_t<F>;
    if constexpr (sizeof(Fn) <= kInline && alignof(Fn) <= alignof(std::max_align_t) &&
                  std::is_nothrow_move_constructible_v<Fn>) {
      ::new (static_cast<void*>(buf_)) Fn(std::forward<F>(f));
      ops_ = &kInlineOps<Fn>;
    } else {
      ::new (static_cast<void*>(buf_)) Fn*(new Fn(std::forward<F>(f)));
      ops_ = &kHeapOps<Fn>;
    }
  }
  Task(Task&& o) noexcept { take(o); }
  Task& operator=(Task&& o) noexcept {
    if (this != &o) {
      reset();
      take(o);
    }
    return *this;
  }
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;
  ~Task() { reset(); }

  explicit operator bool() const { return ops_ != nullptr; }
  void operator()() { ops_->call(buf_); }
  void reset() {
    if (ops_ != nullptr) ops_->destroy(buf_);
    ops_ = nullptr;
  }

 private:
  struct Ops {
    void (*call)(void*);
    void (*move)(void* from, void* to);  // move-constructs into `to` and destroys `from`
    void (*destroy)(void*);
  };
  template <typename Fn>
  static constexpr Ops kInlineOps = {[](void* p) { (*static_cast<Fn*>(p))(); },
                                     [](void* from, void* to) {
                                       ::new (to) Fn(std::move(*static_cast<Fn*>(from)));
                                       static_cast<Fn*>(from)->~Fn();
                                     },
                                     [](void* p) { static_cast<Fn*>(p)->~Fn(); }};
  template <typename Fn>
  static constexpr Ops kHeapOps = {[](void* p) { (**static_cast<Fn**>(p))(); },
                                   [](void* from, void* to) { ::new (to) Fn*(*static_cast<Fn**>(from)); },
                                   [](void* p) { std::unique_ptr<Fn> owned(*static_cast<Fn**>(p)); }};

  void take(Task& o) noexcept {
    if (o.ops_ == nullptr) return;
    o.ops_->move(o.buf_, buf_);
    ops_ = o.ops_;
    o.ops_ = nullptr;
  }

  alignas(std::max_align_t) unsigned char buf_[kInline];
  const Ops* ops_ = nullptr;
};

}  // namespace fsdp::base
