// copy_engine: the Transport between GPUs of one host (emulated nodes, or a fallback).
//
// A write is a cudaMemcpyAsync from this rank's registered device memory into a peer's device
// memory mapped in this process, on one proxy-owned stream; a flag is an 8-byte copy from a
// pinned staging word into the peer's flag window on the same stream, so it starts only after
// every earlier copy has finished (ordered transport). Each operation records an event; poll()
// reports operations whose events have completed, in stream order.
//
// A write between two buffers of one GPU (ranks sharing a GPU in the shared-GPU mode) goes
// device -> pinned host -> device in 4 MiB pieces: the driver runs a same-GPU copy as a kernel on
// the SMs, and a persistent loom kernel of this process that waits for the copy holds them all.
//
// Peer memory is reached in one of two ways: through `map_peer` (a mapping this process already
// has, e.g. the symmetric heap's peer_base), or by a legacy CUDA IPC handle carried in the
// registration's key (cudaMalloc memory; cudaIpcOpenMemHandle on import, closed on close()).
//
// NIC emulation (LOOM_EMULATE_NET_GBPS, LOOM_EMULATE_NET_LAT_US): operations wait in a FIFO
// until LinkShaper says the emulated link may start them, so one machine behaves like nodes
// joined by a slower network. Flags are paced too (8 bytes each), and keep their place in order.
//
// Needs a GPU to run; tests/gpu/proxy_copy_engine_test.cu exercises it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "loom/status.h"
#include "runtime/transports/transport.h"

namespace loom::runtime::net {

struct CopyEngineOptions {
  int device = 0;                     // this rank's CUDA device (the proxy thread selects it)
  double emulate_gbps = 0;            // 0: no rate limit
  double emulate_latency_us = 0;      // 0: no added latency
  uint32_t queue_depth = 256;         // operations in flight (events and staging words)
  // A local device pointer to `bytes` of rank `rank`'s memory that starts at `owner_address` in
  // the owner's address space, or nullptr when this process has no such mapping (then IPC).
  std::function<void*(int rank, uint64_t owner_address, uint64_t bytes)> map_peer;
};

Result<std::unique_ptr<Transport>> create_copy_engine_transport(const TransportConfig& config,
                                                                const CopyEngineOptions& options);

}  // namespace loom::runtime::net
