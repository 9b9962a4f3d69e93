// Probe: does a host-issued copy complete while a kernel of the SAME process occupies every SM?
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("ERR %s: %s line %d\n", #x, cudaGetErrorString(e), __LINE__); return 1; } } while (0)

__global__ void __launch_bounds__(1024, 1) spin(volatile unsigned long long* flag, unsigned long long timeout_ns, unsigned long long* waited) {
  extern __shared__ char smem[];
  if (threadIdx.x == 0) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    smem[0] = 1;
    do {
      __nanosleep(200);
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (*flag == 0 && now - start < timeout_ns);
    if (blockIdx.x == 0) *waited = now - start;
  }
  __syncthreads();
}

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

int main() {
  CK(cudaSetDevice(0));
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
  const size_t smem = 100 * 1024;
  CK(cudaFuncSetAttribute(spin, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int per_sm = 0; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, spin, 1024, smem));
  printf("%s: %d SMs, %d spin CTAs of 1024 threads per SM\n", prop.name, prop.multiProcessorCount, per_sm);
  unsigned long long *flag_h, *flag_d, *waited;
  CK(cudaHostAlloc((void**)&flag_h, 8, cudaHostAllocMapped));
  CK(cudaHostGetDevicePointer((void**)&flag_d, flag_h, 0));
  CK(cudaMallocManaged((void**)&waited, 8));
  const size_t big = 1 << 20;
  char *a, *b, *host_pinned; CK(cudaMalloc(&a, big)); CK(cudaMalloc(&b, big)); CK(cudaHostAlloc((void**)&host_pinned, big, 0));
  // cuMem allocations
  CUdeviceptr va = 0, vb = 0;
  {
    CUmemAllocationProp p{}; p.type = CU_MEM_ALLOCATION_TYPE_PINNED; p.location.type = CU_MEM_LOCATION_TYPE_DEVICE; p.location.id = 0;
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t gran = 0; cuMemGetAllocationGranularity(&gran, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    size_t sz = ((big + gran - 1) / gran) * gran;
    for (CUdeviceptr* v : {&va, &vb}) {
      CUmemGenericAllocationHandle h; if (cuMemCreate(&h, sz, &p, 0) != CUDA_SUCCESS) { printf("cuMemCreate failed\n"); return 1; }
      cuMemAddressReserve(v, sz, gran, 0, 0); cuMemMap(*v, sz, 0, h, 0);
      CUmemAccessDesc d{}; d.location = p.location; d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE; cuMemSetAccess(*v, sz, &d, 1);
    }
  }
  cudaStream_t ks, cs; CK(cudaStreamCreateWithFlags(&ks, cudaStreamNonBlocking)); CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  cudaEvent_t ev; CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  struct Case { const char* name; int kind; size_t bytes; };
  Case cases[] = {{"D2D cudaMalloc 1MiB", 0, big}, {"D2D cudaMalloc 8B", 0, 8}, {"D2D cuMem 1MiB", 1, big}, {"D2D cuMem 8B", 1, 8},
                  {"H2D pinned 8B", 2, 8}, {"D2H pinned 1MiB", 3, big}, {"D2D batch PreferOverlap cuMem 1MiB", 4, big},
                  {"D2D batch PreferOverlap cuMem 8B", 4, 8}, {"D2D cudaMemcpyPeerAsync same dev 1MiB", 5, big}};
  for (const Case& c : cases) {
    *flag_h = 0; *waited = 0;
    spin<<<prop.multiProcessorCount * per_sm, 1024, smem, ks>>>(flag_d, 2000000000ull, waited);
    CK(cudaGetLastError());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    auto t0 = Clock::now();
    cudaError_t e = cudaSuccess;
    switch (c.kind) {
      case 0: e = cudaMemcpyAsync(b, a, c.bytes, cudaMemcpyDefault, cs); break;
      case 1: e = cudaMemcpyAsync((void*)vb, (void*)va, c.bytes, cudaMemcpyDefault, cs); break;
      case 2: e = cudaMemcpyAsync(b, host_pinned, c.bytes, cudaMemcpyDefault, cs); break;
      case 3: e = cudaMemcpyAsync(host_pinned, a, c.bytes, cudaMemcpyDefault, cs); break;
      case 4: {
        void* d[1] = {(void*)vb}; const void* s[1] = {(void*)va}; size_t sz[1] = {c.bytes};
        cudaMemcpyAttributes at{}; at.srcAccessOrder = cudaMemcpySrcAccessOrderStream; at.flags = cudaMemcpyFlagPreferOverlapWithCompute;
        at.srcLocHint.type = cudaMemLocationTypeDevice; at.dstLocHint.type = cudaMemLocationTypeDevice;
        size_t idx = 0; e = cudaMemcpyBatchAsync(d, s, sz, 1, &at, &idx, 1, cs); break;
      }
      case 5: e = cudaMemcpyPeerAsync(b, 0, a, 0, c.bytes, cs); break;
    }
    double issue_ms = ms_since(t0);
    if (e != cudaSuccess) { printf("%-40s issue failed: %s\n", c.name, cudaGetErrorString(e)); cudaGetLastError(); }
    CK(cudaEventRecord(ev, cs));
    double landed = -1;
    while (ms_since(t0) < 1000) { if (cudaEventQuery(ev) == cudaSuccess) { landed = ms_since(t0); break; } }
    *flag_h = 1;
    CK(cudaStreamSynchronize(ks)); CK(cudaStreamSynchronize(cs));
    double total = ms_since(t0);
    printf("%-40s issue %.3f ms; %s (%.3f ms); kernel spun %.1f ms\n", c.name, issue_ms,
           landed >= 0 ? "LANDED while the kernel ran" : "did NOT land while the kernel ran", landed >= 0 ? landed : total,
           *waited / 1e6);
  }
  return 0;
}
