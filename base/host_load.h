// File: base/host_load.h
//
// What the host's run queue says about spare cores, for deciding whether another
// thread would run at once or only take turns with the ones already running.
// host_crowded() (base/future.h) answers the opposite question for pollers.
#pragma once

namespace ferry::internal {

// Whether the host had fewer runnable threads than cores at the last sample (the
// fourth field of /proc/loadavg, read at most every 20 ms by whichever caller comes
// first; the caller counts itself). True when the run queue cannot be read.
// Thread-safe and cheap: a clock read and two relaxed loads between samples.
bool host_has_idle_core();

}  // namespace ferry::internal
