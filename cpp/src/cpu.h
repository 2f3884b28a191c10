// The CPU path of each operation. Parameters are already validated by the C ABI.
#pragma once

#include "params.h"

namespace nvfp4kv {

void cpu_store(const StoreParams& p);
void cpu_dequantize(const DequantParams& p);
void cpu_gather(const GatherParams& p);

}  // namespace nvfp4kv
