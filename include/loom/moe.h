// Expert-parallel (MoE) operators, part 1: routing on the device, dispatch and combine, within one
// NVLink domain and across nodes (docs/MOE.md has the design: receive layout, buffers, flags,
// capacity policy, the path across nodes).
//
// Experts are split contiguously over the W ranks of the job: rank r holds experts
// [r*E/W, (r+1)*E/W) (its "local experts" 0 .. E/W-1), r counted node-major (local index l of node
// n is r = n*L + l, the communicator rank whenever the launcher numbers ranks that way). Per rank,
// one MoE step is four calls, each collective (every rank calls it, in the same order) and
// asynchronous on `stream`:
//
//   MoePlan plan = moe_routing(comm, config, {ids, weights, T, plan_buffer, expert_offsets}, stream);
//   moe_dispatch(comm, plan, x, recv_x, stream);          // recv_x: symmetric [capacity, H]
//   ... the expert FFN on recv_x rows, local expert i owning rows [expert_offsets[i], expert_offsets[i+1])
//       and writing its outputs into the same rows of a symmetric expert_out ...
//   moe_combine(comm, plan, expert_out, out, stream);     // out[t] = sum_j w[t,j] * expert_out[row(t,j)]
//
// Routing reads each token's top-k expert ids (int32 [T, k]; -1 marks an unused slot) and weights
// (fp32 [T, k]) on the device and computes everything else there: no host loop, no host
// synchronization. The receive layout on every rank is "contiguous": rows grouped by local expert
// (expert i's rows at [expert_offsets[i], expert_offsets[i+1]), possibly empty), inside an expert
// by source rank, then token, then slot; no padding. A token needed by several experts of one rank
// crosses NVLink once (into its first row there) and is copied to its other rows on that rank.
// Across nodes a token crosses the network once per node holding one of its experts, to the GPU
// with the sender's local index there, which forwards it over NVLink; combine then adds, in node
// order, one fp32 partial sum per node (each node's slots in slot order). There, moe_combine needs
// the moe_dispatch (or moe_dispatch_gemm) of the same MoePlan to have run last, and the routing's
// weights (MoeCombineArgs::topk_weights null): refused with invalid_argument / unsupported
// otherwise. Kernels an application launches for the first time between these calls can stall
// them (CUDA's lazy loading waits for running work: docs/NETWORK.md, "A hazard").
//
// Input whose values the host cannot see (expert ids out of range, a receive buffer over its
// capacity) is found on the device. Then no rank moves any data (recv_x and out are not written,
// expert_offsets are all 0) and moe_report() returns invalid_argument naming the rank, token, slot
// and id (or the rank over capacity and its rows). With MoeOverflow::kDrop, rows past a rank's
// capacity are dropped instead (counted in the report; their slots add nothing in combine).
// Everything the host can check (shapes, pointers, k > E, E not a multiple of W) is refused with a
// Status before anything is launched or written.
//
// The grouped GEMM for the experts' rows is below (loom::grouped_gemm, one GPU);
// moe_dispatch_gemm fuses the dispatch with the first expert GEMM (one persistent kernel: an
// expert's tiles start as their rows land); moe_layer is the whole FFN step in one kernel
// (dispatch, gate/up + SwiGLU, down, weighted combine); moe_topk turns router logits
// into the ids and weights moe_routing takes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "loom/communicator.h"
#include "loom/diagnostics.h"
#include "loom/gemm.h"
#include "loom/status.h"
#include "loom/types.h"

