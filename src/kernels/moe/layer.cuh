// moe_layer: a whole MoE FFN step as one persistent kernel,
//   out[t] = sum over t's routed slots j (slot order, fp32) of w[t, j] * FFN_e(x[t]),
//   FFN_e(x) = (silu(x Wg_e^T) * (x Wu_e^T)) Wd_e^T,
// driven by readiness flags per tile row instead of phases: a receive block's rows land (the
// dispatch roles), its fc1 tiles (gate/up with the SwiGLU epilogue) start; a tile row's fc2 tiles
// (down projection) start once every fc1 tile of that row is stored; an expert output row is read
// back by its token's owner as soon as every fc2 tile of its tile row is stored.
//
// Roles (LayerRoleTable), every CTA of the GEMM engine's shape (Cfg::kThreads threads, its shared
// memory; one CTA per SM):
//   arrival  CTAs [0, arrival): moe_dispatch's arrival role (receive blocks, repeated rows copied,
//            ready[f] = e; none on one rank, where the pushing warps set ready[]), then compute.
//   push     the next push CTAs: moe_dispatch's push role (every warp pushes tokens), then compute.
//   compute  the rest, from the start: the GEMM engine's compute role paired over both GEMMs
//            (kernels/gemm/operands.cuh: one mainloop and pipeline, fc1 tiles as kTile with the
//            SwiGLU epilogue, fc2 tiles as kTileSecond with the plain one), fed by LayerScheduler:
//            one launch-wide queue (LaunchState::tile_queue, reset when the launch ends) over
//            every fc1 tile, then every fc2 tile, each gated on its inputs (below).
//   forward  several nodes: moe_dispatch's forwarding role (the entries other nodes send), then compute.
// Then every CTA reduces tokens (moe_combine's reduce_tokens with FinishedRowGate: a slot's row is
// read from its rank once out_ready[row] there holds this launch's epoch), and the last CTA runs
// moe_combine's done handshake (no rank leaves while another still reads its expert outputs).
// Several nodes (docs/MOE.md, "The full layer across nodes"): before reducing, every warp returns
// the partial sums of the entries other nodes staged here (return_partials, gated per row like the
// reducers, each entry read after its chunk's dispatch flag); the reducers read token_pos once
// every push CTA has counted itself in pushes_done; the combine's network flags follow the
// dispatch's in the launch's window; the last CTA waits for the return windows to drain.
// Both GEMMs run on the same tile table (same rows, experts and BLOCK_M), written by the grouped
// GEMM's plan kernel just before, in stream order, so fc2 tile row r covers exactly the rows of
// fc1 tile row r.
//
// Shared expert (optional): a dense SwiGLU FFN of the same intermediate size on this rank's own
// tokens, added with weight 1 to each token's routed sum. Its rows are rows of their own in hidden
// and expert_out, after the receive rows (token t: row Cs + t, Cs = layer_shared_row_begin(C),
// kernels/moe/layout.h), so both GEMMs take its tiles as more tile rows: "virtual" tile rows
// [0, S) are the shared expert's (S = ceil(T / BLOCK_M), rows Cs + v * BLOCK_M on), [S, S + Tt)
// the tile table's rows. The engine's local row range (GemmOperands::a_local, b_local) makes those
// tiles read the tokens x instead of recv_x (fc1) and the shared weights instead of an expert's
// (both). They come first in the queue: fc1's shared tiles wait for nothing, so the compute CTAs
// start on them while the dispatch roles still move tokens.
//
// Gates and signals (the engine's signaler thread signals a tile after its stores have landed):
//   fc1 tile (r, n)  waits for ready[] of the receive blocks its rows cover (moe_dispatch_gemm's
//                    gate; a shared tile waits for nothing); signal: hidden_done[r] += 1, a release
//                    at GPU scope (h stays on this GPU). r: the virtual tile row.
//   fc2 tile (r, n)  waits until hidden_done[r] counts every fc1 tile of row r (acquire, then a
//                    generic-to-async proxy fence: TMA reads h next); signal: system fence,
//                    out_done[r] += 1; the tile that completes the row fences again and stores the
//                    epoch into out_ready[j] for every row j of tile row r (relaxed stores after the
//                    fence; readers acquire).
// No deadlock: every fc1 position of the queue precedes every fc2 position, so a CTA waiting at an
// fc2 gate waits only for fc1 tiles that running CTAs have claimed, and fc1 tiles wait only for
// the dispatch roles, which run first; a reducing CTA waits only for fc2 tiles claimed by running
// CTAs (here or on a local peer). A claimed tile's signal must not wait for the CTA's next tile
// either (the engine defers it to after the next mainloop): the producer may be at that next
// tile's gate waiting for it, so the scheduler sets kGatesOnOwnSignals and the consumers post an
// owed signal whenever the next tile is not already there (kernels/gemm/compute_role.cuh).
//
// Buffers (the MoE workspace's regions in kernels/moe/layout.h: hidden_done, out_done, out_ready,
// zeroed before the launch; recv_x, rows, arrival, ready as moe_dispatch):
//   gate_up     [El, 2I, H]  this rank's experts, gate and up interleaved by 8 (moe.h)
//   down        [El, H, I]
//   shared_gate_up [2I, H], shared_down [H, I]   the shared expert's (optional)
//   hidden      [Cl, I]      silu(gate) * up of every kept receive row (this GPU); Cl = C, or
//                            layer_rows(C, Tmax, true) with a shared expert (its rows after Cs)
//   expert_out  [Cl, H]      symmetric: the fc2 output of every kept receive row (and shared row)
//   out         [T, H]       this rank's tokens
#pragma once

