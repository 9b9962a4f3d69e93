// loom::attention: flash-attention forward on one Hopper GPU (the engine ring attention is built
// from). O = softmax(scale * Q K^T) V per (batch, head), O(S) memory, fp32 softmax and
// accumulation, and the fp32 log-sum-exp of every row.
//
// Layouts (element strides may be given; 0 means the contiguous default shown):
//   AttentionLayout::kBSHD     q [B, Sq, Hq, D]   k, v [B, Sk, Hkv, D]   out [B, Sq, Hq, D]
//                              lse [B, Hq, Sq]
//   AttentionLayout::kPacked   q [Tq, Hq, D]      k, v [Tk, Hkv, D]      out [Tq, Hq, D]
//                              lse [Hq, Tq]; sequence b is rows cu_seqlens[b] .. cu_seqlens[b+1]
//                              (device int32 [B + 1]); seqlen_q / seqlen_k give the longest one.
// The innermost dimension (D) must be contiguous; other strides must be multiples of 8 elements
// (16 bytes) and pointers 16-byte aligned.
//
// Masks: non-causal, or causal aligned to the bottom right (query i of a sequence sees key j iff
// j <= i + Sk - Sq, as FlashAttention 2+ and torch's is_causal with Sq == Sk). A row that sees no
// key (Sk = 0, or causal with Sq > Sk) gets O = 0 and LSE = -inf.
// Heads: MHA (Hq == Hkv), GQA and MQA (Hq a multiple of Hkv; q head h reads k/v head h / (Hq/Hkv)).
// Head dims 64, 128 and 256; q, k, v in bf16 or fp16 (one type).
//
// Partial mode (AttentionOptions::partial): out is fp32 (O already divided by its row sum) and lse
// is required; attention_merge() combines several such partials over disjoint key sets (what ring
// attention and split-KV do), in fp32.
//
// Rules, checked before anything is launched: invalid_argument for null or misaligned pointers,
// bad strides or sizes, Hq % Hkv != 0, a non-positive or non-finite scale; unsupported for other
// head dims or dtypes, sizes of 2^31 or more. Packed offsets live on the device: every CTA checks
// them (non-decreasing from >= 0, inside the tensors, no sequence longer than the given maximum)
// before anything is written; bad offsets write nothing, and the next standalone call on the
// device (attention, attention_merge, gemm) or synchronize_standalone() returns invalid_argument.
// Calls are asynchronous on `stream` and capturable in CUDA graphs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "loom/communicator.h"
#include "loom/status.h"
#include "loom/types.h"

namespace loom {

enum class AttentionLayout : uint8_t {
  kBSHD,    // [batch, seq, heads, head_dim]
  kPacked,  // [tokens, heads, head_dim] with cumulative sequence offsets
};
std::string_view attention_layout_name(AttentionLayout layout);  // "bshd", "packed"

// Element strides of one tensor: between consecutive rows (sequence positions), heads, batches.
// All 0: contiguous in the layout's default order.
struct AttentionStrides {
  int64_t row = 0, head = 0, batch = 0;
};

struct AttentionArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;   // dtype, or fp32 in partial mode
  float* lse = nullptr;  // optional (required in partial mode)
  DType dtype = DType::kBF16;
  AttentionLayout layout = AttentionLayout::kBSHD;
  int64_t batch = 0;                  // B (packed: the number of sequences)
  int64_t seqlen_q = 0, seqlen_k = 0;  // kBSHD: Sq, Sk; kPacked: the longest sequence of each
  int64_t total_q = 0, total_k = 0;    // kPacked: Tq, Tk (rows of q and of k/v)
  int64_t heads_q = 0, heads_kv = 0;
  int64_t head_dim = 0;
  const int32_t* cu_seqlens_q = nullptr;  // kPacked: device [batch + 1]
  const int32_t* cu_seqlens_k = nullptr;
  AttentionStrides q_strides, k_strides, v_strides, out_strides;
};

struct AttentionOptions {
  bool causal = false;
  float scale = 0.f;     // softmax scale; 0: 1 / sqrt(head_dim)
  bool partial = false;  // out in fp32 for attention_merge (lse required)
  int num_ctas = 0;      // persistent CTAs; 0: min(tiles, SM count)
  int block_n = 0;       // keys per block (tuning): 0 = the planner's (hd64: 128 below 2K keys,
                         // else 192; hd128: 176; hd256: 80); or hd64: 128, 192; hd128: 128, 176;
                         // hd256: 64, 80
  int block_m = 0;       // query rows per tile (tuning): 0 = the planner's (hd64 with block_n 0:
                         // 192 from 512 queries, 2K under a causal mask; else 128); or 128, or
                         // 192 at hd64 with block_n 0 or 128 (three consumer warpgroups)
};

// What a call launches (for sizing and reports).
struct AttentionPlanInfo {
  int block_m = 0, block_n = 0, stages = 0, threads = 0;
  size_t smem_bytes = 0;
  int64_t tiles = 0;  // query tiles (batch x heads x ceil(seqlen_q / block_m))
  int grid = 0;       // persistent CTAs
};

// ---- plan and workspace, before a call (e.g. before CUDA-graph capture) ------------------------
// Checks everything that can be checked without a GPU (no CUDA call is made).
Status attention_can_implement(const AttentionArgs& args, const AttentionOptions& options = {});
// attention_can_implement's checks, then the plan for the current device.
Result<AttentionPlanInfo> attention_plan(const AttentionArgs& args, const AttentionOptions& options = {});
// Scratch memory a call needs: none (the kernel keeps everything in registers and shared memory).
constexpr size_t attention_workspace_bytes(const AttentionArgs&, const AttentionOptions& = {}) { return 0; }

