#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#include "runtime/topology.h"

namespace loom::runtime {
namespace {

std::vector<RankDescriptor> make_ranks(int hosts, int per_host, bool interleaved = false) {
  std::vector<RankDescriptor> ranks(hosts * per_host);
  for (int r = 0; r < hosts * per_host; ++r) {
    const int host = interleaved ? r % hosts : r / per_host;
    const int gpu = interleaved ? r / hosts : r % per_host;
    std::snprintf(ranks[r].host_id, sizeof(ranks[r].host_id), "host%d", host);
    std::snprintf(ranks[r].pci_bus_id, sizeof(ranks[r].pci_bus_id), "0000:%02x:00.0", gpu);
    ranks[r].device = gpu;
    ranks[r].sm_count = 132 - gpu;  // distinct so the minimum is observable
  }
  return ranks;
}

TEST(Topology, SingleHost) {
  auto ranks = make_ranks(1, 4);
  Result<Topology> t = build_topology(ranks, 2, 1);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(t->num_nodes, 1);
  EXPECT_EQ(t->local_world_size, 4);
  EXPECT_EQ(t->local_rank, 2);
  EXPECT_EQ(t->local_peers, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(t->min_sm_count, 129);
}

TEST(Topology, TwoHostsInterleavedRanks) {
  auto ranks = make_ranks(2, 3, /*interleaved=*/true);  // ranks 0,2,4 on host0; 1,3,5 on host1
  Result<Topology> t = build_topology(ranks, 3, 1);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(t->num_nodes, 2);
  EXPECT_EQ(t->node, 1);
  EXPECT_EQ(t->local_rank, 1);
  EXPECT_EQ(t->local_peers, (std::vector<int>{1, 3, 5}));
  EXPECT_TRUE(t->same_node(5));
  EXPECT_FALSE(t->same_node(0));
}

TEST(Topology, EmulatedNodesSplitAHost) {
  auto ranks = make_ranks(1, 8);
  Result<Topology> t = build_topology(ranks, 5, 2);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(t->num_nodes, 2);
  EXPECT_EQ(t->node, 1);
  EXPECT_EQ(t->local_rank, 1);
  EXPECT_EQ(t->local_world_size, 4);
  EXPECT_EQ(t->local_peers, (std::vector<int>{4, 5, 6, 7}));
}

TEST(Topology, LocalRankHintOrdersPeers) {
  auto ranks = make_ranks(1, 2);
  ranks[0].local_rank_hint = 1;
  ranks[1].local_rank_hint = 0;
  Result<Topology> t = build_topology(ranks, 0, 1);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->local_rank, 1);
  EXPECT_EQ(t->local_peers, (std::vector<int>{1, 0}));
}

TEST(Topology, RejectsBadLayouts) {
  auto two_on_one_gpu = make_ranks(1, 2);
  std::snprintf(two_on_one_gpu[1].pci_bus_id, sizeof(two_on_one_gpu[1].pci_bus_id), "%s",
                two_on_one_gpu[0].pci_bus_id);
  Result<Topology> a = build_topology(two_on_one_gpu, 0, 1);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("same GPU"), std::string::npos);

  auto uneven = make_ranks(2, 2);
  std::snprintf(uneven[1].host_id, sizeof(uneven[1].host_id), "host1");  // host0: 1 rank, host1: 3
  EXPECT_FALSE(build_topology(uneven, 0, 1).ok());

  auto three = make_ranks(1, 3);
  EXPECT_FALSE(build_topology(three, 0, 2).ok());  // 2 emulated nodes cannot split 3 ranks
  EXPECT_FALSE(build_topology(three, 3, 1).ok());  // rank outside world
}

// Ranks on `gpus` GPUs of one host, round-robin (rank r on GPU r % gpus, as pick_device assigns
// them in the shared-GPU mode), each with ranks_per_gpu = per_gpu.
std::vector<RankDescriptor> shared_gpu_ranks(int ranks, int gpus, int per_gpu) {
  std::vector<RankDescriptor> out(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    std::snprintf(out[r].host_id, sizeof(out[r].host_id), "host0");
    std::snprintf(out[r].pci_bus_id, sizeof(out[r].pci_bus_id), "0000:%02x:00.0", r % gpus);
    out[r].device = r % gpus;
    out[r].local_rank_hint = r;
    out[r].sm_count = 132;
    out[r].ranks_per_gpu = per_gpu;
  }
  return out;
}

TEST(TopologySharedGpu, OffRefusesTwoRanksOnOneGpuAsBefore) {
  const auto ranks = shared_gpu_ranks(2, 1, 1);
  Result<Topology> t = build_topology(ranks, 0, 1);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("ranks 0 and 1 use the same GPU 0000:00:00.0"), std::string::npos)
      << t.status().message();
  EXPECT_NE(t.status().message().find("LOOM_RANKS_PER_GPU"), std::string::npos) << "says how to ask for the mode";
}