#include <cuda/ptx>

#include <cstdint>
#include <type_traits>

#include "kernels/comm/wait.cuh"
#include "kernels/frame/persistent.cuh"
#include "kernels/frame/role_table.h"
#include "kernels/gemm/compute_role.cuh"
#include "kernels/gemm/scheduler.cuh"
#include "kernels/moe/combine.cuh"
#include "kernels/moe/dispatch.cuh"
#include "kernels/moe/dispatch_gemm.cuh"  // ArrivedGroupedTiles, run_dispatch_roles
#include "kernels/moe/flags.h"
#include "kernels/moe/grouped_gemm.cuh"

namespace loom::kernels::moe {

enum class LayerRole : uint32_t {
  kArrival = 0,  // moe_dispatch's arrival role, then compute
  kForward = 1,  // several nodes: moe_dispatch's forwarding role (entries from other nodes), then compute
  kPush = 2,     // moe_dispatch's push role, then compute
  kCompute = 3,  // fc1 then fc2 tiles whose inputs are ready; every role then does the combine's work
};
using LayerRoleTable = frame::RoleTable<LayerRole, LayerRole::kCompute>;

struct LayerParams {
  GroupedGemmKernelParams up;    // first: tensor maps need 64-byte alignment. a = recv_x [C, H],
                                 // b = gate_up [El, 2I, H], d = hidden [Cl, I] (SwiGLU); header / table:
                                 // the tile table (both GEMMs')
  GroupedGemmKernelParams down;  // a = hidden [Cl, I], b = down [El, H, I], d = expert_out [Cl, H]
  // The shared expert's maps (used when shared_tile_rows > 0): the tokens x [T, H] (fc1's A for
  // shared tiles, the GEMMs' A box), its weights as one-group B maps [1, 2I, H] and [1, H, I].
  sm90::TmaDescriptor tokens;
  sm90::TmaDescriptor shared_gate_up;
  sm90::TmaDescriptor shared_down;
  DispatchParams dispatch;       // its `roles` is unused (the table below assigns them)
  CombineParams combine;         // y_offset: expert_out's; weights: the routing's; its `roles` unused
  // This rank's layer regions of the MoE workspace (kernels/moe/layout.h), local addresses.
  uint64_t* hidden_done;         // [Ts + Tr], by virtual tile row
  uint64_t* out_done;            // [Ts + Tr]
  uint64_t* out_ready;           // [Cl]
  uint64_t* pushes_done;         // push CTAs done (several nodes: the reducers then read token_pos)
  uint32_t shared_tile_rows;     // S = ceil(T / BLOCK_M) with a shared expert, else 0
  uint32_t shared_row_begin;     // Cs: hidden's and expert_out's row of token 0's shared rows
  MoeLayerPhaseRecord* phases;   // diagnostics: one record per CTA (zeroed before the launch), or null
  LayerRoleTable roles;
};
static_assert(sizeof(LayerParams) <= 4096, "moe_layer's parameters must fit the classic 4 KiB limit");

// The layer's scheduler (the engine's Scheduler interface, kernels/gemm/scheduler.cuh): queue
// positions [0, V n1) are fc1's tiles, [V n1, V (n1 + n2)) fc2's (V = S + Tt virtual tile rows:
// the shared expert's S, then the tile table's Tt; n1 and n2 the GEMMs' column blocks), each GEMM
// in the grouped GEMM's raster (expert groups: one expert's tile rows at a time, at most group_m,
// m fastest; or plain groups of group_m tile rows); fc2's items are kTileSecond. An item's
// m_block is its virtual row (the layer's counters are indexed by it).
template <int kBlockM>
class LayerScheduler {
 public:
  static constexpr bool kGroupedB = true;
  static constexpr bool kRowRanges = true;
  // An fc2 tile waits for fc1 tiles' signals, maybe this CTA's own (operands.cuh).
  static constexpr bool kGatesOnOwnSignals = true;

