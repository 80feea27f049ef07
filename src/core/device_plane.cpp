// src/core/device_plane.cpp - see device_plane.h.
#include "device_plane.h"

namespace fsdp::core {
namespace {

class DevicePlane final : public comm::DataPlane {
 public:
  explicit DevicePlane(device::Device& dev) : dev_(dev) {}
  bool owns(const void* ptr) const override { return dev_.device_only(ptr); }
  Mark mark() override { return dev_.mark(); }
  void wait(const Mark& m) override { dev_.wait_mark(std::static_pointer_cast<device::Event>(m)); }
  void copy(void* dst, const void* src, size_t nbytes) override { dev_.copy(dst, src, nbytes); }
  void reduce(void* out, void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale, bool clear) override {
    dev_.reduce_sum(out, ins, n_ins, numel, dtype, scale, clear);
  }
  void reduce_f64(double* out, const double* const* ins, size_t n_ins, size_t n) override {
    dev_.reduce_sum_f64(out, ins, n_ins, n);
  }
  void* native_stream() override { return dev_.native_stream(); }

 private:
  device::Device& dev_;
};

}  // namespace

std::shared_ptr<comm::DataPlane> make_device_plane(device::Device& dev) { return std::make_shared<DevicePlane>(dev); }

}  // namespace fsdp::core