Status attention(const AttentionArgs& args, cudaStream_t stream, const AttentionOptions& options = {});

// Combines `num_partials` partial-mode results over disjoint key sets of the same queries:
//   lse = log sum_i exp(lse_i),  out = sum_i exp(lse_i - lse) * out_i   (fp32; rows where every
// lse_i is -inf get out = 0, lse = -inf). Contiguous tensors: partial_out [n, batch, seq, heads,
// head_dim] fp32, partial_lse [n, batch, heads, seq]; out [batch, seq, heads, head_dim] in
// out_dtype (bf16, fp16 or fp32); lse [batch, heads, seq] (optional). A packed layout is batch 1,
// seq = tokens.
struct AttentionMergeArgs {
  const float* partial_out = nullptr;
  const float* partial_lse = nullptr;
  int64_t num_partials = 0;
  void* out = nullptr;
  float* lse = nullptr;
  DType out_dtype = DType::kBF16;
  int64_t batch = 0, seqlen = 0, heads = 0, head_dim = 0;
};
Status attention_merge_can_implement(const AttentionMergeArgs& args);
Status attention_merge(const AttentionMergeArgs& args, cudaStream_t stream);

// ---- ring attention: sequence parallelism over the ranks of a job ---------------------------------
//
// Rank r of W (= comm.world_size(); across nodes r = node * L + local index, which the call
// requires of the communicator's numbering) holds its chunk of every sequence: q [B, S_l, Hq, D],
// k and v [B, S_l, Hkv, D] (contiguous); it gets out [B, S_l, Hq, D] (and lse [B, Hq, S_l], fp32)
// = attention of its queries over the keys of all W chunks. Non-causal: any assignment of chunks
// to ranks. Causal: the zigzag layout — the sequence of W * S_l rows is cut into 2W chunks of
// S_l / 2, and rank r holds chunks r and 2W-1-r (in that order), which balances the causal work;
// zigzag_shard / zigzag_unshard in loom.torch move a whole sequence into and out of that layout.
// One persistent kernel per call: K/V chunks travel around the ring over NVLink (each rank's K/V
// reaches every other rank) while the attention engine starts every query tile on its own keys and
// takes the others' as they arrive, merging in fp32 registers. Across nodes each rank's K/V crosses
// the network once per other node, to the GPU with its local index there (through the proxy),
// and then travels around that node's ring. Collective: every rank calls it with the same shapes
// and options (compared at the kernel's entry: a mismatch fails the launch). The attention
// family's symmetric workspace holds every rank's K/V (ring_attention_workspace_bytes with
// world = W).
struct RingAttentionArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // optional
  DType dtype = DType::kBF16;
  int64_t batch = 0;
  int64_t seqlen = 0;  // S_l: this rank's rows of every sequence (the same on every rank; even when causal)
  int64_t heads_q = 0, heads_kv = 0, head_dim = 0;
};

struct RingAttentionOptions {
  bool causal = false;  // zigzag layout (above)
  float scale = 0.f;    // 0: 1 / sqrt(head_dim)
  int kv_ctas = 0;      // CTAs that push K/V before they compute (0: the planner's; W = 1: none)
  int block_n = 0;      // 0: as AttentionOptions::block_n's default; else only the ring's own builds
                        // (hd64: 128, 192; hd128: 176; hd256: 80; others: invalid_argument)
};

// ---- plan and workspace, before a call (e.g. before CUDA-graph capture) ------------------------
// A call takes its workspace from loom's symmetric heap and grows it when a shape needs more; a
// growth cannot happen inside a capture, so reserve the largest shape first.
//
// Checks everything that can be checked without a GPU for a ring of `world` ranks.
Status ring_attention_can_implement(const RingAttentionArgs& args, const RingAttentionOptions& options, int world);
// The symmetric workspace a call needs on every rank (every rank's K and V, and arrival flags;
// none for a ring of one).
size_t ring_attention_workspace_bytes(const RingAttentionArgs& args, int world);

// What a call launches on this communicator.
struct RingAttentionPlanInfo {
  AttentionPlanInfo engine;    // the attention engine's plan for this rank's queries and one K/V chunk
  int grid = 0;                // persistent CTAs (one per SM)
  int kv_ctas = 0;             // of those, the CTAs that push K/V before they compute
  size_t workspace_bytes = 0;  // ring_attention_workspace_bytes(args, W)
};
// The call's checks but where its buffers live (the pointers must be set and aligned as for the
// call, but are not looked up: placeholders work before allocating), then the plan.
Result<RingAttentionPlanInfo> ring_attention_plan(Communicator& comm, const RingAttentionArgs& args,
                                                  const RingAttentionOptions& options = {});
// Grows loom's symmetric workspace to what the call needs (stream: where the growth waits for
// earlier work). Collective like the call itself: every rank reserves the same shapes in order.
Status ring_attention_reserve_workspace(Communicator& comm, const RingAttentionArgs& args, cudaStream_t stream,
                                        const RingAttentionOptions& options = {});

Status ring_attention(Communicator& comm, const RingAttentionArgs& args, cudaStream_t stream,
                      const RingAttentionOptions& options = {});

// Waits for `stream` (bounded by LOOM_TIMEOUT_MS) and returns what a standalone launch (attention,
// attention_merge, gemm) on the current device recorded since the last such check: bad packed
// offsets (invalid_argument), or a device-side failure (internal).
Status synchronize_standalone(cudaStream_t stream);

}  // namespace loom
