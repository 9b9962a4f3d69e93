#include "ops/launch/family_resources.h"

#include <string>
#include <utility>

#include "core/log.h"
#include "runtime/cuda_check.h"

namespace loom::ops {

Result<LaunchState*> family_launch_state(Communicator::Impl& impl, std::string_view family) {
  LOOM_ASSIGN_OR_RETURN(Communicator::Impl::OperatorFamily * f, impl.family(family));
  return f->launch_state;
}

Result<void*> family_workspace(Communicator::Impl& impl, std::string_view family, size_t bytes, cudaStream_t stream,
                               const char* op) {
  LOOM_ASSIGN_OR_RETURN(Communicator::Impl::OperatorFamily * f, impl.family(family));
  void*& ws = f->workspace;
  size_t& ws_bytes = f->workspace_bytes;
  if (bytes <= ws_bytes) return ws;
  const std::string what = "the '" + std::string(family) + "' family's workspace";
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  LOOM_CUDA_TRY(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    return Status::unsupported(std::string(op) + ": " + what + " must grow to " + std::to_string(bytes) +
                               " bytes, which cannot happen during CUDA graph capture; run the operation once with "
                               "its largest shape before capturing");
  }
  if (impl.workspace_captured && ws != nullptr) {
    return Status::unsupported(std::string(op) + ": " + what + " must grow to " + std::to_string(bytes) +
                               " bytes, but a CUDA graph captured earlier uses the current one (it would write into "
                               "freed memory on replay); run the largest shape once before capturing");
  }
  constexpr size_t kGranule = size_t{2} << 20;
  const size_t rounded = (bytes + kGranule - 1) / kGranule * kGranule;
  LOOM_CUDA_TRY(cudaSetDevice(impl.device));
  LOOM_TRY(impl.wait_for_queued_work(op, impl.settings.op_timeout + std::chrono::seconds(1)));
  if (ws != nullptr) {
    LOOM_TRY_CTX(impl.heap->release(ws), std::string(op) + ": releasing " + what);
    ws = nullptr;
    ws_bytes = 0;
  }
  Result<void*> grown = impl.heap->allocate(rounded);
  if (!grown.ok()) {
    return std::move(grown).take_status().with_context(std::string(op) + ": allocating " + std::to_string(rounded) +
                                                        " bytes for " + what +
                                                        " in the symmetric heap (raise LOOM_HEAP_BYTES)");
  }
  ws = *grown;
  ws_bytes = rounded;
  f->staged = 0;  // what the old workspace held is gone
  LOOM_DEBUG("%s: %s grown to %zu bytes at heap offset %llu", op, what.c_str(), rounded,
             static_cast<unsigned long long>(impl.heap->offset_of(ws)));
  return ws;
}

}  // namespace loom::ops