TEST(TopologySharedGpu, OnAdmitsUpToTheSettingPerGpu) {
  for (int ranks : {2, 4, 8}) {
    const auto all = shared_gpu_ranks(ranks, 1, ranks);
    for (int me = 0; me < ranks; ++me) {
      Result<Topology> t = build_topology(all, me, 1);
      ASSERT_TRUE(t.ok()) << ranks << " ranks: " << t.status().to_string();
      EXPECT_EQ(t->local_world_size, ranks);
      EXPECT_EQ(t->local_rank, me);
      EXPECT_EQ(t->ranks_per_gpu, ranks);
      EXPECT_EQ(t->ranks_on_my_gpu, ranks);
    }
  }
  // Four ranks on two GPUs, two each: a setting of 2 is enough, 1 is not.
  const auto two_each = shared_gpu_ranks(4, 2, 2);
  Result<Topology> t = build_topology(two_each, 3, 1);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(t->ranks_on_my_gpu, 2);
  EXPECT_FALSE(build_topology(shared_gpu_ranks(4, 2, 1), 0, 1).ok());
}

TEST(TopologySharedGpu, MoreRanksOnAGpuThanTheSettingAreRefused) {
  const auto ranks = shared_gpu_ranks(4, 1, 2);
  Result<Topology> t = build_topology(ranks, 0, 1);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("4 ranks (0, 1, 2 and 3) use GPU 0000:00:00.0 but LOOM_RANKS_PER_GPU=2 allows 2"),
            std::string::npos)
      << t.status().message();
}

TEST(TopologySharedGpu, RanksMustAgreeOnTheSetting) {
  auto ranks = shared_gpu_ranks(2, 1, 2);
  ranks[1].ranks_per_gpu = 4;
  Result<Topology> t = build_topology(ranks, 0, 1);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("LOOM_RANKS_PER_GPU differs between ranks"), std::string::npos) << t.status().message();
  ranks[1].ranks_per_gpu = 0;
  EXPECT_FALSE(build_topology(ranks, 0, 1).ok());
}

// The layouts of the multi-node operators on one GPU: L = W / N GPUs per emulated node, every rank
// of a node on the same physical GPU, the network peers the same local index on the other nodes.
TEST(TopologySharedGpu, EmulatedNodesOnOneGpu) {
  struct Layout {
    int nodes, per_node;
  };
  for (const Layout& l : {Layout{2, 1}, Layout{2, 2}, Layout{2, 4}, Layout{4, 2}, Layout{4, 1}}) {
    const int world = l.nodes * l.per_node;
    const auto ranks = shared_gpu_ranks(world, 1, world);
    for (int me = 0; me < world; ++me) {
      Result<Topology> t = build_topology(ranks, me, l.nodes);
      ASSERT_TRUE(t.ok()) << l.nodes << "x" << l.per_node << ": " << t.status().to_string();
      EXPECT_EQ(t->num_nodes, l.nodes);
      EXPECT_EQ(t->local_world_size, l.per_node);
      EXPECT_EQ(t->node, me / l.per_node);
      EXPECT_EQ(t->local_rank, me % l.per_node);
      EXPECT_EQ(t->nodes_per_host, l.nodes);
      EXPECT_EQ(t->host_local_index(), me);
      std::vector<int> peers;
      for (int n = 0; n < l.nodes; ++n) {
        if (n != me / l.per_node) peers.push_back(n * l.per_node + me % l.per_node);
      }
      EXPECT_EQ(t->network_peers(), peers);
      for (int n = 0; n < l.nodes; ++n) {
        for (int j = 0; j < l.per_node; ++j) EXPECT_EQ(t->rank_of(n, j), n * l.per_node + j);
      }
    }
  }
}

}  // namespace
}  // namespace loom::runtime
