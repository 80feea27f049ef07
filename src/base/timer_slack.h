// src/base/timer_slack.h - FineTimerSlack: sleeps of microseconds for a
// waiting thread. Linux stretches each sleep by the thread's timer slack, 50
// us by default; a wait that polls every few microseconds lowers it for the
// calling thread while it sleeps, and puts it back after (the thread may be
// the application's).
#pragma once

#include <sys/prctl.h>

namespace fsdp::base {

class FineTimerSlack {
 public:
  FineTimerSlack() = default;
  FineTimerSlack(const FineTimerSlack&) = delete;
  FineTimerSlack& operator=(const FineTimerSlack&) = delete;
  // Lowers the slack to 1 us (once; cheap to call before each sleep).
  void engage() {
    if (engaged_) return;
    engaged_ = true;
    old_ = static_cast<unsigned long>(prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0));
    if (old_ > kSlackNs) prctl(PR_SET_TIMERSLACK, kSlackNs, 0, 0, 0);
  }
  ~FineTimerSlack() {
    if (engaged_ && old_ > kSlackNs) prctl(PR_SET_TIMERSLACK, old_, 0, 0, 0);
  }

 private:
  static constexpr unsigned long kSlackNs = 1000;
  bool engaged_ = false;
  unsigned long old_ = 0;
};

}  // namespace fsdp::base
