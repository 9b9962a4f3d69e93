#include "runtime/transports/cuda_memory.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <utility>

#include "runtime/cuda_check.h"
#include "runtime/cuda_driver.h"

namespace loom::runtime::net {

Result<MappedRing> MappedRing::create(uint32_t capacity, uint32_t ring_index) {
  LOOM_TRY(ring::check_ring_capacity(capacity));
  MappedRing r;
  r.capacity_ = capacity;
  r.ring_index_ = ring_index;
  const size_t bytes = ring::ring_shared_bytes(capacity);
  // Pinned and mapped: GPU stores go over PCIe straight into the proxy's memory. Write-combined
  // memory is avoided on purpose: the proxy reads every slot it consumes.
  LOOM_CUDA_TRY(cudaHostAlloc(&r.shared_host_, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(r.shared_host_, 0, bytes);
  LOOM_CUDA_TRY(cudaHostGetDevicePointer(&r.shared_device_, r.shared_host_, 0));
  LOOM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&r.producer_device_), sizeof(ring::RingProducerState)));
  LOOM_CUDA_TRY(cudaMemset(r.producer_device_, 0, sizeof(ring::RingProducerState)));
  LOOM_CUDA_TRY(cudaDeviceSynchronize());
  return r;
}

MappedRing& MappedRing::operator=(MappedRing&& other) noexcept {
  std::swap(shared_host_, other.shared_host_);
  std::swap(shared_device_, other.shared_device_);
  std::swap(producer_device_, other.producer_device_);
  std::swap(capacity_, other.capacity_);
  std::swap(ring_index_, other.ring_index_);
  return *this;
}

MappedRing::~MappedRing() {
  if (producer_device_ != nullptr) cudaFree(producer_device_);
  if (shared_host_ != nullptr) cudaFreeHost(shared_host_);
}

ring::RingView MappedRing::view_at(void* shared, ring::RingProducerState* producer) const {
  ring::RingView v{};
  v.tail = &static_cast<ring::RingControl*>(shared)->tail;
  v.slots = reinterpret_cast<ring::Command*>(static_cast<char*>(shared) + sizeof(ring::RingControl));
  v.producer = producer;
  v.capacity = capacity_;
  v.ring_index = ring_index_;
  return v;
}

ring::RingView MappedRing::device_view() const { return view_at(shared_device_, producer_device_); }

ring::RingView MappedRing::host_view() const { return view_at(shared_host_, nullptr); }

Result<int> export_dmabuf_fd(void* base, uint64_t bytes) {
  // Not in CudaDriver's table (runtime/cuda_driver.h): fetched here, once, at its 11.7 ABI.
  static const auto get_handle =
      optional_driver_entry<PFN_cuMemGetHandleForAddressRange_v11070>("cuMemGetHandleForAddressRange", 11070);
  if (get_handle == nullptr) return Status::unsupported("the CUDA driver has no cuMemGetHandleForAddressRange (dma-buf export)");
  const long page = ::sysconf(_SC_PAGESIZE);
  if (page > 0 && (reinterpret_cast<uint64_t>(base) % static_cast<uint64_t>(page) != 0 || bytes % static_cast<uint64_t>(page) != 0)) {
    return Status::invalid_argument("dma-buf export needs page-aligned ranges; got " + std::to_string(bytes) + " bytes at " +
                                    std::to_string(reinterpret_cast<uint64_t>(base)));
  }
  int fd = -1;
  const CUresult rc = get_handle(&fd, reinterpret_cast<CUdeviceptr>(base), bytes, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (rc != CUDA_SUCCESS) {
    return Status::unsupported("cuMemGetHandleForAddressRange(DMA_BUF_FD, " + std::to_string(bytes) +
                               " bytes) failed with CUresult " + std::to_string(static_cast<int>(rc)) +
                               " (dma-buf needs an open kernel module and a recent driver)");
  }
  return fd;
}

}  // namespace loom::runtime::net