  // It runs on the producer's scheduling thread, which has few registers: it keeps the launch's
  // parameters (in the constant bank), the epoch and the tile count.
  // A failed routing (its status, written before this launch in stream order) leaves no routed
  // tile row (the plan kernel's table is empty) and no shared one: nothing is written.
  __device__ LayerScheduler(const LayerParams& p, uint64_t epoch)
      : p_(&p),
        epoch_(epoch),
        shared_rows_(p.combine.plan.status->code == 0 ? p.shared_tile_rows : 0),
        tile_rows_(shared_rows_ + p.up.header->tile_rows) {}

  __device__ gemm::WorkItem next(uint32_t /*compute_index*/, uint32_t /*num_compute*/, const WaitContext& ctx) {
    const uint32_t up_n = p_->up.sched.n_blocks;
    const uint32_t up_tiles = tile_rows_ * up_n;
    const uint32_t w = atomicAdd(&p_->dispatch.state->tile_queue, 1u);
    if (w >= up_tiles + tile_rows_ * p_->down.sched.n_blocks) {
      return gemm::WorkItem{static_cast<uint32_t>(gemm::WorkKind::kDone), 0, 0, 0};
    }
    const bool down = w >= up_tiles;
    const gemm::SchedulerParams& sp = down ? p_->down.sched : p_->up.sched;
    const uint32_t t = down ? w - up_tiles : w;
    uint32_t m_block, n_block;
    if (p_->up.expert_groups != 0) {
      // Expert groups (GroupedGemmOptions::expert_groups): the table's words, written with up's
      // group_m (both GEMMs share the table's tile rows).
      const uint32_t word = layer_group_word(t / sp.n_blocks, shared_rows_, max(p_->up.sched.group_m, 1u), p_->up.table);
      const GroupedTile tile = expert_group_tile(t, sp.n_blocks, word);
      m_block = tile.m_block;
      n_block = tile.n_block;
    } else {
      const uint32_t group_m = max(sp.group_m, 1u);
      const uint32_t first_m = t / (group_m * sp.n_blocks) * group_m;
      const uint32_t rows = min(tile_rows_ - first_m, group_m);
      const uint32_t local = t - first_m * sp.n_blocks;
      m_block = first_m + local % rows;
      n_block = local / rows;
    }
    if (p_->phases != nullptr) note_gate(down, false);
    bool ok = true;
    if (down) {
      ok = wait_until(p_->hidden_done + m_block, [up_n](uint64_t seen) { return seen >= up_n; }, ctx, -1,
                      kHiddenDoneFlag, m_block);
      // h was written by TMA stores (and generic stores at an expert's end) and is read by TMA next.
      if (ok) cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    } else if (m_block >= shared_rows_) {  // a shared tile's input is the caller's x
      ArrivedGroupedTiles<kBlockM> arrived;
      arrived.table = p_->up.table;
      arrived.dispatch = &p_->dispatch;
      arrived.epoch = epoch_;
      ok = arrived.gate(m_block - shared_rows_, sp, ctx);
    }
    if (!ok) return gemm::WorkItem{static_cast<uint32_t>(gemm::WorkKind::kFailed), 0, 0, 0};
    if (p_->phases != nullptr) note_gate(down, true);
    gemm::WorkItem item{static_cast<uint32_t>(down ? gemm::WorkKind::kTileSecond : gemm::WorkKind::kTile), m_block,
                        n_block, m_block * sp.n_blocks + n_block};
    if (m_block < shared_rows_) {  // B: the operands' b_local (group 0)
      item.group = 0;
      item.row_first = p_->shared_row_begin + m_block * kBlockM;
      item.row_limit = p_->shared_row_begin + p_->combine.num_tokens;
    } else {
      // expert, first row, row limit
      const uint4 row = *reinterpret_cast<const uint4*>(p_->up.table + (m_block - shared_rows_));
      item.group = row.x;
      item.row_first = row.y;
      item.row_limit = row.z;
    }
    return item;
  }

