// src/core/device_plane.h - the DataPlane core gives a communicator for the
// memory of its compute device when the host cannot read that memory (ranks
// as threads of one process sharing a GPU): the device's copies, reductions
// and marks, queued on the stream that runs the collective (the comm
// stream's task). Core builds it so that comm and device never see each other.
#pragma once

#include <memory>

#include "../comm/data_plane.h"
#include "../device/device.h"

namespace fsdp::core {

// `dev` outlives the plane (both belong to one context).
std::shared_ptr<comm::DataPlane> make_device_plane(device::Device& dev);

}  // namespace fsdp::core