namespace loom {

// Limits of this build (the host checks them; docs/MOE.md says why each exists).
inline constexpr int kMoeMaxTopK = 32;          // a token's slots are the lanes of one warp
inline constexpr int64_t kMoeMaxExperts = 1024;  // per-warp expert histograms in shared memory
inline constexpr int kMoeMaxLocalWorld = 32;    // ranks per node: destination sets are 32-bit masks

// What happens when the rows routed to a rank exceed its capacity.
enum class MoeOverflow : uint8_t {
  kError,  // nothing moves on any rank; moe_report() names the rank and its rows
  kDrop,   // rows past the capacity in the receive order are dropped and counted
};

// The shape of an MoE step; every rank passes the same config (checked at launch: a rank with
// another config fails the launch with a mismatch instead of corrupting memory).
struct MoeConfig {
  int64_t num_experts = 0;      // E over all ranks; a multiple of the world size
  int top_k = 0;                // k: 1 .. min(E, kMoeMaxTopK)
  int64_t hidden = 0;           // H: elements per token row; H * element size a multiple of 16 bytes
  DType dtype = DType::kBF16;   // of the token rows (bf16, fp16, fp32; dispatch moves bits)
  int64_t max_tokens = 0;       // most tokens one rank routes per call (sizes the plan buffer)
  int64_t capacity = 0;         // receive rows per rank; 0: max_tokens * world * top_k (never overflows)
  MoeOverflow overflow = MoeOverflow::kError;
};

// Sizes a config needs on this communicator.
struct MoeSizes {
  int64_t capacity = 0;         // receive rows per rank (config.capacity or its default)
  int64_t local_experts = 0;    // E / W
  size_t plan_bytes = 0;        // MoeRoutingArgs::plan (device memory of this GPU)
  size_t recv_bytes = 0;        // recv_x: capacity * H * element size (symmetric)
  size_t workspace_bytes = 0;   // what loom takes from the symmetric heap for the MoE family
};

// ---- plan and workspace, before the calls (e.g. before CUDA-graph capture) ---------------------
// The MoE family's plan query is moe_sizes (MoePlan is the routing's handle, made by moe_routing).
//
// ok when the config can run on this communicator (host checks only; nothing is allocated).
Status moe_can_implement(const Communicator& comm, const MoeConfig& config);
// The sizes of a config that moe_can_implement accepts, or its refusal.
Result<MoeSizes> moe_sizes(const Communicator& comm, const MoeConfig& config);
// Grows loom's symmetric workspace to MoeSizes::workspace_bytes now (the calls grow it on first
// use, which cannot happen inside a CUDA-graph capture). Collective: every rank reserves the same
// configs in the same order. stream: where the growth waits for earlier work.
Status moe_reserve_workspace(Communicator& comm, const MoeConfig& config, cudaStream_t stream);

struct MoeRoutingArgs {
  const int32_t* topk_ids = nullptr;    // [T, k] device; -1: unused slot; others must be in [0, E)
  const float* topk_weights = nullptr;  // [T, k] device; null: every weight 1
  int64_t num_tokens = 0;               // T of this rank, 0 .. config.max_tokens (may differ per rank)
  void* plan = nullptr;                 // out: MoeSizes::plan_bytes of device memory, 16-byte aligned
  int32_t* expert_offsets = nullptr;    // out: [E/W + 1] device; local expert i owns receive rows
                                        // [expert_offsets[i], expert_offsets[i+1])
};

// What moe_routing hands to dispatch and combine: a host-side handle (plain values); the routing
// itself lives on the device in `plan`, which must stay untouched until the last call using it.
struct MoePlan {
  MoeConfig config;
  int64_t capacity = 0;        // effective receive rows per rank
  int64_t num_tokens = 0;      // T of this rank
  void* plan = nullptr;        // MoeRoutingArgs::plan
  const int32_t* expert_offsets = nullptr;
  uint64_t handle = 0;         // which moe_routing call of the communicator made it (from 1)
};

Result<MoePlan> moe_routing(Communicator& comm, const MoeConfig& config, const MoeRoutingArgs& args,
                            cudaStream_t stream);

struct MoeDispatchOptions {
  int num_ctas = 0;      // 0: every SM of the GPU
  int arrival_ctas = 0;  // CTAs that receive (wait for rows, copy repeated tokens); 0: planner
};
// x: [T, H] device memory of this GPU (16-byte aligned). recv_x: symmetric [capacity, H] (the
// same Communicator::alloc on every rank); rows past expert_offsets[E/W] are not written.
Status moe_dispatch(Communicator& comm, const MoePlan& plan, const void* x, void* recv_x, cudaStream_t stream,
                    const MoeDispatchOptions& options = {});

struct MoeCombineArgs {
  const void* expert_out = nullptr;     // symmetric [capacity, hidden], rows in the receive layout
  void* out = nullptr;                  // [T, hidden] device memory of this GPU
  const float* topk_weights = nullptr;  // [T, k]; null: the weights given to moe_routing
  int64_t hidden = 0;                   // 0: config.hidden
  DType dtype = DType::kBF16;           // of expert_out and out
};
struct MoeCombineOptions {
  int num_ctas = 0;  // 0: planner
};
// out[t] = sum over t's routed slots j, in slot order, of w[t,j] * expert_out[row of (t, j)],
// accumulated in fp32 (fused multiply-add) and rounded once: bit-identical across runs. A token
// with no routed slot gets zeros. Across nodes: each node's slots in slot order, then those node
// sums in node order (fp32), rounded once. topk_weights must be null there, and hidden at most
// the config's.
Status moe_combine(Communicator& comm, const MoePlan& plan, const MoeCombineArgs& args, cudaStream_t stream,
                   const MoeCombineOptions& options = {});

// What the device found while routing, read after the stream's work (this call synchronizes
// `stream` with Communicator::synchronize, bounded). `status` is invalid_argument when the routing
// refused its input (nothing moved); the counts are this rank's.
struct MoeReport {
  Status status;
  int64_t recv_rows = 0;      // rows routed to this rank (before the capacity)
  int64_t kept_rows = 0;      // rows in its receive buffer (expert_offsets[E/W])
  int64_t dropped_rows = 0;   // recv_rows - kept_rows (MoeOverflow::kDrop)
  int64_t dropped_slots = 0;  // this rank's (token, slot) pairs that found no room at their expert
  int64_t max_recv_rows = 0;  // the largest recv_rows over all ranks (what capacity would fit)
};
Result<MoeReport> moe_report(Communicator& comm, const MoePlan& plan, cudaStream_t stream);

// ---- grouped GEMM ------------------------------------------------------------------------------
// loom::grouped_gemm: for every expert e, D_e = A_e * B_e^T (B_e an nn.Linear weight [N, K]; or
// A_e * B_e with B_e [K, N]), all experts in one persistent kernel of loom's GEMM engine; fp32
// accumulation.
//
//   layout kContiguous (rows grouped by expert, e.g. after a MoE dispatch):
//     A        [M_total, K] row-major                      bf16 or fp16
//     offsets  int32 [E + 1], device memory: expert e's rows are [offsets[e], offsets[e+1]);
//              any count per expert, 0 included; no padding between experts
//     D        [M_total, N] row-major                      bf16, fp16 or fp32
//     Rows outside every expert's range are not written.
//   layout kMasked (a fixed capacity per expert):
//     A        [E, capacity, K]
//     counts   int32 [E], device memory: rows [0, counts[e]) of expert e are valid
//     D        [E, capacity, N]; rows >= counts[e] are not written
//   B          b_layout kNK: [E, N, K] row-major (one nn.Linear weight [N, K] per expert), or
//              b_layout kKN: [E, K, N] row-major (one [K, N] matrix per expert); same type as A
//
// The per-expert row counts stay on the device: a small plan kernel turns them into the tile list
// in `workspace`, the GEMM kernel reads it (no host synchronization; the call is asynchronous on
// `stream` and can be captured in a CUDA graph).
// Workspace: device memory, 16-byte aligned, at least grouped_gemm_workspace_bytes(args) bytes:
//     16 * (1 + T_max),  T_max = ceil(M_total / 64) + E         (contiguous)
//                        T_max = E * ceil(capacity / 64)         (masked)
// (kernels/moe/grouped_gemm_params.h has the layout). One workspace per stream at a time: a call
// rewrites it. Its second 32-bit word holds, after the call, the number of experts whose offsets
// or count were out of range (see below).
//
// Rules, checked by grouped_gemm_can_implement before anything is launched:
//   invalid_argument: null a, b or d; null offsets (contiguous) or counts (masked); pointers not
//                     16-byte aligned (offsets / counts: 4-byte); E < 1; negative M_total or
//                     capacity; a missing, small or misaligned workspace; D overlapping A or B;
//                     an unknown layout, B layout, activation, dtype or option.
//   unsupported:      N or K not a positive multiple of 8 (TMA needs 16-byte row strides), fp32
//                     (kSwiGLU: N not a multiple of 16, a forced tile with BLOCK_N 64),
//                     inputs, rows of A (M_total or E * capacity), N, K or E of 2^31 or more,
//                     a forced tile that does not fit the device.
// Device-side values cannot be checked before the launch. Offsets must be non-decreasing within
// [0, M_total] and counts within [0, capacity]; an expert outside that is clamped into it (its
// range cut to [0, M_total], its count to [0, capacity]) and counted in the workspace's second
// word, so nothing outside A and D is ever read or written (overlapping ranges from
// non-monotonic offsets leave the overlap's values unspecified).
// M_total == 0 or capacity == 0 launches nothing.
// What the epilogue applies to each output element.
//   kNone:   D = A * B (per expert, as above), D [rows, N].
//   kSwiGLU: the gate and up projections in one GEMM: B's N = 2I rows (kNK; columns for kKN) hold
//            gate and up interleaved in groups of 8 — B row 16j + i is gate row 8j + i, row
//            16j + 8 + i is up row 8j + i (i < 8; loom.torch.swiglu_weights builds it) — and
//            D [rows, I] = silu(A * gate^T) * (A * up^T), in fp32 before the output rounding. N must
//            be a multiple of 16, the tile's BLOCK_N at least 128 (the planner never picks 128x64).
enum class GroupedActivation : uint8_t { kNone = 0, kSwiGLU = 1 };

enum class GroupedLayout : uint8_t {
  kContiguous = 0,  // A [M_total, K] grouped by expert, offsets [E + 1]
  kMasked = 1,      // A [E, capacity, K], counts [E]
};
std::string_view grouped_layout_name(GroupedLayout layout);  // "contiguous", "masked"
Result<GroupedLayout> parse_grouped_layout(std::string_view name);

struct GroupedGemmArgs {
  GroupedLayout layout = GroupedLayout::kContiguous;
  const void* a = nullptr;
  const void* b = nullptr;  // [E, N, K] (b_layout kNK) or [E, K, N] (kKN)
  void* d = nullptr;
  const int32_t* offsets = nullptr;  // kContiguous: [E + 1], device memory
  const int32_t* counts = nullptr;   // kMasked: [E], device memory
  int64_t m_total = 0;               // kContiguous: rows of A and D
  int64_t capacity = 0;              // kMasked: rows per expert in A and D
  int64_t n = 0, k = 0;
  int64_t num_experts = 0;           // E
  DType in_dtype = DType::kBF16;     // A and B: bf16 or fp16
  DType out_dtype = DType::kBF16;    // D: bf16, fp16 or fp32
  BLayout b_layout = BLayout::kNK;   // B: [E, N, K] (nn.Linear weights) or kKN [E, K, N]
  GroupedActivation activation = GroupedActivation::kNone;  // kSwiGLU: D has N / 2 columns (above)
  void* workspace = nullptr;         // device memory, grouped_gemm_workspace_bytes(args)
  size_t workspace_bytes = 0;
};

struct GroupedGemmOptions {
  GemmTile tile = GemmTile::kAuto;  // force a configuration
  int num_ctas = 0;                 // persistent CTAs; 0: the SM count (or fewer when there are
                                    // fewer tiles, whatever the counts turn out to be)
  // An expert's last partial tile row computed swapped (its rows as wgmma's N in steps of 16, so
  // it costs about its own rows, not a whole tile row; 128-row tiles with [E, N, K] weights).
  // false: padded to the tile like the other rows (same results up to summation order; for A/B
  // comparisons).
  bool swap_tails = true;
  int group_m = 0;          // raster group height in tile rows (a few experts' rows share each B
                            // tile while it is in L2); 0: the planner's sqrt(num_ctas * BN / BM)
  // Tiles claimed first come, first served from a counter in the workspace (the plan kernel zeroes
  // it): a CTA whose tiles cost less (swapped tails) or wait longer (B from HBM) takes more of them.
  // false: round-robin (CTA c takes tiles c, c + grid, ...). Under skewed routing the queue took
  // 0.66-0.95x the round-robin time on one H100 (docs/MOE.md, "The grouped GEMM under skew").
  bool tile_queue = true;
  // The raster's groups end where the experts do (each group one expert's tile rows, at most
  // group_m of them) instead of every group_m tile rows: an expert's B is then loaded by one group
  // unless it has more than group_m tile rows (a boundary inside an expert loads its B twice).
  // On one H100 (DeepSeek-V3 slices) it took 0.81-0.93x the time of plain groups at 1K tokens per
  // GPU and 0.98-1.01x at 4K and 16K (docs/MOE.md, "The grouped GEMM under skew").
  bool expert_groups = true;
};

// ---- plan and workspace, before a call (e.g. before CUDA-graph capture) ------------------------
// Bytes of workspace `args` needs (the formula above; 0 for a negative size or E < 1).
size_t grouped_gemm_workspace_bytes(const GroupedGemmArgs& args);

// Checks everything that can be checked without a GPU (no CUDA call is made).
Status grouped_gemm_can_implement(const GroupedGemmArgs& args, const GroupedGemmOptions& options = {});

// What a call launches on the current device.
struct GroupedGemmPlanInfo {
  GemmTile tile = GemmTile::kAuto;  // never kAuto in a returned plan
  GemmTileInfo tile_info;
  int grid = 0;                     // persistent CTAs
  int64_t rows = 0;                 // rows of A and D (M_total, or E * capacity when masked)
  int64_t max_tiles = 0;            // the most output tiles any counts can give (the tile table's size)
  size_t workspace_bytes = 0;       // grouped_gemm_workspace_bytes(args)
};
// grouped_gemm_can_implement's checks, then the plan (unsupported unless the device is sm_90).
Result<GroupedGemmPlanInfo> grouped_gemm_plan(const GroupedGemmArgs& args, const GroupedGemmOptions& options = {});

Status grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream, const GroupedGemmOptions& options = {});