 private:
  // Diagnostics (LayerParams::phases): a claim reaching its gate (passed = false: the time is
  // subtracted from the wait sum) and passing it (added, and the tile counted). Nothing stays in
  // a register across the wait: the scheduling thread runs at the producer's few registers.
  __device__ void note_gate(bool down, bool passed) const {
    MoeLayerPhaseRecord& r = p_->phases[blockIdx.x];
    const uint64_t now = global_timer_ns();
    uint64_t& wait = down ? r.down_wait_ns : r.up_wait_ns;
    if (!passed) {
      wait -= now;  // modulo 2^64: the sum of (passed - reached) comes out right
      return;
    }
    wait += now;
    if (r.tiles++ == 0) r.first_tile_ns = now;
  }

  const LayerParams* p_;
  uint64_t epoch_;
  uint32_t shared_rows_;  // S, or 0 after a failed routing
  uint32_t tile_rows_;    // S + Tt
};

// fc1's epilogue: the grouped SwiGLU epilogue, and one count per stored tile.
template <int kBlockM>
class HiddenEpilogue : public GroupedEpilogue<kBlockM, true> {
 public:
  __device__ HiddenEpilogue(const GroupedGemmKernelParams& g, uint64_t* hidden_done)
      : GroupedEpilogue<kBlockM, true>(g.epi, &g.d, g.d_ptr, g.ldd_bytes), hidden_done_(hidden_done) {}
  __device__ bool signals() const { return true; }
  __device__ void signal(const gemm::WorkItem& tile, uint32_t /*m_blocks*/, uint32_t /*n_blocks*/) const {
    asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(hidden_done_ + tile.m_block) : "memory");
  }

 private:
  uint64_t* hidden_done_;
};

// fc2's epilogue: the grouped plain epilogue; the last stored tile of a row publishes its rows.
template <int kBlockM>
class ExpertOutEpilogue : public GroupedEpilogue<kBlockM, false> {
 public:
  __device__ ExpertOutEpilogue(const GroupedGemmKernelParams& g, uint64_t* out_done, uint64_t* out_ready, uint64_t epoch)
      : GroupedEpilogue<kBlockM, false>(g.epi, &g.d, g.d_ptr, g.ldd_bytes),
        out_done_(out_done),
        out_ready_(out_ready),
        epoch_(epoch) {}
  __device__ bool signals() const { return true; }
  __device__ void signal(const gemm::WorkItem& tile, uint32_t /*m_blocks*/, uint32_t n_blocks) const {
    __threadfence_system();  // this tile's rows, before the count other tiles' signalers may complete
    const unsigned long long before = atomicAdd(reinterpret_cast<unsigned long long*>(out_done_ + tile.m_block), 1ull);
    if (before + 1 != n_blocks) return;
    __threadfence_system();  // every tile of the row fenced before its increment
    const uint32_t end = min(tile.row_first + static_cast<uint32_t>(kBlockM), tile.row_limit);
    for (uint32_t j = tile.row_first; j < end; ++j) {
      asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(out_ready_ + j), "l"(epoch_) : "memory");
    }
  }

 private:
  uint64_t* out_done_;
  uint64_t* out_ready_;
  uint64_t epoch_;
};

