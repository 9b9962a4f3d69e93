// CUDA-side memory of the network path (libloom only: needs the CUDA runtime).
//
//   MappedRing       a command ring whose shared block (tail + slots) is host-pinned and mapped
//                    into the device, and whose producer block (head, tail cache) is device
//                    memory: kernels push through device_view(), the proxy consumes host_view().
//   export_dmabuf_fd a dma-buf file descriptor for a range of device memory
//                    (cuMemGetHandleForAddressRange), for VerbsOptions::export_dmabuf.
#pragma once

#include <cstdint>

#include "loom/status.h"
#include "runtime/command_ring.h"

namespace loom::runtime::net {

class MappedRing {
 public:
  // Allocates on the current CUDA device. capacity: a power of two (check_ring_capacity).
  static Result<MappedRing> create(uint32_t capacity, uint32_t ring_index = 0);
  MappedRing() = default;
  MappedRing(MappedRing&& other) noexcept { *this = std::move(other); }
  MappedRing& operator=(MappedRing&& other) noexcept;
  MappedRing(const MappedRing&) = delete;
  MappedRing& operator=(const MappedRing&) = delete;
  ~MappedRing();  // frees; no kernel or proxy may use the ring any more

  ring::RingView device_view() const;  // for kernels: device aliases + device producer state
  ring::RingView host_view() const;    // for the proxy: host addresses, no producer state

 private:
  // The ring control block and its slots at `shared` (either address of the mapped allocation).
  ring::RingView view_at(void* shared, ring::RingProducerState* producer) const;

  void* shared_host_ = nullptr;    // cudaHostAlloc(mapped)
  void* shared_device_ = nullptr;  // its device alias
  ring::RingProducerState* producer_device_ = nullptr;  // cudaMalloc
  uint32_t capacity_ = 0;
  uint32_t ring_index_ = 0;
};

// A dma-buf fd for [base, base + bytes) of device memory; base and bytes must be aligned to the
// host page size. The caller closes the fd. unsupported when the driver cannot export.
Result<int> export_dmabuf_fd(void* base, uint64_t bytes);

}  // namespace loom::runtime::net
