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

  bool same_node(int other_rank) const { return node_of_rank[other_rank] == node; }
};

// Groups ranks by host id (and, with emulate_nodes = n > 1, splits each host's ranks into n
// virtual nodes of equal size). Fails with invalid_argument if two ranks claim one GPU, if
// hosts hold different rank counts, or if emulate_nodes does not divide a host's ranks.
Result<Topology> build_topology(std::span<const RankDescriptor> ranks, int my_rank, int emulate_nodes);

}  // namespace loom::runtime