// The combine's Gate (combine.cuh): lane j waits until its slot's row is final on its rank. The
// owner's entry word first (once per owner and warp): out_ready is zeroed in the owner's stream
// before its launch, and until then may hold anything an earlier layout of the workspace left.
// The addend (the shared expert's row of the token, this rank's) waits for its out_ready too.
struct FinishedRowGate {
  uint32_t shared_row_begin;  // Cs
  __device__ bool admit_addend(const CombineParams& p, uint32_t token, uint64_t epoch, const WaitContext& ctx) const {
    const DeviceComm& c = p.comm;
    bool ok = true;
    if (lane_id() == 0) {
      const uint32_t row = shared_row_begin + token;
      const uint64_t* ready = p.ws.at<uint64_t>(c, c.local_rank, p.ws.layout.out_ready, row);
      ok = wait_flag(ready, epoch, ctx, -1, kOutReadyFlag, row);
    }
    ok = __shfl_sync(0xffffffffu, ok, 0);
    __syncwarp();  // the lanes read the row next: ordered after lane 0's acquire
    return ok;
  }
  __device__ bool admit(const CombineParams& p, const JobRanks& r, bool here, uint32_t owner, uint32_t row,
                        uint32_t& entered, uint64_t epoch, const WaitContext& ctx) const {
    if (!enter_owners(p, r, here, owner, entered, epoch, ctx)) return false;
    bool ok = true;
    if (here) {
      ok = wait_flag(p.ws.at<uint64_t>(p.comm, static_cast<int>(r.local_of(owner)), p.ws.layout.out_ready, row), epoch,
                     ctx, static_cast<int>(owner), kOutReadyFlag, row);
    }
    ok = __all_sync(0xffffffffu, ok);
    __syncwarp();  // every lane reads every slot's row next: ordered after the lanes' acquires
    return ok;
  }
};

