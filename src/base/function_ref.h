// src/base/function_ref.h - FunctionRef: a non-owning reference to a callable,
// for parameters that are called during the call only (a parallel loop's
// body, a collective's body). Unlike a const std::function&, passing a lambda
// builds nothing on the heap, whatever it captures.
#pragma once

#include <type_traits>
#include <utility>

namespace fsdp::base {

template <typename Sig>
class FunctionRef;

template <typename R, typename... Args>
class FunctionRef<R(Args...)> {
 public:
  template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, FunctionRef>>>
  FunctionRef(F&& f) noexcept  // NOLINT(google-explicit-constructor): lambdas convert, as to std::function
      : obj_(const_cast<void*>(static_cast<const void*>(&f))), call_([](void* o, Args... a) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(o))(std::forward<Args>(a)...);
        }) {}
  R operator()(Args... a) const { return call_(obj_, std::forward<Args>(a)...); }

 private:
  void* obj_;
  R (*call_)(void*, Args...);
};

}  // namespace fsdp::base
