// The CPU path of each operation. Parameters are already validated by the C ABI.
#pragma once

#include "params.h"

namespace nvfp4kv {

void cpu_store(const StoreParams& p);
// Most threads a CPU call uses (1 to kMaxCpuThreads; 0: one per usable CPU, at most 16):
// nvfp4kv_set_cpu_threads.
constexpr int kMaxCpuThreads = 256;
void cpu_set_threads(int threads);
int cpu_threads();
void cpu_dequantize(const DequantParams& p);
void cpu_gather(const GatherParams& p);

}  // namespace nvfp4kv