template <class Cfg, bool kBF16>
__global__ void __launch_bounds__(Cfg::kThreads, 1) moe_layer_kernel(const __grid_constant__ LayerParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  using Scheduler = LayerScheduler<Cfg::kBlockM>;
  using Epilogue = gemm::PairedEpilogue<HiddenEpilogue<Cfg::kBlockM>, ExpertOutEpilogue<Cfg::kBlockM>>;
  using Role = gemm::ComputeRole<Cfg, kBF16, false, Scheduler, Epilogue>;
  using T = typename std::conditional<kBF16, __nv_bfloat16, __half>::type;
  static_assert(Role::kPaired, "moe_layer runs both expert GEMMs through one compute role");
  static_assert(Cfg::kThreads % 32 == 0, "the dispatch and combine roles work in whole warps");
  static_assert(kLayerSharedRowAlign % Cfg::kBlockM == 0,
                "the shared expert's first row must start a tile row (no tile may straddle routed and shared rows)");
  constexpr uint32_t kWarps = Cfg::kThreads / 32;
  const DispatchParams& d = p.dispatch;
  const DeviceComm& c = d.comm;
  const frame::LaunchFrame f = frame::LaunchFrame::enter(c, kLayerOp, moe_entry(c), d.signature);
  Role::init(smem);

  const LayerRoleTable& roles = p.roles;
  // Diagnostics: thread 0 stamps this CTA's steps (the scheduling thread adds its claims).
  MoeLayerPhaseRecord* const phase = p.phases != nullptr && threadIdx.x == 0 ? p.phases + blockIdx.x : nullptr;
  if (phase != nullptr) {
    phase->entered_ns = global_timer_ns();
    phase->role = static_cast<uint32_t>(roles.role_of(blockIdx.x));
  }
  bool ok = run_dispatch_roles<Cfg::kControlOffset>(d, roles, f, smem);
  if (phase != nullptr) phase->roles_done_ns = global_timer_ns();
  // Several nodes: the reducers read token_pos (where the push warps put each token's entry for
  // every other node), written in this launch: each push CTA counts itself done.
  const bool nodes = c.net.num_nodes > 1;
  if (nodes && ok && roles.role_of(blockIdx.x) == LayerRole::kPush && threadIdx.x == 0) {
    __threadfence();  // every warp's token_pos stores (run_dispatch_roles ended with a CTA barrier)
    asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(p.pushes_done) : "memory");
  }
  if (ok) {
    Scheduler scheduler(p, f.epoch);
    Epilogue epi(HiddenEpilogue<Cfg::kBlockM>(p.up, p.hidden_done),
                 ExpertOutEpilogue<Cfg::kBlockM>(p.down, p.out_done, p.out_ready, f.epoch));
    // The shared expert's tile rows are the local row range of both GEMMs (empty without one).
    const uint32_t shared_end = p.shared_row_begin + p.shared_tile_rows * Cfg::kBlockM;
    const bool shared = p.shared_tile_rows > 0;
    gemm::GemmOperands down{&p.down.a, &p.down.b, p.down.m, p.down.n, p.down.k};
    down.local_row_begin = p.shared_row_begin;
    down.local_row_end = shared_end;
    down.b_local = shared ? &p.shared_down : nullptr;
    down.swap_tails = p.down.swap_tails != 0;
    down.a_rows = &p.down.a_rows;
    gemm::GemmOperands up{&p.up.a, &p.up.b, p.up.m, p.up.n, p.up.k};
    up.a_local = shared ? &p.tokens : nullptr;
    up.local_row_begin = p.shared_row_begin;
    up.local_row_end = shared_end;
    up.b_local = shared ? &p.shared_gate_up : nullptr;
    up.swap_tails = p.up.swap_tails != 0;
    up.a_rows = &p.up.a_rows;
    up.second = &down;
    ok = Role::run(smem, up, scheduler, epi, roles.rest_index(blockIdx.x, gridDim.x), gridDim.x, f.ctx).kind ==
         static_cast<uint32_t>(gemm::WorkKind::kDone);
    if (phase != nullptr) phase->tiles_done_ns = global_timer_ns();
  }
  // The combine, when the routing did not fail (else nothing is read or written; the handshake
  // still runs). Several nodes: every warp first returns the partial sums of the entries other
  // nodes staged here (they wait only for rows of this node), then reduces its own tokens (which
  // wait for the other nodes' partials): reducing first could leave two nodes waiting for each other.
  const uint32_t warp = blockIdx.x * kWarps + warp_id(), warps = gridDim.x * kWarps;
  const FinishedRowGate gate{p.shared_row_begin};
  if (ok && p.combine.plan.status->code == 0) {
    if (nodes) {
      ok = cta_all(return_partials<T>(p.combine, warp, warps, f.epoch, f.ctx, gate, d.net_flag_base));
      if (ok && threadIdx.x == 0) {
        const uint64_t pushers = roles.count(LayerRole::kPush);
        ok = wait_until(p.pushes_done, [pushers](uint64_t seen) { return seen >= pushers; }, f.ctx, -1,
                        kPushesDoneFlag, 0);
      }
      ok = cta_all(ok);
    }
    if (ok) ok = cta_all(reduce_tokens<T>(p.combine, warp, warps, f.epoch, f.ctx, gate));
    if (ok && phase != nullptr) phase->reduced_ns = global_timer_ns();
  }
  if (cta_all(ok)) {
    if (threadIdx.x == 0) {
      flag_store_release(d.ws.at<uint64_t>(c, c.local_rank, d.ws.layout.read_done, blockIdx.x), f.epoch);
    }
    if (blockIdx.x == gridDim.x - 1) {
      bool drained = true;
      if (nodes && threadIdx.x == 0 && p.combine.plan.status->code == 0) drained = return_windows_drained(p.combine, f.ctx);
      if (cta_all(drained)) (void)finish_reads(p.combine, f.epoch, f.ctx);
    }
  }
  f.mark(LaunchPhase::kRolesDone);
  f.finish(d.state, c);
}

}  // namespace loom::kernels::moe
