#include "runtime/topology.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>

namespace loom::runtime {

Result<Topology> build_topology(std::span<const RankDescriptor> ranks, int my_rank, int emulate_nodes) {
  const int world = static_cast<int>(ranks.size());
  if (world <= 0 || my_rank < 0 || my_rank >= world) {
    return Status::invalid_argument("topology: rank " + std::to_string(my_rank) + " outside world of " +
                                    std::to_string(world));
  }
  if (emulate_nodes < 1) return Status::invalid_argument("topology: emulated node count must be >= 1");
  const int per_gpu = ranks[0].ranks_per_gpu;
  for (int r = 0; r < world; ++r) {
    if (ranks[r].ranks_per_gpu < 1) {
      return Status::invalid_argument("topology: rank " + std::to_string(r) + " has ranks_per_gpu " +
                                      std::to_string(ranks[r].ranks_per_gpu) + " (must be >= 1)");
    }
    if (ranks[r].ranks_per_gpu != per_gpu) {
      return Status::invalid_argument("topology: LOOM_RANKS_PER_GPU differs between ranks: rank 0 has " +
                                      std::to_string(per_gpu) + ", rank " + std::to_string(r) + " has " +
                                      std::to_string(ranks[r].ranks_per_gpu) + "; every rank must use the same setting");
    }
  }

  // Hosts in order of their lowest rank, so node ids are equal on every rank.
  std::map<std::string, std::vector<int>> ranks_of_host;
  std::vector<std::string> host_order;
  for (int r = 0; r < world; ++r) {
    std::string host(ranks[r].host_id, strnlen(ranks[r].host_id, sizeof(ranks[r].host_id)));
    auto [it, inserted] = ranks_of_host.try_emplace(host);
    if (inserted) host_order.push_back(host);
    it->second.push_back(r);
  }

  const size_t per_host = ranks_of_host.begin()->second.size();
  for (const auto& [host, members] : ranks_of_host) {
    if (members.size() != per_host) {
      return Status::invalid_argument("topology: host '" + host + "' runs " + std::to_string(members.size()) +
                                      " ranks but another runs " + std::to_string(per_host) +
                                      "; every node must run the same number of ranks");
    }
    // Ranks per GPU: two ranks on one GPU would deadlock NVLink protocols that expect their peers
    // to run at the same moment (NCCL refuses them too); loom's kernels make progress on a
    // time-sliced GPU, so the shared-GPU mode admits up to ranks_per_gpu ranks per GPU.
    std::map<std::string, std::vector<int>> ranks_of_gpu;
    for (int r : members) {
      if (ranks[r].pci_bus_id[0] == '\0') continue;
      ranks_of_gpu[std::string(ranks[r].pci_bus_id, strnlen(ranks[r].pci_bus_id, sizeof(ranks[r].pci_bus_id)))].push_back(r);
    }
    for (const auto& [bus, users] : ranks_of_gpu) {
      if (users.size() <= static_cast<size_t>(per_gpu)) continue;
      std::string list;
      for (size_t i = 0; i < users.size(); ++i) list += (i == 0 ? "" : i + 1 == users.size() ? " and " : ", ") + std::to_string(users[i]);
      if (per_gpu == 1) {
        return Status::invalid_argument("topology: ranks " + list + " use the same GPU " + bus +
                                        "; one rank per GPU, unless LOOM_RANKS_PER_GPU=n (loom-run --ranks-per-gpu n) "
                                        "asks for the shared-GPU mode, a correctness mode that measures no speed");
      }
      return Status::invalid_argument("topology: " + std::to_string(users.size()) + " ranks (" + list + ") use GPU " + bus +
                                      " but LOOM_RANKS_PER_GPU=" + std::to_string(per_gpu) + " allows " +
                                      std::to_string(per_gpu));
    }
  }
  if (per_host % static_cast<size_t>(emulate_nodes) != 0) {
    return Status::invalid_argument("topology: LOOM_EMULATE_NODES=" + std::to_string(emulate_nodes) +
                                    " does not divide the " + std::to_string(per_host) + " ranks of a host");
  }

  Topology t;
  t.rank = my_rank;
  t.world_size = world;
  t.node_of_rank.assign(world, 0);
  t.local_rank_of_rank.assign(world, 0);
  const int per_node = static_cast<int>(per_host) / emulate_nodes;
  t.num_nodes = static_cast<int>(host_order.size()) * emulate_nodes;
  for (size_t h = 0; h < host_order.size(); ++h) {
    std::vector<int> members = ranks_of_host[host_order[h]];
    // Within a host, order by the launcher's LOCAL_RANK when every rank has one, else by rank.
    const bool hinted = std::all_of(members.begin(), members.end(), [&](int r) { return ranks[r].local_rank_hint >= 0; });
    if (hinted) {
      std::stable_sort(members.begin(), members.end(),
                       [&](int a, int b) { return ranks[a].local_rank_hint < ranks[b].local_rank_hint; });
    }
    for (size_t i = 0; i < members.size(); ++i) {
      const int r = members[i];
      t.node_of_rank[r] = static_cast<int>(h) * emulate_nodes + static_cast<int>(i) / per_node;
      t.local_rank_of_rank[r] = static_cast<int>(i) % per_node;
    }
  }
  t.nodes_per_host = emulate_nodes;
  t.rank_at.assign(static_cast<size_t>(t.num_nodes) * per_node, -1);
  for (int r = 0; r < world; ++r) t.rank_at[static_cast<size_t>(t.node_of_rank[r]) * per_node + t.local_rank_of_rank[r]] = r;
  t.node = t.node_of_rank[my_rank];
  t.local_rank = t.local_rank_of_rank[my_rank];
  t.local_world_size = per_node;
  t.local_peers.assign(per_node, -1);
  t.min_sm_count = 0;
  t.ranks_per_gpu = per_gpu;
  t.ranks_on_my_gpu = 0;
  const std::string my_host(ranks[my_rank].host_id, strnlen(ranks[my_rank].host_id, sizeof(ranks[my_rank].host_id)));
  for (int r = 0; r < world; ++r) {
    const bool same_host = std::string(ranks[r].host_id, strnlen(ranks[r].host_id, sizeof(ranks[r].host_id))) == my_host;
    const bool same_gpu = ranks[r].pci_bus_id[0] != '\0' &&
                          std::strncmp(ranks[r].pci_bus_id, ranks[my_rank].pci_bus_id, sizeof(ranks[r].pci_bus_id)) == 0;
    if (r == my_rank || (same_host && same_gpu)) ++t.ranks_on_my_gpu;
  }
  for (int r = 0; r < world; ++r) {
    if (t.node_of_rank[r] != t.node) continue;
    t.local_peers[t.local_rank_of_rank[r]] = r;
    if (t.min_sm_count == 0 || ranks[r].sm_count < t.min_sm_count) t.min_sm_count = ranks[r].sm_count;
  }
  return t;
}

}  // namespace loom::runtime