// ---- moe_dispatch_gemm: the dispatch and the local experts' first GEMM in one kernel -------------
// moe_dispatch (above) and, in the same persistent kernel, out_e = recv_x_e * W_e^T for every
// local expert e (a grouped GEMM over the receive rows, fp32 accumulation): compute roles start a
// tile as soon as the receive blocks holding its rows are complete, while other rows are still
// being pushed. recv_x is written exactly as moe_dispatch writes it; out rows [0, kept) are
// bit-identical to moe_dispatch followed by grouped_gemm (contiguous layout, a = recv_x, offsets =
// expert_offsets, M_total = capacity, E = E/W) with the same tile; rows past kept are not written.
// With the SwiGLU epilogue this is fc1 of an MoE FFN (out = silu(x W_gate^T) * (x W_up^T)).
struct MoeExpertGemm {
  const void* weights = nullptr;  // this rank's E/W experts: [E/W, N, K] (b_layout kNK) or
                                  // [E/W, K, N] (kKN), K = config.hidden, type config.dtype
                                  // (bf16 or fp16); device memory of this GPU, 16-byte aligned
  int64_t n = 0;                  // N: a positive multiple of 8 (kSwiGLU: of 16)
  BLayout b_layout = BLayout::kNK;
  GroupedActivation activation = GroupedActivation::kNone;  // kSwiGLU: gate/up interleaved by 8
  void* out = nullptr;            // [capacity, N_out] (N_out = N, or N / 2 with kSwiGLU), device
                                  // memory of this GPU, 16-byte aligned (symmetric when
                                  // moe_combine reads it directly)
  DType out_dtype = DType::kBF16;  // bf16, fp16 or fp32
};
struct MoeDispatchGemmOptions {
  GemmTile tile = GemmTile::kAuto;  // k128x256 or k128x128 (the planner picks one)
  int num_ctas = 0;                 // persistent CTAs, one per SM; 0: every SM
  int push_ctas = 0;                // CTAs that push rows first (then compute); 0: planner
  int arrival_ctas = 0;             // CTAs that complete receive blocks first (then compute); 0: planner
  // As GroupedGemmOptions::expert_groups: each raster group one expert's tile rows (at most the
  // planner's group_m). false: groups of group_m tile rows whatever the experts (A/B timing).
  bool expert_groups = true;
};
// Everything moe_dispatch checks, and grouped_gemm_can_implement's rules for the GEMM (config.dtype
// fp32 is unsupported here). Across nodes the forwarding CTAs (1/8 of the grid) join the GEMM once
// the entries other nodes sent this rank are pushed.
Status moe_dispatch_gemm(Communicator& comm, const MoePlan& plan, const void* x, void* recv_x, const MoeExpertGemm& gemm,
                         cudaStream_t stream, const MoeDispatchGemmOptions& options = {});

