// The one way loom's host code launches its kernels: the dynamic shared-memory limit set once per
// kernel and device (one cache for every operator), then cudaLaunchKernelEx (ready for cluster
// and other launch attributes). Include from .cu files only (the template launches a kernel).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "loom/status.h"
#include "runtime/cuda_check.h"

namespace loom::ops {

// Raises `kernel`'s dynamic shared-memory limit to `smem_bytes` on the current device where it
// needs the opt-in (over 48 KiB), once per (kernel, device, size); CUDA keeps the attribute per
// function and device. Either way the kernel is loaded now (CUDA's lazy loading would load it at
// its first launch, which can wait for running work: docs/NETWORK.md).
Status prepare_kernel(const void* kernel, size_t smem_bytes);

// Runs `load` (a family's kernel loading: prepare_kernel on each) once per (load, device) of this
// process, like prepare_kernel's cache: the first call on a device runs it, the ones after it
// succeeded return at once. Families whose kernels wait on the proxy load them all before their
// first launch (ops/tp/multinode/multinode.h says why).
Status load_once_per_device(Status (*load)());

// Launches kernel<<<grid, threads, smem_bytes, stream>>>(params).
template <class Params>
Status launch_kernel(void (*kernel)(Params), unsigned grid, unsigned threads, size_t smem_bytes, cudaStream_t stream,
                     const Params& params) {
  LOOM_TRY(prepare_kernel(reinterpret_cast<const void*>(kernel), smem_bytes));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  LOOM_CUDA_TRY(cudaLaunchKernelEx(&config, kernel, params));
  return Status{};
}

}  // namespace loom::ops
