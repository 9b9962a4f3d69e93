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

}  // namespace
}  // namespace loom::runtime