// ---- moe_topk: the router's top-k on the device ----------------------------------------------------
// For every token t: ids[t, 0..k) the k experts with the largest logits, largest first (equal
// logits: the lower expert id first); weights[t, j] = softmax over all E logits at ids[t, j]
// (kSoftmax) or sigmoid(logit) (kSigmoid), divided by the sum of the token's k weights when
// `renormalize`. A logit of -inf is never chosen: a token with fewer than k finite logits gets -1
// ids (unused slots, as moe_routing reads them) and weight 0 there. fp32 math; one GPU, no
// communicator; asynchronous on `stream` (capturable). The outputs feed moe_routing.
enum class MoeScoring : uint8_t { kSoftmax = 0, kSigmoid = 1 };
struct MoeTopkArgs {
  const void* logits = nullptr;   // [T, E] device memory, aligned to its element type
  DType dtype = DType::kF32;      // of the logits: bf16, fp16 or fp32
  int64_t num_tokens = 0;         // T >= 0
  int64_t num_experts = 0;        // E in [1, kMoeMaxExperts]
  int top_k = 0;                  // k in [1, min(E, kMoeMaxTopK)]
  MoeScoring scoring = MoeScoring::kSoftmax;
  bool renormalize = false;
  int32_t* topk_ids = nullptr;    // out: [T, k] device memory, 4-byte aligned
  float* topk_weights = nullptr;  // out: [T, k] device memory, 4-byte aligned
};
// The host checks, each an invalid_argument: T, E or k outside the ranges above, an unknown dtype
// or scoring, null or misaligned pointers (when T > 0), outputs overlapping the logits or each
// other. No CUDA call; moe_topk makes them first.
Status moe_topk_can_implement(const MoeTopkArgs& args);
Status moe_topk(const MoeTopkArgs& args, cudaStream_t stream);

