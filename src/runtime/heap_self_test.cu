#include "runtime/heap_self_test.h"

#include <vector>

#include "kernels/comm/self_test.cuh"
#include "runtime/cuda_check.h"

namespace loom::runtime {

Status launch_heap_self_test_writes(const HeapSelfTestParams& params, cudaStream_t stream) {
  const uint32_t words = static_cast<uint32_t>(params.local_world) * kernels::kSelfTestWords;
  const uint32_t threads = words < 1024 ? words : 1024;
  kernels::heap_self_test_write_kernel<<<1, threads, 0, stream>>>(
      params.device_peer_bases, static_cast<uint32_t>(params.local_rank), static_cast<uint32_t>(params.local_world),
      params.self_test_offset, params.nonce, params.flip_bits);
  LOOM_CUDA_TRY_LAUNCH();
  return Status::ok_status();
}

Result<HeapSelfTestFinding> check_heap_self_test(const HeapSelfTestParams& params) {
  const size_t words = static_cast<size_t>(params.local_world) * kernels::kSelfTestWords;
  std::vector<uint64_t> area(words);
  LOOM_CUDA_TRY(cudaMemcpy(area.data(), static_cast<const char*>(params.local_base) + params.self_test_offset,
                           words * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  HeapSelfTestFinding finding;
  for (uint32_t writer = 0; writer < static_cast<uint32_t>(params.local_world); ++writer) {
    for (uint32_t word = 0; word < kernels::kSelfTestWords; ++word) {
      const uint64_t expected =
          kernels::self_test_word(writer, static_cast<uint32_t>(params.local_rank), word, params.nonce);
      const uint64_t observed = area[writer * kernels::kSelfTestWords + word];
      if (observed != expected) {
        finding.bad_writer = static_cast<int32_t>(writer);
        finding.word = word;
        finding.expected = expected;
        finding.observed = observed;
        return finding;
      }
    }
  }
  return finding;
}

}  // namespace loom::runtime
