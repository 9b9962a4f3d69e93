// The MoE routing as a specification: what moe_routing must compute for every rank, written the
// plain way (sort every rank's received rows), host-only. Used by the CPU tests (against hand
// computed cases) and the GPU tests (against the kernels).
//
// Receive layout of rank d (docs/MOE.md): the (source rank s, token t, slot j) pairs whose expert
// ids[s][t*k+j] lies in [d*El, (d+1)*El), sorted by (local expert, s, t, j); a pair's row is its
// position. Rows at or past the capacity C are dropped (MoeOverflow::kDrop), or any rank over C
// fails the call (kError). An id outside [0, E) other than -1 fails the call, naming the lowest
// rank that has one and its first (token, slot).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

namespace loom::test::moe {

struct RefInput {
  int world = 1;
  int64_t experts = 0;   // E
  int top_k = 0;         // k
  int64_t capacity = 0;  // C
  bool drop = false;     // MoeOverflow::kDrop
  std::vector<std::vector<int32_t>> ids;  // per rank, [T_r * k]
};

struct RefRow {
  int source = 0;
  int64_t token = 0;
  int slot = 0;
  int64_t primary = 0;  // the first row of the same (source, token) on this rank
};

enum RefCode : int { kRefOk = 0, kRefBadExpert = 1, kRefCapacity = 2 };  // MoeError's values

struct RefRank {
  int code = kRefOk;
  int bad_rank = 0;
  int64_t bad_token = 0;  // kRefBadExpert: token; kRefCapacity: that rank's rows
  int bad_slot = 0;
  int32_t bad_value = 0;
  std::vector<int32_t> slot_dest;       // [T * k]: d * C + row, or -1
  std::vector<int32_t> expert_offsets;  // [El + 1]
  std::vector<RefRow> rows;             // the kept rows, in order
  int64_t recv_rows = 0, kept_rows = 0, dropped_rows = 0, dropped_slots = 0, max_recv_rows = 0;
};

inline std::vector<RefRank> reference_routing(const RefInput& in) {
  const int w = in.world;
  const int k = in.top_k;
  const int64_t per_rank = in.experts / w;
  std::vector<RefRank> out(static_cast<size_t>(w));
  // The first bad id (lowest rank, then smallest pair).
  int code = kRefOk, bad_rank = 0, bad_slot = 0;
  int64_t bad_token = 0;
  int32_t bad_value = 0;
  for (int s = 0; s < w && code == kRefOk; ++s) {
    for (size_t q = 0; q < in.ids[s].size(); ++q) {
      const int32_t e = in.ids[s][q];
      if (e != -1 && (e < 0 || e >= in.experts)) {
        code = kRefBadExpert;
        bad_rank = s;
        bad_token = static_cast<int64_t>(q) / k;
        bad_slot = static_cast<int>(q % k);
        bad_value = e;
        break;
      }
    }
  }
  // Every rank's rows, in order.
  using Key = std::tuple<int64_t, int, int64_t, int>;  // local expert, source, token, slot
  std::vector<std::vector<Key>> recv(static_cast<size_t>(w));
  for (int s = 0; s < w; ++s) {
    for (size_t q = 0; q < in.ids[s].size(); ++q) {
      const int32_t e = in.ids[s][q];
      if (e < 0 || e >= in.experts) continue;
      recv[e / per_rank].emplace_back(e % per_rank, s, static_cast<int64_t>(q) / k, static_cast<int>(q % k));
    }
  }
  int64_t most = 0;
  for (int d = 0; d < w; ++d) {
    std::sort(recv[d].begin(), recv[d].end());
    most = std::max<int64_t>(most, static_cast<int64_t>(recv[d].size()));
  }
  if (code == kRefOk && !in.drop) {
    for (int d = 0; d < w; ++d) {
      if (static_cast<int64_t>(recv[d].size()) > in.capacity) {
        code = kRefCapacity;
        bad_rank = d;
        bad_token = static_cast<int64_t>(recv[d].size());
        break;
      }
    }
  }
  for (int s = 0; s < w; ++s) {
    RefRank& r = out[s];
    r.code = code;
    r.bad_rank = bad_rank;
    r.bad_token = bad_token;
    r.bad_slot = bad_slot;
    r.bad_value = bad_value;
    r.slot_dest.assign(in.ids[s].size(), -1);
    r.expert_offsets.assign(static_cast<size_t>(per_rank + 1), 0);
    r.recv_rows = static_cast<int64_t>(recv[s].size());
    r.max_recv_rows = most;
  }
  if (code != kRefOk) return out;
  for (int d = 0; d < w; ++d) {
    RefRank& r = out[d];
    r.kept_rows = std::min(r.recv_rows, in.capacity);
    r.dropped_rows = r.recv_rows - r.kept_rows;
    for (int64_t le = 0; le <= per_rank; ++le) {
      const auto first = std::lower_bound(recv[d].begin(), recv[d].end(), Key{le, 0, 0, 0});
      r.expert_offsets[le] = static_cast<int32_t>(std::min<int64_t>(in.capacity, first - recv[d].begin()));
    }
    for (int64_t row = 0; row < static_cast<int64_t>(recv[d].size()); ++row) {
      const auto& [le, s, t, j] = recv[d][row];
      const size_t q = static_cast<size_t>(t * k + j);
      if (row >= in.capacity) {
        ++out[s].dropped_slots;
        continue;
      }
      out[s].slot_dest[q] = static_cast<int32_t>(d * in.capacity + row);
      r.rows.push_back(RefRow{s, t, j, row});
    }
    // Primary: the first kept row of the same (source, token) (rows are in order).
    std::map<std::pair<int, int64_t>, int64_t> first_row;
    for (RefRow& row : r.rows) row.primary = first_row.emplace(std::make_pair(row.source, row.token), row.primary).first->second;
  }
  return out;
}

}  // namespace loom::test::moe