// ---- moe_layer: the whole MoE FFN step in one kernel ----------------------------------------------
// out[t] = sum over t's routed slots j, in slot order, of w[t,j] * FFN_e(x[t]) with
// FFN_e(x) = (silu(x Wg_e^T) * (x Wu_e^T)) Wd_e^T for slot j's expert e; one persistent kernel
// does the dispatch, the gate/up GEMM with the SwiGLU epilogue, the down GEMM and the weighted
// combine, each step starting on a tile row as soon as its inputs are there (docs/MOE.md, "The
// full layer"): no phase waits for the whole previous one. The weights w are the routing's
// (moe_routing's topk_weights, 1 when none were given); fp32 accumulation in both GEMMs and in the
// combine, one rounding per GEMM output (hidden, expert_out) and one for out.
//
// Equal, bit for bit, to moe_dispatch_gemm (kSwiGLU, gate_up, out = hidden) -> grouped_gemm
// (hidden, down, expert_out; offsets = expert_offsets, M_total = capacity) -> moe_combine with the
// same tile; recv_x is written exactly as moe_dispatch writes it. Across nodes as those calls
// (docs/MOE.md, "The full layer across nodes"): each token row crosses the network once per node
// and each node's partial sum once back; unsupported when the network flag window cannot hold
// both the dispatch's and the combine's flags of one call.
//
// Shared expert (optional: both shared weights given): every token of this rank also goes through
// one dense SwiGLU FFN of the same intermediate size I (DeepSeek-V3's, Llama 4's), added with
// weight 1 after the routed sum (still one rounding for out):
//   out[t] = (sum over slots j of w[t,j] * FFN_e(x[t])) + FFN_shared(x[t]).
// Its rows live in hidden and expert_out after the receive rows, so those two buffers need
// moe_layer_rows(capacity, max_tokens, true) rows; its tiles run first in the kernel's queue,
// overlapping the dispatch. (A wider shared FFN, Is = s * I as DeepSeek-V2's two shared experts,
// is not taken: shared_gate_up must be [2I, H]; run the rest of it beside the layer.)
struct MoeLayerWeights {
  const void* gate_up = nullptr;  // this rank's E/W experts: [E/W, 2I, H], gate and up rows
                                  // interleaved by 8 as MoeExpertGemm's kSwiGLU (loom.torch.swiglu_weights)
  const void* down = nullptr;     // [E/W, H, I]
  int64_t intermediate = 0;       // I: a positive multiple of 8
  const void* shared_gate_up = nullptr;  // the shared expert: [2I, H], interleaved as gate_up; null: none
  const void* shared_down = nullptr;     // [H, I]; null exactly when shared_gate_up is
};
struct MoeLayerBuffers {
  void* recv_x = nullptr;      // symmetric [capacity, H] (as moe_dispatch's)
  void* hidden = nullptr;      // [rows, I], device memory of this GPU
  void* expert_out = nullptr;  // symmetric [rows, H]
  // rows = moe_layer_rows(capacity, config.max_tokens, shared expert or not): capacity without one.
};
// The rows of moe_layer's hidden and expert_out: capacity (MoeSizes::capacity), or with a shared
// expert align_up(capacity, 128) + max_tokens (its rows start at a whole tile row).
int64_t moe_layer_rows(int64_t capacity, int64_t max_tokens, bool shared_expert);
struct MoeLayerOptions {
  GemmTile tile = GemmTile::kAuto;  // k128x256 or k128x128, both GEMMs (the planner picks one)
  int num_ctas = 0;                 // persistent CTAs, one per SM; 0: every SM
  int push_ctas = 0;                // CTAs that push rows first (then compute); 0: planner
  int arrival_ctas = 0;             // CTAs that complete receive blocks first (then compute); 0: planner
  bool swap_tails = true;           // as GroupedGemmOptions::swap_tails, both GEMMs (false: A/B timing)
  bool expert_groups = true;        // as GroupedGemmOptions::expert_groups, both GEMMs (false: A/B timing)
  // Diagnostics (loom/diagnostics.h): device memory for one MoeLayerPhaseRecord per SM of the GPU,
  // 8-byte aligned; each CTA of the launch fills its own record. null: none (nothing measured).
  MoeLayerPhaseRecord* phases = nullptr;
};
// x: [T, H], out: [T, H], both device memory of this GPU in config.dtype (bf16 or fp16); the
// weights in config.dtype, 16-byte aligned. Everything moe_dispatch_gemm checks, for both GEMMs,
// plus (invalid_argument) null or misaligned weights and buffers, buffers overlapping each other,
// x, out or the weights; only one of the shared weights given. When the routing failed nothing is
// written (moe_report says why); with MoeOverflow::kDrop, dropped slots add nothing.
Status moe_layer(Communicator& comm, const MoePlan& plan, const void* x, const MoeLayerWeights& weights,
                 const MoeLayerBuffers& buffers, void* out, cudaStream_t stream, const MoeLayerOptions& options = {});

}  // namespace loom
