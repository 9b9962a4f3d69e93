// Topology: which ranks share a node (and so an NVLink domain), in runtime data only.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "loom/status.h"

namespace loom::runtime {

class Bootstrap;

// What each rank tells the others about itself at init (fixed size: exchanged raw).
struct RankDescriptor {
  char host_id[64];    // hostname + boot id: equal on ranks of one machine
  char pci_bus_id[32];  // of the rank's GPU, "0000:18:00.0"
  int32_t device = -1;  // CUDA ordinal in the rank's own process
  int32_t local_rank_hint = -1;  // LOCAL_RANK if the launcher set it, else -1
  int32_t sm_count = 0;
  int32_t pid = 0;
  int32_t ranks_per_gpu = 1;  // LOOM_RANKS_PER_GPU of the rank (must be equal on every rank)
};

struct Topology {
  int rank = 0;
  int world_size = 1;
  int node = 0;            // index of this rank's (possibly emulated) node
  int num_nodes = 1;
  int local_rank = 0;      // index within the node
  int local_world_size = 1;
  std::vector<int> node_of_rank;        // [world_size]
  std::vector<int> local_rank_of_rank;  // [world_size]
  std::vector<int> local_peers;         // global ranks of this node, by local rank
  int min_sm_count = 0;                 // smallest SM count over the node's GPUs
  // Shared-GPU mode (LOOM_RANKS_PER_GPU = n > 1): up to n ranks of a host may use one GPU.
  // ranks_on_my_gpu counts the ranks (this one included) on this rank's GPU.
  int ranks_per_gpu = 1;
  int ranks_on_my_gpu = 1;
  // Nodes are consecutive within a physical host: node n runs on host n / nodes_per_host (the
  // emulated node count, 1 without emulation).
  int nodes_per_host = 1;
  // rank_at[n * local_world_size + l]: global rank of the GPU with local index l on node n.
  std::vector<int> rank_at;

  bool same_node(int other_rank) const { return node_of_rank[other_rank] == node; }
  int host_of_node(int n) const { return n / nodes_per_host; }
  int rank_of(int n, int l) const { return rank_at[static_cast<size_t>(n) * local_world_size + l]; }
  // The GPUs this rank talks to over the network: the same local index on every other node
  // (hierarchical rule: data crossing nodes goes between same-index GPUs only), by node.
  std::vector<int> network_peers() const {
    std::vector<int> peers;
    for (int n = 0; n < num_nodes; ++n) {
      if (n != node) peers.push_back(rank_of(n, local_rank));
    }
    return peers;
  }
  // Index of this rank among the ranks of its physical host (0 .. nodes_per_host * L - 1).
  int host_local_index() const { return (node % nodes_per_host) * local_world_size + local_rank; }
};

// Groups ranks by host id (and, with emulate_nodes = n > 1, splits each host's ranks into n
// virtual nodes of equal size). Fails with invalid_argument if more ranks claim one GPU than
// their ranks_per_gpu allows (two, unless the shared-GPU mode is on), if the ranks disagree on
// ranks_per_gpu, if hosts hold different rank counts, or if emulate_nodes does not divide a
// host's ranks.
Result<Topology> build_topology(std::span<const RankDescriptor> ranks, int my_rank, int emulate_nodes);

}  // namespace loom::runtime
