// The launch signatures ranks compare (docs/SECURITY.md, "Cross-rank consistency"), computed here
// and nowhere else.
//
// Every loom launch publishes entry_word(epoch, signature) to its peers and, before its first
// write into (or read from) a peer, checks the peer's word for the same launch
// (kernels/comm/entry.cuh): a different signature fails the launch with invalid_argument on every
// rank involved, before any data has moved between them, and the error says which rank called what
// (runtime/call_log.h keeps this process's side; the peer's own report names its side). A
// signature is 32 bits of FNV-1a over the operator and what must agree between ranks: shapes,
// dtype, the options and plan choices that decide which flags and buffers peers use, and the heap
// offsets at which peers address this rank's buffers. Two different calls collide with probability
// 2^-32.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "loom/types.h"
#include "runtime/call_log.h"
#include "runtime/device_abi.h"

namespace loom::ops {

// The signature of a call of `op` with `fields` (the hash covers op and the values in order; the
// names are for messages). Remembers the call for messages.
uint32_t call_signature(OpId op, std::initializer_list<CallField> fields);

// A fused operator's plan (the TP kernels, one node or several): its tile, its world (a code that
// tells one node's plans from multi-node ones) and the positional values that must agree.
uint32_t fused_plan_signature(OpId op, int tile, int world, std::initializer_list<int64_t> values);
// A launch described by positional values only (the MoE kernels: planner::moe_signature).
uint32_t values_signature(OpId op, std::initializer_list<int64_t> values);

// A collective launch (all_gather, reduce_scatter, all_reduce) serving `label` (the collective
// itself, or the decomposed TP operator it is part of, whose own signature is `outer`; 0 for a
// plain collective): payload bytes, dtype, CTAs (the plan: each CTA owns a chunk flag), the copy
// engine, and the heap offsets of send and recv.
uint32_t collective_signature(OpId label, uint32_t outer, uint64_t bytes, DType dtype, int ctas, int engine,
                              uint64_t send_offset, uint64_t recv_offset);

// A TP operator run decomposed (collective + local GEMM): what must agree between ranks — M, the
// dimension the collective carries (K for ag_gemm, N for gemm_rs and gemm_ar; the other may differ
// per rank), dtype and B's layout.
uint32_t decomposed_tp_signature(OpId op, int64_t m, int64_t n, int64_t k, DType dtype, int b_layout, int world);
// The same from a TpGemmArgs (loom/tensor_parallel.h; a template, so this header needs no CUDA).
template <class Args>
uint32_t decomposed_tp_signature(OpId op, const Args& a, int world) {
  return decomposed_tp_signature(op, a.m, a.n, a.k, a.dtype, static_cast<int>(a.b_layout), world);
}

}  // namespace loom::ops
