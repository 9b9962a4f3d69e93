#include "tests/gpu/harness.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "runtime/communicator_impl.h"

namespace loom::test {
namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

}  // namespace

const Process& process() {
  static const Process p{env_int("RANK", 0), env_int("WORLD_SIZE", 1), env_int("LOCAL_RANK", 0)};
  return p;
}

std::unique_ptr<Communicator> make_comm(const CommOptions& options) {
  Result<std::unique_ptr<Communicator>> comm = Communicator::from_env(options);
  if (!comm.ok()) {
    ADD_FAILURE() << "rank " << process().rank << ": creating a communicator: " << comm.status().to_string();
    return nullptr;
  }
  return std::move(comm).value();
}

namespace {
Communicator* g_shared_comm = nullptr;  // once created
}  // namespace

Communicator& shared_comm() {
  static std::unique_ptr<Communicator> comm = [] {
    CommOptions options;
    uint64_t gib = uint64_t{1} << 30;
    options.heap_bytes = 4 * gib + static_cast<uint64_t>(process().world_size) * gib;
    // Ranks sharing a GPU (every rank of the job on this host's GPUs) split 3/4 of its memory.
    int devices = 0;
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0 &&
        cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      const uint64_t sharing = static_cast<uint64_t>((process().world_size + devices - 1) / devices);
      options.heap_bytes = std::min<uint64_t>(options.heap_bytes, total_bytes / 4 * 3 / sharing);
    }
    if (const char* v = std::getenv("LOOM_TEST_HEAP_BYTES")) options.heap_bytes = std::strtoull(v, nullptr, 10);
    std::unique_ptr<Communicator> c = make_comm(options);
    if (!c) {
      std::fprintf(stderr, "rank %d: cannot create the shared test communicator; stopping\n", process().rank);
      std::_Exit(2);  // a test binary, not the library: no rank can go on without it
    }
    g_shared_comm = c.get();
    return c;
  }();
  return *comm;
}

bool shared_comm_failed() { return g_shared_comm != nullptr && !g_shared_comm->health().ok(); }

bool shared_comm_work_stuck(std::chrono::milliseconds limit) {
  if (!shared_comm_failed()) return false;
  return !internal(*g_shared_comm).wait_for_queued_work("test teardown", limit, /*even_if_failed=*/true).ok();
}

bool all_ranks_agree(Communicator& comm, bool ok) {
  const int32_t mine = ok ? 1 : 0;
  std::vector<int32_t> all(comm.world_size());
  Status s = internal(comm).bootstrap->all_gather(&mine, all.data(), sizeof(mine));
  if (!s.ok()) return false;
  for (int32_t v : all) ok = ok && v == 1;
  return ok;
}

int named_rank(const std::string& message) {
  const std::string key = "waiting for rank ";
  const size_t at = message.find(key);
  if (at == std::string::npos) return -1;
  return std::atoi(message.c_str() + at + key.size());
}

}  // namespace loom::test
