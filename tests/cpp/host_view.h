/* A DLTensor over host memory, contiguous (strides NULL), one lane: the C and C++ tests' view of
   their buffers. */
#ifndef NVFP4KV_TESTS_HOST_VIEW_H
#define NVFP4KV_TESTS_HOST_VIEW_H

#include <string.h>

#include "nvfp4kv/nvfp4kv.h"

static inline DLTensor view(void* data, uint8_t code, uint8_t bits, int ndim, int64_t* shape) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = ndim;
  t.shape = shape;
  t.dtype.code = code;
  t.dtype.bits = bits;
  t.dtype.lanes = 1;
  return t;
}

#endif
