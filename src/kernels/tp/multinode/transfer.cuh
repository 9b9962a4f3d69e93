// Raw network exchange through the proxy: one small persistent kernel (one CTA per rank, thread 0
// works). Every rank writes `bytes` of its heap at src_offset to the same-index GPU of every other
// node (direct), into that rank's receive area at dst_offset, which holds N - 1 slots of `bytes`:
// slot Grid::slot(s, n, N) receives node s's bytes. Chunks of chunk_bytes, one command and one
// flag each; the launch ends when this rank has received every chunk of every other node.
//
// What it is for: the "same shaped transfer" of loom-bench multinode's sequential baseline (GEMM,
// then this), and a plain check of the network path through the communicator.
//
// Flags (network window, from launch_base): recv[k][c] = base + k * chunks + c, k = the slot.
#pragma once

#include <cstdint>

#include "kernels/comm/net.cuh"
#include "kernels/tp/multinode/frame.cuh"
#include "kernels/tp/multinode/layout.h"

namespace loom::kernels::tp::multinode {

struct TransferParams {
  DeviceComm comm;
  LaunchState* state;
  uint64_t src_offset;   // heap offset of the bytes this rank sends
  uint64_t dst_offset;   // heap offset of the receive area ((N - 1) * bytes)
  uint64_t bytes;
  uint64_t chunk_bytes;  // > 0
  uint32_t flag_base;
  uint32_t signature;
};

__host__ __device__ inline uint64_t transfer_chunks(uint64_t bytes, uint64_t chunk_bytes) {
  return (bytes + chunk_bytes - 1) / chunk_bytes;
}

__device__ __forceinline__ bool transfer_body(const TransferParams& p, const WaitContext& ctx) {
  const DeviceComm& c = p.comm;
  Grid g;
  g.nodes = static_cast<uint32_t>(c.net.num_nodes);
  g.local = static_cast<uint32_t>(c.local_world);
  g.node = static_cast<uint32_t>(c.net.node);
  g.me = static_cast<uint32_t>(c.local_rank);
  const uint32_t chunks = static_cast<uint32_t>(transfer_chunks(p.bytes, p.chunk_bytes));
  if (!announce_network_entry(c, EntryPeers::kAll, p.signature, ctx)) return false;
  uint32_t lane = 0;
  for (uint32_t o = 1; o < g.nodes; ++o) {
    const uint32_t dst_node = (g.node + o) % g.nodes;
    if (!wait_network_entry(c, static_cast<int>(dst_node), p.signature, ctx)) return false;
    const uint32_t k = Grid::slot(g.node, dst_node, g.nodes);  // our slot at the destination
    for (uint32_t chunk = 0; chunk < chunks; ++chunk) {
      const uint64_t at = static_cast<uint64_t>(chunk) * p.chunk_bytes;
      const uint64_t size = p.bytes - at < p.chunk_bytes ? p.bytes - at : p.chunk_bytes;
      if (!net_put(c, lane++, net_rank_of(c, static_cast<int>(dst_node), c.local_rank), p.src_offset + at,
                   p.dst_offset + k * p.bytes + at, size, p.flag_base + k * chunks + chunk, ctx)) {
        return false;
      }
    }
  }
  for (uint32_t o = 1; o < g.nodes; ++o) {
    const uint32_t src_node = (g.node + g.nodes - o) % g.nodes;
    const uint32_t k = Grid::slot(src_node, g.node, g.nodes);
    const int src_rank = net_rank_of(c, static_cast<int>(src_node), c.local_rank);
    for (uint32_t chunk = 0; chunk < chunks; ++chunk) {
      if (!net_wait(c, p.flag_base + k * chunks + chunk, src_rank, ctx)) return false;
    }
  }
  return net_wait_proxy_done(c, ctx);  // the source may be overwritten after the launch
}

__global__ void transfer_kernel(const __grid_constant__ TransferParams p) {
  const DeviceComm& c = p.comm;
  const frame::LaunchFrame f = frame::LaunchFrame::begin(c, OpId::kNetExchange);
  if (threadIdx.x == 0) (void)transfer_body(p, f.ctx);
  f.finish(p.state, c);
}

}  // namespace loom::kernels::tp::multinode
