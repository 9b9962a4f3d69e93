// Probe: copy-engine latency and rate of bounced (D2H + H2D via pinned) 4 KiB writes, with or
// without a spinning kernel in this process, while P processes share the GPU.
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("ERR %s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
__global__ void spin(volatile int* stop, unsigned long long timeout_ns) {
  if (threadIdx.x == 0) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { __nanosleep(256); asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (*stop == 0 && now - start < timeout_ns);
  }
  __syncthreads();
}
using Clock = std::chrono::steady_clock;
double ms(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }
int main(int argc, char** argv) {
  const int with_kernel = atoi(argv[1]); const int n = atoi(argv[2]); const char* tag = argv[3];
  CK(cudaSetDevice(0));
  char *src, *dst, *bounce; int *stop_h, *stop_d;
  CK(cudaMalloc(&src, 1 << 20)); CK(cudaMalloc(&dst, 1 << 20)); CK(cudaHostAlloc((void**)&bounce, 1 << 20, cudaHostAllocPortable));
  CK(cudaHostAlloc((void**)&stop_h, 4, cudaHostAllocMapped)); CK(cudaHostGetDevicePointer((void**)&stop_d, stop_h, 0)); *stop_h = 0;
  cudaStream_t ks, cs; CK(cudaStreamCreateWithFlags(&ks, cudaStreamNonBlocking)); CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  cudaEvent_t ev; CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CK(cudaDeviceSynchronize());
  if (with_kernel) { spin<<<132, 128, 0, ks>>>(stop_d, 20000000000ull); std::this_thread::sleep_for(std::chrono::milliseconds(30)); }
  // latency: one pair at a time
  double lat_sum = 0, lat_max = 0;
  for (int i = 0; i < 50; ++i) {
    auto t0 = Clock::now();
    cudaMemcpyAsync(bounce, src, 4096, cudaMemcpyDeviceToHost, cs); cudaMemcpyAsync(dst, bounce, 4096, cudaMemcpyHostToDevice, cs);
    cudaEventRecord(ev, cs); while (cudaEventQuery(ev) == cudaErrorNotReady) {}
    double l = ms(t0, Clock::now()); lat_sum += l; if (l > lat_max) lat_max = l;
  }
  // rate: n pairs queued at once
  auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) { cudaMemcpyAsync(bounce + (i % 64) * 4096, src, 4096, cudaMemcpyDeviceToHost, cs); cudaMemcpyAsync(dst, bounce + (i % 64) * 4096, 4096, cudaMemcpyHostToDevice, cs); }
  auto t1 = Clock::now();
  cudaEventRecord(ev, cs); while (cudaEventQuery(ev) == cudaErrorNotReady) {}
  auto t2 = Clock::now();
  *stop_h = 1; CK(cudaDeviceSynchronize());
  printf("%s kernel=%d: pair latency mean %.3f max %.3f ms; %d pairs queued in %.1f ms, done after %.1f ms (%.1f us/pair)\n", tag, with_kernel,
         lat_sum / 50, lat_max, n, ms(t0, t1), ms(t0, t2), ms(t0, t2) * 1000 / n);
  return 0;
}
