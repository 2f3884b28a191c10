// The CPU backend's threads (cpu.cpp) for its other files: a call split into shares, each run on
// its own thread in the IEEE float mode, joined before the call returns.
#pragma once

#include <stdint.h>

#include <functional>

namespace nvfp4kv {

// fn(k, n) for each share k of n, on up to the configured threads: fewer when `work` (elements in
// all) is small, one when `separate` is false (the call's outputs may share bytes across shares).
void cpu_for_shares(double work, bool separate, const std::function<void(int, int)>& fn);
// The same in two steps, for a call that allocates each share's buffers before any share writes
// (so that running out of memory leaves the outputs untouched): the count of shares, then the run.
int cpu_share_count(double work, bool separate);
void cpu_run_shares(int n, const std::function<void(int, int)>& fn);
// Whether unit i (>= 0) belongs to share k of n (hashed: units with a common stride spread).
bool cpu_in_share(int64_t i, int k, int n);

}  // namespace nvfp4kv
