// Launch signatures (ops/launch/signature.h) and entry words (runtime/device_abi.h): what ranks
// compare before any data moves (docs/SECURITY.md, "Cross-rank consistency", reliability.md B1, B2,
// H9). Every field that must agree changes the 32-bit signature; the fields that may differ per
// rank (a decomposed ag_gemm's N, gemm_rs's K) do not; the call log says what a signature was; an
// entry word passes for its launch and the few after it, never for a stale or zero word, also
// across the 2^32 wrap of the epoch bits it keeps.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <string>

#include "ops/launch/signature.h"
#include "runtime/call_log.h"
#include "runtime/device_abi.h"

namespace loom {
namespace {

using ops::collective_signature;
using ops::decomposed_tp_signature;
using ops::fused_plan_signature;

TEST(LaunchSignature, EveryFieldThatMustAgreeChangesIt) {
  std::set<uint32_t> seen;
  auto distinct = [&](uint32_t s) { return seen.insert(s).second; };
  const uint32_t base = collective_signature(OpId::kAllReduce, 0, 4096, DType::kBF16, 8, 0, 1 << 20, 2 << 20);
  EXPECT_TRUE(distinct(base));
  EXPECT_EQ(collective_signature(OpId::kAllReduce, 0, 4096, DType::kBF16, 8, 0, 1 << 20, 2 << 20), base) << "deterministic";
  EXPECT_TRUE(distinct(collective_signature(OpId::kAllGather, 0, 4096, DType::kBF16, 8, 0, 1 << 20, 2 << 20))) << "op";
  EXPECT_TRUE(distinct(collective_signature(OpId::kAllReduce, 7, 4096, DType::kBF16, 8, 0, 1 << 20, 2 << 20))) << "outer call";
  EXPECT_TRUE(distinct(collective_signature(OpId::kAllReduce, 0, 4098, DType::kBF16, 8, 0, 1 << 20, 2 << 20))) << "bytes";
  EXPECT_TRUE(distinct(collective_signature(OpId::kAllReduce, 0, 4096, DType::kF16, 8, 0, 1 << 20, 2 << 20))) << "dtype";
  EXPECT_TRUE(distinct(collective_signature(OpId::kAllReduce, 0, 4096, DType::kBF16, 16, 0, 1 << 20, 2 << 20))) << "CTAs";
  EXPECT_TRUE(distinct(collective_signature(OpId::kAllReduce, 0, 4096, DType::kBF16, 8, 1, 1 << 20, 2 << 20))) << "engine";
  EXPECT_TRUE(distinct(collective_signature(OpId::kAllReduce, 0, 4096, DType::kBF16, 8, 0, 1 << 21, 2 << 20))) << "send offset";
  EXPECT_TRUE(distinct(collective_signature(OpId::kAllReduce, 0, 4096, DType::kBF16, 8, 0, 1 << 20, 3 << 20))) << "recv offset";

  const uint32_t plan = fused_plan_signature(OpId::kGemmRs, 1, 2, {1024, 512, 0, 4096, 0});
  EXPECT_TRUE(distinct(plan));
  EXPECT_TRUE(distinct(fused_plan_signature(OpId::kGemmAr, 1, 2, {1024, 512, 0, 4096, 0}))) << "op";
  EXPECT_TRUE(distinct(fused_plan_signature(OpId::kGemmRs, 2, 2, {1024, 512, 0, 4096, 0}))) << "tile";
  EXPECT_TRUE(distinct(fused_plan_signature(OpId::kGemmRs, 1, 4, {1024, 512, 0, 4096, 0}))) << "world";
  EXPECT_TRUE(distinct(fused_plan_signature(OpId::kGemmRs, 1, 2, {2048, 512, 0, 4096, 0}))) << "M";
  EXPECT_TRUE(distinct(fused_plan_signature(OpId::kGemmRs, 1, 2, {512, 1024, 0, 4096, 0}))) << "order";
  EXPECT_TRUE(distinct(fused_plan_signature(OpId::kGemmRs, 1, 2, {1024, 512, 0, 4096, 0, 0}))) << "one more value";
  for (uint32_t s : seen) EXPECT_NE(s, 0u) << "a signature is never 0 (a zero entry word means never written)";
}

// The fields of loom::TpGemmArgs the decomposed signature reads (that header needs CUDA's).
struct TpArgs {
  int64_t m = 0, n = 0, k = 0;
  DType dtype = DType::kBF16;
  int b_layout = 0;
};

TEST(LaunchSignature, DecomposedTpCallsCompareWhatMustAgree) {
  TpArgs a;
  a.m = 4096;
  a.n = 1024;
  a.k = 2048;
  TpArgs other_n = a, other_k = a, other_m = a, other_dtype = a;
  other_n.n = 512;
  other_k.k = 1024;
  other_m.m = 2048;
  other_dtype.dtype = DType::kF16;
  // ag_gemm gathers A [M, K]: M and K must agree, each rank's N is its own.
  EXPECT_EQ(decomposed_tp_signature(OpId::kAgGemm, a, 2), decomposed_tp_signature(OpId::kAgGemm, other_n, 2));
  EXPECT_NE(decomposed_tp_signature(OpId::kAgGemm, a, 2), decomposed_tp_signature(OpId::kAgGemm, other_k, 2));
  // gemm_rs / gemm_ar reduce [M, N]: M and N must agree, each rank's K is its own.
  for (OpId op : {OpId::kGemmRs, OpId::kGemmAr}) {
    EXPECT_EQ(decomposed_tp_signature(op, a, 2), decomposed_tp_signature(op, other_k, 2));
    EXPECT_NE(decomposed_tp_signature(op, a, 2), decomposed_tp_signature(op, other_n, 2));
  }
  for (OpId op : {OpId::kAgGemm, OpId::kGemmRs, OpId::kGemmAr}) {
    EXPECT_NE(decomposed_tp_signature(op, a, 2), decomposed_tp_signature(op, other_m, 2));
    EXPECT_NE(decomposed_tp_signature(op, a, 2), decomposed_tp_signature(op, other_dtype, 2));
    EXPECT_NE(decomposed_tp_signature(op, a, 2), decomposed_tp_signature(op, a, 4));
  }
  EXPECT_NE(decomposed_tp_signature(OpId::kGemmRs, a, 2), decomposed_tp_signature(OpId::kGemmAr, a, 2));
  // The collective of a decomposed call carries the call's signature: an all_reduce of the same
  // bytes is not a decomposed gemm_ar's.
  const uint32_t outer = decomposed_tp_signature(OpId::kGemmAr, a, 2);
  EXPECT_NE(collective_signature(OpId::kGemmAr, outer, 8 << 20, DType::kBF16, 8, 0, 0, 0),
            collective_signature(OpId::kAllReduce, 0, 8 << 20, DType::kBF16, 8, 0, 0, 0));
}

TEST(LaunchSignature, TheCallLogSaysWhatASignatureWas) {
  const uint32_t s = collective_signature(OpId::kAllReduce, 0, 4096, DType::kBF16, 8, 0, 65536, 131072);
  EXPECT_EQ(describe_call(s),
            "all_reduce(of_call=0, bytes=4096, dtype=bf16, ctas=8, engine=0, send_offset=65536, recv_offset=131072)");
  const uint32_t plan = fused_plan_signature(OpId::kAgGemm, 2, 4, {1024, 2048});
  EXPECT_EQ(describe_call(plan), "ag_gemm(tile=2, world=4, 1024, 2048)");
  EXPECT_EQ(describe_call(0x12345678u == s ? 0x12345679u : 0x12345678u), "") << "never called here";
  // More distinct calls than the log keeps: the newest are there.
  uint32_t last = 0;
  for (int i = 0; i < static_cast<int>(kCalls) + 10; ++i) {
    last = collective_signature(OpId::kAllGather, 0, 64 + static_cast<uint64_t>(i), DType::kF32, 1, 0, 0, 0);
  }
  EXPECT_NE(describe_call(last).find("bytes=" + std::to_string(64 + kCalls + 9)), std::string::npos) << describe_call(last);
}

TEST(EntryWord, PassesForItsLaunchAndTheFewAfterNeverForAStaleOrZeroWord) {
  const uint32_t sig = 0xabcd1234u;
  const uint64_t e = 1000;
  EXPECT_EQ(entry_signature(entry_word(e, sig)), sig);
  EXPECT_EQ(entry_epoch(entry_word(e, sig)), e);
  EXPECT_TRUE(entry_in(entry_word(e, sig), e));
  EXPECT_FALSE(entry_in(entry_word(e + 1, sig), e));
  EXPECT_TRUE(entry_reached(entry_word(e, sig), e));
  EXPECT_TRUE(entry_reached(entry_word(e + 1, sig), e)) << "a peer one launch ahead";
  EXPECT_TRUE(entry_reached(entry_word(e + kEntryAhead - 1, sig), e));
  EXPECT_FALSE(entry_reached(entry_word(e + kEntryAhead, sig), e));
  EXPECT_FALSE(entry_reached(entry_word(e - 1, sig), e)) << "the peer's previous launch";
  EXPECT_FALSE(entry_reached(0, 1)) << "never written";
  // The word keeps 32 epoch bits: a launch 2^31 or 2^32 - 300 launches back is still stale.
  const uint64_t late = (uint64_t{1} << 33) + 5;
  EXPECT_FALSE(entry_reached(entry_word(late - (uint64_t{1} << 31), sig), late));
  EXPECT_FALSE(entry_reached(entry_word(late - ((uint64_t{1} << 32) - 300), sig), late));
  // Across the wrap of those 32 bits.
  const uint64_t wrap = (uint64_t{1} << 32) - 1;
  EXPECT_TRUE(entry_reached(entry_word(wrap, sig), wrap));
  EXPECT_TRUE(entry_reached(entry_word(wrap + 1, sig), wrap));
  EXPECT_TRUE(entry_reached(entry_word(wrap + 2, sig), wrap + 2));
  EXPECT_FALSE(entry_reached(entry_word(wrap, sig), wrap + 2));
  EXPECT_TRUE(entry_in(entry_word(wrap + 2, sig), wrap + 2));
}

}  // namespace
}  // namespace loom
