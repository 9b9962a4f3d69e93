// Host logic of the multi-node path: topology with emulated nodes, the network window layout, and
// the index math the multi-node kernels and launchers share (kernels/tp/multinode/layout.h):
// orders are permutations, flags of one launch never collide, what a sender writes is what its
// receiver reads, the ring delivers every block once, and the gemm_rs/gemm_ar tile order cannot
// deadlock (a simulation of W GPUs whose fold tiles block until their sources exist).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/tp/multinode/layout.h"
#include "runtime/network_layout.h"
#include "runtime/topology.h"

namespace loom {
namespace {

using kernels::tp::multinode::AgLayout;
using kernels::tp::multinode::Grid;
using kernels::tp::multinode::kBlockM;
using kernels::tp::multinode::raster_ramped;
using kernels::tp::multinode::ReduceLayout;
using kernels::tp::multinode::rows_per_chunk_for;
using runtime::net::NetWindowLayout;

std::vector<runtime::RankDescriptor> ranks_on_hosts(int hosts, int per_host) {
  std::vector<runtime::RankDescriptor> ranks(static_cast<size_t>(hosts * per_host));
  for (int r = 0; r < hosts * per_host; ++r) {
    std::snprintf(ranks[r].host_id, sizeof(ranks[r].host_id), "host%d", r / per_host);
    std::snprintf(ranks[r].pci_bus_id, sizeof(ranks[r].pci_bus_id), "0000:%02x:00.0", r % per_host);
    ranks[r].sm_count = 132;
  }
  return ranks;
}

TEST(MultiNodeTopology, EmulatedNodesGiveTheGridOfRanks) {
  const auto ranks = ranks_on_hosts(1, 8);
  for (int emulate : {2, 4, 8}) {
    const int per_node = 8 / emulate;
    for (int me = 0; me < 8; ++me) {
      Result<runtime::Topology> t = runtime::build_topology(ranks, me, emulate);
      ASSERT_TRUE(t.ok()) << t.status().to_string();
      EXPECT_EQ(t->num_nodes, emulate);
      EXPECT_EQ(t->nodes_per_host, emulate);
      EXPECT_EQ(t->local_world_size, per_node);
      EXPECT_EQ(t->node, me / per_node);
      EXPECT_EQ(t->local_rank, me % per_node);
      ASSERT_EQ(t->rank_at.size(), 8u);
      for (int n = 0; n < emulate; ++n) {
        for (int l = 0; l < per_node; ++l) EXPECT_EQ(t->rank_of(n, l), n * per_node + l);
      }
      // Network peers: the same local index on every other node, in node order.
      std::vector<int> want;
      for (int n = 0; n < emulate; ++n) {
        if (n != me / per_node) want.push_back(n * per_node + me % per_node);
      }
      EXPECT_EQ(t->network_peers(), want);
      EXPECT_EQ(t->host_of_node(t->node), 0);
      EXPECT_EQ(t->host_local_index(), me);
    }
  }
}

TEST(MultiNodeTopology, TwoHostsEachSplitInTwo) {
  const auto ranks = ranks_on_hosts(2, 4);
  Result<runtime::Topology> t = runtime::build_topology(ranks, 6, 2);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(t->num_nodes, 4);
  EXPECT_EQ(t->node, 3);
  EXPECT_EQ(t->local_rank, 0);
  EXPECT_EQ(t->local_world_size, 2);
  EXPECT_EQ(t->host_of_node(3), 1);
  EXPECT_EQ(t->host_of_node(1), 0);
  EXPECT_EQ(t->host_local_index(), 2);  // second virtual node of host 1, local rank 0
  EXPECT_EQ(t->network_peers(), (std::vector<int>{0, 2, 4}));
  Result<runtime::Topology> one = runtime::build_topology(ranks, 6, 1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->num_nodes, 2);
  EXPECT_EQ(one->nodes_per_host, 1);
  EXPECT_EQ(one->network_peers(), (std::vector<int>{2}));
}

TEST(MultiNodeTopology, EmulationMustDivideTheHost) {
  const auto ranks = ranks_on_hosts(1, 6);
  EXPECT_EQ(runtime::build_topology(ranks, 0, 4).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(runtime::build_topology(ranks, 0, 3).ok());
}

TEST(NetWindow, EntryWordsAndLaunchFlagsDoNotOverlap) {
  for (uint32_t nodes : {2u, 3u, 4u, 16u, 64u}) {
    for (uint32_t local : {1u, 2u, 4u, 8u}) {
      const NetWindowLayout w{nodes, local};
      std::set<uint32_t> used;
      for (uint32_t l = 0; l < local; ++l) EXPECT_TRUE(used.insert(w.nvl_entry(l)).second);
      for (uint32_t n = 0; n < nodes; ++n) {
        EXPECT_TRUE(used.insert(w.net_entry(n)).second);
        EXPECT_TRUE(used.insert(w.net_sig(n)).second);
      }
      EXPECT_TRUE(used.insert(w.sig_out()).second);
      EXPECT_GT(w.launch_base(), *used.rbegin());
      EXPECT_EQ(w.launch_base() % 8, 0u) << "launch flags start on a 64-byte line";
      EXPECT_EQ(w.launch_base() + w.launch_capacity(), runtime::net::kNetFlagWords);
    }
  }
  EXPECT_GE(runtime::net::net_window_bytes(), 8ull * runtime::net::kNetFlagWords);
  EXPECT_EQ(runtime::net::net_window_bytes() % 65536, 0u);
  EXPECT_EQ(entry_word(5, 0x1234abcd) >> kEntrySignatureBits, 5u);
  EXPECT_EQ(entry_word(5, 0x1234abcd) & kEntrySignatureMask, 0x1234abcdu) << "the signature keeps all 32 bits";
}

// What a sender may write through the proxy into a destination's window (its scope, reliability
// S5): its own entry and signature words and the launch flags; never a local entry word, another
// node's entry words, the destination's sig_out, and the window sits in the heap's prefix, below
// every allocation (the data window).
TEST(NetWindow, ASendersWordsAreItsOwnEntryWordsAndTheLaunchFlags) {
  for (uint32_t nodes : {2u, 3u, 8u}) {
    for (uint32_t local : {1u, 2u, 8u}) {
      const NetWindowLayout w{nodes, local};
      for (uint32_t sender = 0; sender < nodes; ++sender) {
        std::set<uint32_t> others;
        for (uint32_t l = 0; l < local; ++l) others.insert(w.nvl_entry(l));
        for (uint32_t n = 0; n < nodes; ++n) {
          if (n == sender) continue;
          others.insert(w.net_entry(n));
          others.insert(w.net_sig(n));
        }
        others.insert(w.sig_out());
        EXPECT_EQ(others.count(w.sender_entry(sender)), 0u);
        EXPECT_EQ(others.count(w.sender_sig(sender)), 0u);
        EXPECT_GT(w.launch_base(), *others.rbegin()) << "every protected word lies below the launch flags";
        EXPECT_EQ(w.sender_entry(sender), w.net_entry(sender));
        EXPECT_EQ(w.sender_sig(sender), w.net_sig(sender));
      }
    }
  }
  for (uint64_t control : {4096ull, 65536ull, 70000ull}) {
    const uint64_t at = runtime::net::net_window_offset(control);
    EXPECT_GE(at, control) << "after the control region";
    EXPECT_EQ(at % 65536, 0u);
    EXPECT_LT(at - control, 65536u);
  }
}

TEST(MultiNodeLayout, RowsPerChunkAreWholeTileRowsDividingTheBlock) {
  for (uint32_t rows : {128u, 256u, 384u, 1024u, 1920u, 8192u, 16384u}) {
    for (uint64_t row_bytes : {16ull, 1000ull, 2048ull, 16384ull, 28672ull, 1ull << 20}) {
      const uint32_t rpc = rows_per_chunk_for(rows, row_bytes, uint64_t{1} << 20);
      EXPECT_EQ(rpc % kBlockM, 0u);
      EXPECT_GE(rpc, kBlockM);
      EXPECT_EQ(rows % rpc, 0u) << rows << " rows, " << row_bytes << " B";
      if (rpc > kBlockM) {
        EXPECT_LE(rpc * row_bytes, uint64_t{1} << 20);
      }
    }
  }
  EXPECT_EQ(rows_per_chunk_for(8192, 16384, uint64_t{1} << 20), 128u);  // issue 4's ag_gemm: K = 8192 bf16
  EXPECT_EQ(rows_per_chunk_for(1024, 1024, uint64_t{1} << 20), 1024u);
}

std::vector<Grid> grids() {
  std::vector<Grid> out;
  for (uint32_t nodes : {2u, 3u, 4u, 5u}) {
    for (uint32_t local : {1u, 2u, 3u, 4u, 8u}) {
      for (uint32_t n = 0; n < nodes; ++n) {
        for (uint32_t l = 0; l < local; ++l) out.push_back(Grid{nodes, local, n, l});
      }
    }
  }
  return out;
}

std::string text(const Grid& g) {
  return std::to_string(g.nodes) + "x" + std::to_string(g.local) + " rank (" + std::to_string(g.node) + "," + std::to_string(g.me) + ")";
}

TEST(MultiNodeLayout, SlotsAgreeBetweenSenderAndReceiver) {
  for (uint32_t count : {2u, 3u, 8u}) {
    for (uint32_t owner = 0; owner < count; ++owner) {
      std::set<uint32_t> seen;
      for (uint32_t src = 0; src < count; ++src) {
        if (src == owner) continue;
        const uint32_t s = Grid::slot(src, owner, count);
        EXPECT_LT(s, count - 1);
        EXPECT_TRUE(seen.insert(s).second) << "two sources share a slot";
      }
    }
  }
}

TEST(AgLayout, ComputeOrderIsAPermutationStartingWithTheOwnBlock) {
  for (const Grid& g : grids()) {
    AgLayout L{g, 1024, 256, 40};
    std::set<uint32_t> blocks;
    for (uint32_t i = 0; i < g.world(); ++i) blocks.insert(L.block_at(i));
    EXPECT_EQ(blocks.size(), g.world()) << text(g);
    EXPECT_EQ(*blocks.rbegin(), g.world() - 1);
    EXPECT_EQ(L.block_at(0), g.own_block());
    std::set<uint32_t> flags;
    for (uint32_t d = 0; d < g.world(); ++d) {
      for (uint32_t c = 0; c < L.chunks_per_block(); ++c) {
        const uint32_t f = L.row_flag(d, c);
        EXPECT_GE(f, 40u);
        EXPECT_LT(f, 40u + L.flags());
        EXPECT_TRUE(flags.insert(f).second);
      }
    }
  }
}

// Every node's sends, played out: a forward of block b (hop h >= 1) only after b arrived from the
// predecessor, every node receives every other node's same-index block exactly once, and every
// GPU sends N - 1 blocks to one destination (no fan-out).
TEST(AgLayout, RingDeliversEveryBlockOnceWithoutFanOut) {
  for (uint32_t nodes : {2u, 3u, 4u, 7u}) {
    for (uint32_t local : {1u, 2u, 3u, 4u, 8u}) {
      for (uint32_t l = 0; l < local; ++l) {
        std::vector<AgLayout> layouts;
        for (uint32_t n = 0; n < nodes; ++n) layouts.push_back(AgLayout{Grid{nodes, local, n, l}, 512, 128, 0});
        const uint32_t cpb = layouts[0].chunks_per_block();
        std::vector<std::map<std::pair<uint32_t, uint32_t>, int>> received(nodes);  // node -> (block, chunk) -> count
        std::vector<uint32_t> cursor(nodes, 0);
        bool progress = true;
        while (progress) {
          progress = false;
          for (uint32_t n = 0; n < nodes; ++n) {
            const AgLayout& L = layouts[n];
            EXPECT_EQ(L.sends(), (nodes - 1) * cpb);
            if (cursor[n] >= L.sends()) continue;
            const uint32_t k = cursor[n];
            const uint32_t d = L.send_block(k);
            const uint32_t c = k % cpb;
            if (L.send_hop(k) > 0 && received[n].count({d, c}) == 0) continue;  // not arrived yet
            EXPECT_EQ(L.g.node_of(d), L.g.node_behind(L.send_hop(k)));
            EXPECT_EQ(L.g.local_of(d), l);
            ++received[L.g.successor()][{d, c}];
            ++cursor[n];
            progress = true;
          }
        }
        for (uint32_t n = 0; n < nodes; ++n) {
          EXPECT_EQ(cursor[n], layouts[n].sends()) << nodes << " nodes: node " << n << " stalled";
          EXPECT_EQ(received[n].size(), static_cast<size_t>((nodes - 1) * cpb));
          for (const auto& [key, count] : received[n]) {
            EXPECT_EQ(count, 1);
            EXPECT_NE(layouts[n].g.node_of(key.first), n) << "a node received its own block";
          }
          // The replication role of node n waits for exactly these chunks.
          std::set<std::pair<uint32_t, uint32_t>> replicated;
          for (uint32_t k = 0; k < layouts[n].replications(); ++k) {
            replicated.insert({layouts[n].replication_block(k), k % cpb});
          }
          if (local > 1) {
            EXPECT_EQ(replicated.size(), received[n].size());
          }
        }
      }
    }
  }
}

ReduceLayout reduce_layout(const Grid& g, bool all_reduce, uint32_t rows = 512, uint32_t n_blocks = 3, uint32_t rpc = 256) {
  ReduceLayout L;
  L.g = g;
  L.rows_per_block = rows;
  L.n_blocks = n_blocks;
  L.rows_per_chunk = rpc;
  L.flag_base = 24;
  L.all_reduce = all_reduce ? 1 : 0;
  return L;
}

TEST(ReduceLayout, FlagsOfOneLaunchNeverCollide) {
  for (const Grid& g : grids()) {
    for (bool ar : {false, true}) {
      const ReduceLayout L = reduce_layout(g, ar);
      std::set<uint32_t> used;
      auto take = [&](uint32_t f, const char* what) {
        EXPECT_GE(f, L.flag_base) << what;
        EXPECT_LT(f, L.flag_base + L.flags()) << what << " " << text(g);
        EXPECT_TRUE(used.insert(f).second) << what << " collides, " << text(g);
      };
      for (uint32_t j = 0; j + 1 < g.local; ++j) {
        for (uint32_t n = 0; n < g.nodes; ++n) {
          for (uint32_t t = 0; t < L.tiles_per_block(); ++t) take(L.partial_flag(j, n, t), "partial");
        }
      }
      for (uint32_t k = 0; k + 1 < g.nodes; ++k) {
        for (uint32_t c = 0; c < L.chunks_per_block(); ++c) take(L.net_partial_flag(k, c), "net partial");
      }
      if (ar) {
        for (uint32_t q = 0; q < g.local; ++q) {
          for (uint32_t t = 0; t < L.tiles_per_block(); ++t) take(L.final_flag(q, t), "final");
        }
        for (uint32_t d = 0; d < g.world(); ++d) {
          for (uint32_t c = 0; c < L.chunks_per_block(); ++c) take(L.present_flag(d, c), "present");
        }
      }
      for (uint32_t m = 0; m < g.world() * L.m_blocks_per_block(); ++m) {
        for (uint32_t nb = 0; nb < L.n_blocks; ++nb) take(L.done_flag(m, nb), "done");
      }
      EXPECT_EQ(used.size(), L.flags()) << "flags() counts exactly the words used";
    }
  }
}

TEST(ReduceLayout, FoldSourcesReadWhatTheSendersWrote) {
  for (const Grid& g : grids()) {
    const ReduceLayout L = reduce_layout(g, false);
    const uint32_t R = L.rows_per_block;
    std::set<uint32_t> order;
    for (uint32_t i = 0; i < g.world(); ++i) order.insert(L.block_at(i));
    EXPECT_EQ(order.size(), g.world()) << text(g);
    EXPECT_EQ(L.block_at(g.world() - 1), g.own_block()) << "the own block comes last";
    for (uint32_t d = 0; d < g.world(); ++d) {
      if (L.tile_role(d) != ReduceLayout::TileRole::kFold) continue;
      EXPECT_EQ(g.local_of(d), g.me);
      std::set<uint32_t> starts;
      for (uint32_t v = 0; v < L.fold_sources(); ++v) {
        if (v == g.me) continue;
        const uint32_t row = L.fold_source_row(d, 128, v);
        EXPECT_LE(row + kBlockM, L.fold_rows()) << text(g);
        const bool zeros = v >= g.local && g.node_of(d) != g.node;
        if (zeros) {
          EXPECT_EQ(row, L.zero_row());
          continue;
        }
        EXPECT_TRUE(starts.insert(row).second) << "two sources read the same rows";
        if (v < g.local) {
          // Local GPU v, as a sender, stores its partial of block d here (the epilogue's routing).
          const Grid sender{g.nodes, g.local, g.node, v};
          const ReduceLayout S = reduce_layout(sender, false);
          EXPECT_EQ(S.local_slot_row(Grid::slot(v, g.me, g.local), g.node_of(d)) + 128, row);
        } else {
          // Node fold_source_node(v)'s same-index GPU sends its node partial of block d here.
          const uint32_t src = L.fold_source_node(v);
          EXPECT_NE(src, g.node);
          EXPECT_EQ(L.net_slot_row(Grid::slot(src, g.node, g.nodes)) + 128, row);
          EXPECT_LT(row, L.zero_row());
        }
      }
    }
    // The node sources of one fold are the other nodes, each once, in increasing order.
    std::vector<uint32_t> nodes;
    for (uint32_t v = g.local; v < L.fold_sources(); ++v) nodes.push_back(L.fold_source_node(v));
    std::vector<uint32_t> want;
    for (uint32_t n = 0; n < g.nodes; ++n) {
      if (n != g.node) want.push_back(n);
    }
    EXPECT_EQ(nodes, want);
    // Send buffer: one slot of R rows per other node.
    std::set<uint32_t> sends;
    for (uint32_t n = 0; n < g.nodes; ++n) {
      if (n == g.node) continue;
      EXPECT_TRUE(sends.insert(L.send_row(n)).second);
      EXPECT_LE(L.send_row(n) + R, L.send_rows());
    }
    // The reduce-scatter sends go to every other node once per chunk.
    std::map<uint32_t, uint32_t> per_node;
    for (uint32_t k = 0; k < L.rs_sends(); ++k) ++per_node[L.rs_send_node(k)];
    EXPECT_EQ(per_node.size(), g.nodes - 1);
    for (const auto& [node, count] : per_node) {
      EXPECT_NE(node, g.node);
      EXPECT_EQ(count, L.chunks_per_block());
    }
  }
}

// W GPUs with `ctas` compute CTAs each take tiles from their queue in block_at order. A partial
// or send tile completes at once; a fold tile waits until its local partials exist and, for the
// own block, until the node partials of its chunk were sent (a node sends chunk c of block
// (n', l) once all its tiles are done). The run must finish for every grid, or the order could
// deadlock on the device.
TEST(ReduceLayout, TileOrderCannotDeadlock) {
  for (uint32_t nodes : {2u, 3u, 4u}) {
    for (uint32_t local : {1u, 2u, 4u, 8u}) {
      for (uint32_t ctas : {1u, 2u, 5u}) {
        const uint32_t W = nodes * local;
        std::vector<ReduceLayout> L;
        for (uint32_t r = 0; r < W; ++r) L.push_back(reduce_layout(Grid{nodes, local, r / local, r % local}, false, 512, 2, 256));
        const uint32_t tpb = L[0].tiles_per_block();
        const uint32_t total = W * tpb;
        // done[r][(m_block, n_block)] on GPU r; partial[(owner rank, block, t, src local)]
        std::vector<std::set<std::pair<uint32_t, uint32_t>>> done(W);
        std::set<std::tuple<uint32_t, uint32_t, uint32_t, uint32_t>> partials;
        std::vector<uint32_t> queue(W, 0);
        std::vector<std::vector<int64_t>> holding(W, std::vector<int64_t>(ctas, -1));  // tile position a CTA waits on
        auto chunk_sent = [&](uint32_t sender, uint32_t d, uint32_t chunk) {
          const ReduceLayout& S = L[sender];
          const uint32_t first = d * S.m_blocks_per_block() + chunk * S.tile_rows_per_chunk();
          for (uint32_t m = first; m < first + S.tile_rows_per_chunk(); ++m) {
            for (uint32_t nb = 0; nb < S.n_blocks; ++nb) {
              if (!done[sender].count({m, nb})) return false;
            }
          }
          return true;
        };
        auto ready = [&](uint32_t r, uint32_t pos) {
          const ReduceLayout& R = L[r];
          const uint32_t d = R.block_at(pos / tpb);
          if (R.tile_role(d) != ReduceLayout::TileRole::kFold) return true;
          const uint32_t t = pos % tpb;
          for (uint32_t v = 0; v < local; ++v) {
            if (v != R.g.me && !partials.count({r, d, t, v})) return false;
          }
          if (R.g.node_of(d) != R.g.node) return true;
          const uint32_t chunk = (t / R.n_blocks) * kBlockM / R.rows_per_chunk;
          for (uint32_t n = 0; n < nodes; ++n) {
            if (n != R.g.node && !chunk_sent(n * local + R.g.me, d, chunk)) return false;
          }
          return true;
        };
        auto complete = [&](uint32_t r, uint32_t pos) {
          const ReduceLayout& R = L[r];
          const uint32_t d = R.block_at(pos / tpb);
          const uint32_t t = pos % tpb;
          const uint32_t m_block = d * R.m_blocks_per_block() + t / R.n_blocks;
          done[r].insert({m_block, t % R.n_blocks});
          if (R.tile_role(d) == ReduceLayout::TileRole::kPartial) {
            partials.insert({R.g.block(R.g.node, R.g.local_of(d)), d, t, R.g.me});
          }
        };
        bool progress = true;
        while (progress) {
          progress = false;
          for (uint32_t r = 0; r < W; ++r) {
            for (uint32_t c = 0; c < ctas; ++c) {
              int64_t& pos = holding[r][c];
              if (pos < 0 && queue[r] < total) pos = queue[r]++;  // claim in queue order
              if (pos >= 0 && ready(r, static_cast<uint32_t>(pos))) {
                complete(r, static_cast<uint32_t>(pos));
                pos = -1;
                progress = true;
              }
            }
          }
        }
        for (uint32_t r = 0; r < W; ++r) {
          EXPECT_EQ(done[r].size(), total) << nodes << " nodes x " << local << " GPUs, " << ctas << " CTAs: GPU " << r
                                           << " stuck";
        }
      }
    }
  }
}

TEST(ReduceLayout, AllReduceArrivalsCoverEveryBlockComputedElsewhere) {
  for (const Grid& g : grids()) {
    const ReduceLayout L = reduce_layout(g, true);
    EXPECT_EQ(L.arrivals(), (g.local - 1) * L.tiles_per_block() + (g.nodes - 1) * g.local * L.chunks_per_block());
    EXPECT_EQ(L.ag_sends(), (g.nodes - 1) * L.chunks_per_block());
    EXPECT_EQ(L.ag_send_block(0), g.own_block());
    EXPECT_EQ(reduce_layout(g, false).arrivals(), 0u);
    EXPECT_EQ(reduce_layout(g, false).ag_sends(), 0u);
  }
}


// The ramped raster of the multi-node reduce kernels visits every tile of a block exactly once,
// starts with a group of `first` rows (one chunk: the first chunk's tiles come first), grows to
// `group`, and never splits a chunk between groups. A group boundary is a row r where every tile
// of the rows above r comes before every tile of the rows from r on.
TEST(MultiNodeRaster, RampedGroupsCoverEveryTileOnceInWholeChunks) {
  for (const auto& [m_blocks, n_blocks, first, group] :
       std::vector<std::tuple<uint32_t, uint32_t, uint32_t, uint32_t>>{
           {32, 32, 1, 16}, {128, 32, 1, 16}, {8, 4, 8, 8}, {64, 4, 8, 16}, {30, 7, 2, 8}, {3, 5, 1, 16}, {1, 1, 1, 1}}) {
    SCOPED_TRACE(std::to_string(m_blocks) + "x" + std::to_string(n_blocks) + " first " + std::to_string(first) +
                 " group " + std::to_string(group));
    std::vector<int> seen(m_blocks * n_blocks, 0);
    std::vector<uint32_t> first_pos(m_blocks, ~0u), last_pos(m_blocks, 0);
    for (uint32_t t = 0; t < m_blocks * n_blocks; ++t) {
      uint32_t m = ~0u, n = ~0u;
      raster_ramped(t, m_blocks, n_blocks, first, group, m, n);
      ASSERT_LT(m, m_blocks);
      ASSERT_LT(n, n_blocks);
      ++seen[m * n_blocks + n];
      first_pos[m] = std::min(first_pos[m], t);
      last_pos[m] = std::max(last_pos[m], t);
    }
    for (int v : seen) EXPECT_EQ(v, 1);
    std::vector<uint32_t> cuts;
    uint32_t above = 0;  // the last position of the rows above r
    for (uint32_t r = 1; r < m_blocks; ++r) {
      above = std::max(above, last_pos[r - 1]);
      uint32_t below = ~0u;
      for (uint32_t q = r; q < m_blocks; ++q) below = std::min(below, first_pos[q]);
      if (above < below) cuts.push_back(r);
    }
    cuts.push_back(m_blocks);
    uint32_t top = 0, want = first;
    for (uint32_t cut : cuts) {
      EXPECT_TRUE(cut % first == 0 || cut == m_blocks) << "group boundary at row " << cut << " splits a chunk";
      EXPECT_EQ(cut - top, std::min(want, m_blocks - top)) << "group at row " << top;
      top = cut;
      want = std::min(2 * want, std::max(group, first));
    }
  }
}

}  // namespace
}  // namespace loom
