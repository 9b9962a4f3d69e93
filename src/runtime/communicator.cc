#include "loom/communicator.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/env.h"
#include "core/log.h"
#include "runtime/call_log.h"
#include "runtime/communicator_impl.h"
#include "runtime/cuda_check.h"
#include "runtime/cuda_driver.h"
#include "runtime/names.h"
#include "runtime/network_layout.h"

namespace loom {
namespace {

std::string hex32(uint32_t value) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08x", value);
  return text;
}

// Capacity of per-source chunk flags in the control region: an upper bound on the CTAs (or
// tiles, row blocks) one operator can publish per source rank in one launch.
constexpr uint32_t kMaxChunksPerSource = 4096;

// Capacity of the fused operators' flags in the control region (1 MiB): entry words plus one
// flag per row chunk (ag_gemm) or per output tile (gemm_rs: M/BM * N/BN; gemm_ar: twice that),
// e.g. gemm_ar M = N = 16384 with 128 x 128 tiles needs 32768 + a few. Operators whose shape needs
// more are refused with a message naming the need (src/ops/tp/tp_common.h check_flag_capacity).
constexpr uint32_t kMaxOpFlags = 1u << 17;

std::string host_identity() {
  char host[64] = {};
  gethostname(host, sizeof(host) - 1);
  // Two containers can share a hostname; the boot id separates machines that do.
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  std::string id = std::string(host) + "/" + boot.substr(0, 8);
  return id;
}

// The CUDA device of a rank: options.device, else LOCAL_RANK, else rank mod the visible devices.
// In the shared-GPU mode several local ranks take turns on the visible devices (round-robin).
Result<int> pick_device(const CommOptions& options, int rank, int ranks_per_gpu) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver || count == 0) {
    cudaGetLastError();
    return Status::unsupported("no CUDA GPU is visible to this process (cudaGetDeviceCount: " +
                               std::string(cudaGetErrorString(err)) + ")");
  }
  LOOM_CUDA_TRY(err);
  int device = options.device;
  if (device < 0) {
    if (std::optional<std::string> local = env::get_raw("LOCAL_RANK")) {
      LOOM_ASSIGN_OR_RETURN(int64_t lr, env::parse_int("LOCAL_RANK", *local, 0, 1 << 20));
      device = ranks_per_gpu > 1 ? static_cast<int>(lr % count) : static_cast<int>(lr);
    } else {
      device = rank % count;
    }
  }
  if (device >= count) {
    return Status::invalid_argument("device " + std::to_string(device) + " requested but only " +
                                    std::to_string(count) + " CUDA devices are visible" +
                                    (ranks_per_gpu > 1 ? std::string()
                                                       : std::string(" (LOOM_RANKS_PER_GPU=n lets n ranks share one GPU, "
                                                                     "for correctness runs)")));
  }
  return device;
}

Result<runtime::RankDescriptor> describe_self(int device, int sm_count, int ranks_per_gpu) {
  runtime::RankDescriptor d{};
  std::snprintf(d.host_id, sizeof(d.host_id), "%s", host_identity().c_str());
  LOOM_CUDA_TRY(cudaDeviceGetPCIBusId(d.pci_bus_id, sizeof(d.pci_bus_id), device));
  d.device = device;
  d.local_rank_hint = -1;
  if (std::optional<std::string> local = env::get_raw("LOCAL_RANK")) {
    LOOM_ASSIGN_OR_RETURN(int64_t lr, env::parse_int("LOCAL_RANK", *local, 0, 1 << 20));
    d.local_rank_hint = static_cast<int32_t>(lr);
  }
  d.sm_count = sm_count;
  d.pid = static_cast<int32_t>(getpid());
  d.ranks_per_gpu = ranks_per_gpu;
  return d;
}

// Runs `step`; on failure tells the peers (so they fail now, not at their deadline).
Status collective_step(runtime::Bootstrap& bootstrap, Status status, const char* what) {
  if (!status.ok()) {
    status.with_context(what);
    bootstrap.report_failure(status.to_string());
  }
  return status;
}

// The options take the environment's ranges (0 keeps the environment's value). Checked before
// anything else, so a bad option is refused alike on every rank without touching the network.
Status check_comm_options(const CommOptions& options) {
  if (options.device < -1) {
    return Status::invalid_argument("CommOptions::device = " + std::to_string(options.device) +
                                    ": -1 picks LOCAL_RANK (else rank % device count), otherwise a CUDA device ordinal");
  }
  constexpr int64_t kDayMs = env::kMaxTimeoutMs;
  const std::pair<const char*, int64_t> timeouts[] = {{"op_timeout", options.op_timeout.count()},
                                                      {"bootstrap_timeout", options.bootstrap_timeout.count()}};
  for (const auto& [name, ms] : timeouts) {
    if (ms < 0 || ms > kDayMs) {
      return Status::invalid_argument(std::string("CommOptions::") + name + " = " + std::to_string(ms) +
                                      " ms is outside [0, " + std::to_string(kDayMs) + "] (0: LOOM_TIMEOUT_MS / "
                                      "LOOM_BOOTSTRAP_TIMEOUT_MS or their defaults)");
    }
  }
  if (options.heap_bytes != 0 && (options.heap_bytes < (uint64_t{1} << 20) || options.heap_bytes > (uint64_t{1} << 40))) {
    return Status::invalid_argument("CommOptions::heap_bytes = " + std::to_string(options.heap_bytes) +
                                    " is outside [1 MiB, 1 TiB] (0: LOOM_HEAP_BYTES or its default)");
  }
  if (options.ranks_per_gpu < 0 || options.ranks_per_gpu > env::kMaxRanksPerGpu) {
    return Status::invalid_argument("CommOptions::ranks_per_gpu = " + std::to_string(options.ranks_per_gpu) +
                                    " is outside [0, " + std::to_string(env::kMaxRanksPerGpu) +
                                    "] (0: LOOM_RANKS_PER_GPU or 1)");
  }
  return Status::ok_status();
}

// How a rank joins the job's bootstrap (from the environment or a unique id), and how a rank that
// cannot start tells the others instead (Bootstrap::announce_failure). A zero timeout means the
// launch's own (LOOM_BOOTSTRAP_TIMEOUT_MS as the bootstrap read it, or its default).
struct Joining {
  std::function<Result<std::unique_ptr<runtime::Bootstrap>>(std::chrono::milliseconds)> connect;
  std::function<Status(std::chrono::milliseconds, const Status&)> announce;
};

Result<std::unique_ptr<Communicator::Impl>> build(const CommOptions& options, const Joining& joining, int rank_for_device) {
  auto impl = std::make_unique<Communicator::Impl>();
  bool settings_read = false;
  // Everything before the bootstrap: a rank that fails here (a bad setting, no GPU) still joins to
  // tell the others, who then fail at once naming it instead of waiting for their deadline.
  Status local = [&]() -> Status {
    LOOM_ASSIGN_OR_RETURN(impl->settings, env::Settings::from_env());
    set_log_level(impl->settings.log_level);
    if (std::string unknown = env::unknown_loom_variables(); !unknown.empty()) {
      LOOM_WARN("unknown LOOM_* variables (typos?): %s", unknown.c_str());
    }
    // The network's variables too, before any collective step: a bad value fails here, alike on
    // every rank that has it.
    LOOM_ASSIGN_OR_RETURN(impl->net_settings, runtime::net::NetworkSettings::from_env());
    if (options.heap_bytes != 0) impl->settings.heap_bytes = options.heap_bytes;
    if (options.op_timeout.count() > 0) impl->settings.op_timeout = options.op_timeout;
    if (options.bootstrap_timeout.count() > 0) impl->settings.bootstrap_timeout = options.bootstrap_timeout;
    if (options.ranks_per_gpu > 0) impl->settings.ranks_per_gpu = options.ranks_per_gpu;
    settings_read = true;

    LOOM_ASSIGN_OR_RETURN(impl->device, pick_device(options, rank_for_device, impl->settings.ranks_per_gpu));
    LOOM_CUDA_TRY(cudaSetDevice(impl->device));
    cudaDeviceProp prop{};
    LOOM_CUDA_TRY(cudaGetDeviceProperties(&prop, impl->device));
    if (prop.major != 9) {
      return Status::unsupported("loom's kernels are built for Hopper (sm_90a); device " + std::to_string(impl->device) +
                                 " (" + prop.name + ") is sm_" + std::to_string(prop.major) +
                                 std::to_string(prop.minor));
    }
    impl->sm_count = prop.multiProcessorCount;
    return {};
  }();
  if (!local.ok()) {
    const std::chrono::milliseconds timeout = settings_read ? impl->settings.bootstrap_timeout : options.bootstrap_timeout;
    return joining.announce(timeout, local);
  }

  LOOM_ASSIGN_OR_RETURN(impl->bootstrap, joining.connect(impl->settings.bootstrap_timeout));
  runtime::Bootstrap& boot = *impl->bootstrap;
  set_log_rank(boot.rank());

  // Topology from every rank's self-description.
  Result<runtime::RankDescriptor> self = describe_self(impl->device, impl->sm_count, impl->settings.ranks_per_gpu);
  LOOM_TRY(collective_step(boot, self.status(), "describing this rank"));
  std::vector<runtime::RankDescriptor> all(boot.world_size());
  LOOM_TRY_CTX(boot.all_gather(&self.value(), all.data(), sizeof(runtime::RankDescriptor)), "exchanging rank descriptors");
  Result<runtime::Topology> topology = runtime::build_topology(all, boot.rank(), impl->net_settings.emulate_nodes);
  LOOM_TRY(collective_step(boot, topology.status(), "building the topology"));
  impl->topology = std::move(topology).value();
  if (std::optional<std::string> lws = env::get_raw("LOCAL_WORLD_SIZE")) {
    Result<int64_t> n = env::parse_int("LOCAL_WORLD_SIZE", *lws, 1, 1 << 20);
    Status s = n.status();
    // The launcher counts the ranks of the physical host; emulated nodes split them evenly.
    const int host_ranks = impl->topology.local_world_size * impl->net_settings.emulate_nodes;
    if (s.ok() && *n != host_ranks) {
      s = Status::invalid_argument("LOCAL_WORLD_SIZE=" + *lws + " but " + std::to_string(host_ranks) +
                                   " ranks share this host");
    }
    LOOM_TRY(collective_step(boot, s, "checking LOCAL_WORLD_SIZE"));
  }

  // Symmetric heap: control region first, then user allocations.
  impl->control =
      make_control_layout(static_cast<uint32_t>(impl->topology.local_world_size), kMaxChunksPerSource, kMaxOpFlags);
  runtime::HeapOptions heap_options;
  heap_options.bytes = impl->settings.heap_bytes;
  heap_options.backend = impl->settings.heap_backend;
  heap_options.device = impl->device;
  heap_options.reserved_prefix_bytes = impl->control.bytes;
  // Across nodes the network flag window joins the prefix: peers' data keys cover only what lies
  // after it (runtime/network_layout.h).
  const uint64_t net_window = runtime::net::net_window_offset(impl->control.bytes);
  if (impl->topology.num_nodes > 1) heap_options.reserved_prefix_bytes = net_window + runtime::net::net_window_bytes();
  heap_options.self_test_offset = impl->control.self_test_offset;
  heap_options.timeout = impl->settings.bootstrap_timeout;
  LOOM_ASSIGN_OR_RETURN(impl->heap, runtime::SymmetricHeap::create(boot, impl->topology, heap_options));

  // Device state.
  Status state = [&]() -> Status {
    LOOM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&impl->epoch_state), sizeof(EpochState)));
    LOOM_CUDA_TRY(cudaMemset(impl->epoch_state, 0, sizeof(EpochState)));
    LOOM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&impl->device_abort), sizeof(uint32_t)));
    LOOM_CUDA_TRY(cudaMemset(impl->device_abort, 0, sizeof(uint32_t)));
    LOOM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&impl->launch_states), sizeof(LaunchState) * Communicator::Impl::kMaxFamilies));
    LOOM_CUDA_TRY(cudaMemset(impl->launch_states, 0, sizeof(LaunchState) * Communicator::Impl::kMaxFamilies));
    LOOM_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&impl->error_host), sizeof(ErrorRecord), cudaHostAllocMapped));
    std::memset(impl->error_host, 0, sizeof(ErrorRecord));
    LOOM_CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&impl->error_device), impl->error_host, 0));
    LOOM_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&impl->host_abort_host), sizeof(uint32_t), cudaHostAllocMapped));
    *impl->host_abort_host = 0;
    LOOM_CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&impl->host_abort_device), impl->host_abort_host, 0));
    LOOM_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&impl->progress_host), sizeof(CtaProgress) * kProgressSlots,
                                cudaHostAllocMapped));
    std::memset(impl->progress_host, 0, sizeof(CtaProgress) * kProgressSlots);
    LOOM_CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&impl->progress_device), impl->progress_host, 0));
    LOOM_CUDA_TRY(cudaEventCreateWithFlags(&impl->sync_event, cudaEventDisableTiming));
    LOOM_CUDA_TRY(cudaStreamCreateWithFlags(&impl->probe_stream, cudaStreamNonBlocking));
    LOOM_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&impl->probe_words), Communicator::Impl::kProbeWords * sizeof(uint64_t),
                                cudaHostAllocDefault));
    LOOM_CUDA_TRY(cudaDeviceSynchronize());
    return {};
  }();
  LOOM_TRY(collective_step(boot, state, "allocating device state"));

  // More than one node: the inter-node path (runtime/network.h), collective over every rank.
  if (impl->topology.num_nodes > 1) {
    runtime::net::NetworkOptions net_options;
    net_options.device = impl->device;
    net_options.gpu_pci_bus_id = self->pci_bus_id;
    net_options.settings = impl->net_settings;
    net_options.timeout = impl->settings.bootstrap_timeout;
    net_options.window_offset = net_window;
    // A lane that stops turning for longer than a device wait may last is reported as stalled.
    net_options.stall_limit = std::max(std::chrono::milliseconds(2000), impl->settings.op_timeout / 2);
    LOOM_ASSIGN_OR_RETURN(impl->network, runtime::net::Network::create(boot, impl->topology, *impl->heap, net_options));
  }
  LOOM_TRY_CTX(boot.barrier(), "final init barrier");
  // From now on a failure anywhere reaches every rank (runtime/watchdog.h).
  LOOM_TRY(impl->start_watchdog());
  LOOM_INFO("communicator ready: rank %d/%d, node %d/%d, local rank %d/%d, device %d, heap %llu MiB (%s)%s%s",
            boot.rank(), boot.world_size(), impl->topology.node, impl->topology.num_nodes, impl->topology.local_rank,
            impl->topology.local_world_size, impl->device,
            static_cast<unsigned long long>(impl->settings.heap_bytes >> 20), impl->heap->backend_name(),
            impl->network ? ", network over " : "",
            impl->network ? runtime::net::transport_choice_name(impl->network->decision().transport) : "");
  return impl;
}

}  // namespace

namespace {

// An intra-CTA barrier wait's ErrorRecord::flag_index (BarrierWhat << 16 | slot), in words.
std::string barrier_text(uint32_t flag_index) {
  const char* name = "unknown barrier";
  switch (static_cast<BarrierWhat>(flag_index >> 16)) {
    case BarrierWhat::kCopyLoad: name = "a bulk copy's load"; break;
    case BarrierWhat::kStageFull: name = "stage full"; break;
    case BarrierWhat::kStageEmpty: name = "stage empty"; break;
    case BarrierWhat::kTileFull: name = "tile full"; break;
    case BarrierWhat::kTileEmpty: name = "tile empty"; break;
    case BarrierWhat::kSignalFull: name = "signal full"; break;
    case BarrierWhat::kSignalEmpty: name = "signal empty"; break;
  }
  return std::string(name) + " " + std::to_string(flag_index & 0xFFFFu);
}

const char* launch_phase_name(uint32_t phase) {
  switch (static_cast<LaunchPhase>(phase)) {
    case LaunchPhase::kEntered: return "entered";
    case LaunchPhase::kRolesDone: return "roles done";
    case LaunchPhase::kComputeDone: return "compute done";
    case LaunchPhase::kProxyDone: return "proxy done";
    case LaunchPhase::kFinished: return "finished";
  }
  return "not entered";
}

}  // namespace

Communicator::Impl::~Impl() {
  if (sync_event != nullptr) cudaEventDestroy(sync_event);
  if (probe_stream != nullptr) cudaStreamDestroy(probe_stream);
  if (probe_words != nullptr) cudaFreeHost(probe_words);
  for (auto& [stream, event] : queued_work) cudaEventDestroy(event);
  if (epoch_state != nullptr) cudaFree(epoch_state);
  if (device_abort != nullptr) cudaFree(device_abort);
  if (launch_states != nullptr) cudaFree(launch_states);
  if (error_host != nullptr) cudaFreeHost(error_host);
  if (host_abort_host != nullptr) cudaFreeHost(host_abort_host);
  if (progress_host != nullptr) cudaFreeHost(progress_host);
}

Result<Communicator::Impl::OperatorFamily*> Communicator::Impl::family(std::string_view name) {
  auto it = families.find(name);
  if (it != families.end()) return &it->second;
  if (families.size() == kMaxFamilies) {
    return Status::internal("operator family '" + std::string(name) + "': more than " + std::to_string(kMaxFamilies) +
                            " families (Communicator::Impl::kMaxFamilies)");
  }
  OperatorFamily f;
  f.launch_state = launch_states + families.size();
  return &families.emplace(std::string(name), f).first->second;
}

Status Communicator::Impl::note_queued_work(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  LOOM_CUDA_TRY(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    workspace_captured = true;
    return {};
  }
  auto it = std::find_if(queued_work.begin(), queued_work.end(), [&](const auto& u) { return u.first == stream; });
  if (it == queued_work.end()) {
    cudaEvent_t event = nullptr;
    LOOM_CUDA_TRY(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    queued_work.emplace_back(stream, event);
    it = queued_work.end() - 1;
  }
  LOOM_CUDA_TRY(cudaEventRecord(it->second, stream));
  return {};
}

Status Communicator::Impl::wait_for_queued_work(const char* what, std::chrono::milliseconds limit, bool even_if_failed) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  auto pause = std::chrono::microseconds(2);
  for (const auto& [stream, event] : queued_work) {
    for (;;) {
      const cudaError_t q = cudaEventQuery(event);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) return cuda_status(q, "cudaEventQuery(queued work)", __FILE__, __LINE__);
      if (!even_if_failed) LOOM_TRY(check_usable());
      if (std::chrono::steady_clock::now() > deadline) {
        return Status::timeout(std::string(what) + ": the operator work queued before did not finish within " +
                               std::to_string(limit.count()) + " ms (synchronize to see why)");
      }
      std::this_thread::sleep_for(pause);
      if (pause < std::chrono::microseconds(500)) pause *= 2;
    }
  }
  return {};
}

DeviceComm Communicator::Impl::device_comm() const {
  DeviceComm c{};
  c.local_rank = topology.local_rank;
  c.local_world = topology.local_world_size;
  c.peer_heap_bases = heap->device_peer_bases();
  c.local_heap_base = reinterpret_cast<uint64_t>(heap->local_base());
  c.control = control;
  c.epoch_state = epoch_state;
  c.wait.timeout_ns = static_cast<uint64_t>(settings.op_timeout.count()) * 1'000'000ull;
  c.wait.host_abort = host_abort_device;
  c.wait.device_abort = device_abort;
  c.wait.error = error_device;
  c.wait.progress = progress_device;
  if (network) {
    c.net = network->device_view();
  } else {
    c.net.node = topology.node;
    c.net.num_nodes = topology.num_nodes;
    c.net.rank = topology.rank;
  }
  return c;
}

Status Communicator::Impl::check_usable() const {
  if (watchdog) watchdog->catch_up();
  std::lock_guard<std::mutex> lock(failure_mutex);
  if (failure.ok()) return {};
  if (failure_from_peer && !peer_failure_returned.exchange(true)) return failure;
  return Status::aborted("communicator failed earlier: " + failure.to_string());
}

bool Communicator::Impl::set_failure(const Status& status, bool from_peer) {
  if (host_abort_host != nullptr) *reinterpret_cast<volatile uint32_t*>(host_abort_host) = 1;
  std::lock_guard<std::mutex> lock(failure_mutex);
  if (!failure.ok()) return false;
  failure = status;
  failure_from_peer = from_peer;
  return true;
}

void Communicator::Impl::fail(const Status& status) {
  if (!set_failure(status) || !bootstrap) return;
  // A timeout or a mismatch keeps its code at the others; their message names this rank.
  const bool kept = status.code() == StatusCode::kTimeout || status.code() == StatusCode::kInvalidArgument;
  bootstrap->report_failure_as(status.code(), kept ? status.message() : status.to_string());
}

bool Communicator::Impl::failed_by_peer() const {
  std::lock_guard<std::mutex> lock(failure_mutex);
  return failure_from_peer;
}

Status Communicator::Impl::unreported_local_failure(bool resumed) {
  // A device wait that gave up: synchronize() reports it with the fullest diagnosis; when nobody
  // consumed the record within a second, the application is not waiting here, so report it now.
  {
    std::lock_guard<std::mutex> lock(record_mutex);
    const uint32_t code = static_cast<volatile ErrorRecord*>(error_host)->code;
    const bool news = code == static_cast<uint32_t>(DeviceError::kTimeout) || code == static_cast<uint32_t>(DeviceError::kMismatch);
    const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now().time_since_epoch()).count();
    if (!news) {
      unconsumed_record_since_ns = 0;
    } else if (unconsumed_record_since_ns == 0 || resumed) {
      unconsumed_record_since_ns = now;
    } else if (now - unconsumed_record_since_ns > 1'000'000'000) {
      const std::string text = error_record_text();
      return code == static_cast<uint32_t>(DeviceError::kTimeout) ? Status::timeout(text) : Status::invalid_argument(text);
    }
  }
  // A failed proxy: the kernels waiting for its transfers wait in vain. A stall is judged only
  // when this process ran all along (a stopped process's lanes look stalled for a moment).
  if (network && !resumed) {
    Status proxy = network->health();
    if (!proxy.ok()) return proxy.with_context("network proxy");
  }
  return {};
}

Status Communicator::Impl::start_watchdog() {
  runtime::Watchdog::Hooks hooks;
  hooks.local_failure = [this](bool resumed) { return unreported_local_failure(resumed); };
  hooks.on_failure = [this](const Status& status, bool from_peer) {
    if (from_peer) {
      if (set_failure(status, /*from_peer=*/true)) LOOM_ERROR("%s", status.to_string().c_str());
    } else {
      fail(status);
    }
  };
  LOOM_ASSIGN_OR_RETURN(watchdog, runtime::Watchdog::start(*bootstrap, std::move(hooks)));
  return {};
}

std::string Communicator::Impl::describe_stuck_work() const {
  const std::string first = error_record_text();
  std::string out = first.empty() ? "no device wait failed" : "first device failure: " + first;
  // The multi-node kernels mark coarse phases (LaunchPhase): the newest epoch marked, how many
  // CTAs are at each phase of it, and the first few that did not finish.
  const volatile CtaProgress* progress = progress_host;
  const uint32_t slots = std::min(static_cast<uint32_t>(sm_count), kProgressSlots);
  uint32_t newest = 0;
  for (uint32_t cta = 0; cta < slots; ++cta) newest = std::max(newest, static_cast<uint32_t>(progress[cta].phase >> 8));
  if (newest == 0) {
    out += "; no CTA progress marked (not a multi-node kernel, or it never started)";
  } else {
    int at[6] = {0, 0, 0, 0, 0, 0};
    std::string behind;
    int listed = 0;
    for (uint32_t cta = 0; cta < slots; ++cta) {
      const uint32_t word = progress[cta].phase;
      const uint32_t phase = (word >> 8) == newest && (word & 0xffu) < 6 ? (word & 0xffu) : 0;
      ++at[phase];
      if (phase != static_cast<uint32_t>(LaunchPhase::kFinished) && listed++ < 8) {
        behind += " CTA " + std::to_string(cta) + " (" + launch_phase_name(phase) + ")";
      }
    }
    // A slot keeps the last epoch its CTA marked, so a launch with fewer CTAs than SMs leaves the
    // slots past its grid at an older epoch: they count as "not entered" below.
    out += "; CTA phases of epoch ~" + std::to_string(newest) + " (of " + std::to_string(slots) +
           " progress slots, one per SM; slots past the launch's grid count as not entered):";
    for (uint32_t phase = 0; phase < 6; ++phase) {
      out += std::string(phase == 0 ? " " : ", ") + launch_phase_name(phase) + " " + std::to_string(at[phase]);
    }
    out += behind.empty() ? " (the stuck work marked nothing: it never started, or is not a multi-node kernel)"
                          : "; unfinished:" + behind;
  }
  if (network) out += "; " + network->describe_state();
  return out;
}

std::string Communicator::Impl::describe_missing_entries(OpId op, uint64_t epoch) const {
  const bool tp_op = op == OpId::kAgGemm || op == OpId::kGemmRs || op == OpId::kGemmAr;
  const bool collective = op == OpId::kAllGather || op == OpId::kReduceScatter || op == OpId::kAllReduce;
  if (!tp_op && !(collective && !network)) return "";
  const int local_world = topology.local_world_size;
  // The entry words a peer writes into this rank when it enters a launch (the higher of a pair
  // counts: a TP call runs the fused kernel or, decomposed, a collective).
  struct Word {
    int rank;           // global rank that writes it
    uint64_t offset;    // heap offset of the word
    bool entry = true;  // an entry word (entry_reached); else a plain epoch flag
    int pair = -1;      // index of the other word of the same peer, or -1
  };
  std::vector<Word> words;
  if (network) {
    // Multi-node operators: NVLink entries of the local peers, and the network entries of the
    // same-index GPUs that announce themselves to this rank (kernels/comm/net.cuh): every other
    // node for gemm_rs / gemm_ar; for ag_gemm's ring only the successor, which this rank sends to.
    const runtime::net::NetWindowLayout layout{static_cast<uint32_t>(topology.num_nodes), static_cast<uint32_t>(local_world)};
    const uint64_t base = network->device_view().flag_offset;
    for (int l = 0; l < local_world; ++l) {
      if (l == topology.local_rank) continue;
      words.push_back({topology.rank_of(topology.node, l), base + 8ull * layout.nvl_entry(static_cast<uint32_t>(l))});
    }
    const int successor = (topology.node + 1) % topology.num_nodes;
    for (int n = 0; n < topology.num_nodes; ++n) {
      if (n == topology.node || (op == OpId::kAgGemm && n != successor)) continue;
      words.push_back({topology.rank_of(n, topology.local_rank), base + 8ull * layout.net_entry(static_cast<uint32_t>(n)), false});
    }
  } else {
    // One node: the collectives' entered[src] and the fused operators' entry[src] at the start of
    // the op-flag region, both entry words (kernels/comm/entry.cuh).
    for (int l = 0; l < local_world; ++l) {
      if (l == topology.local_rank) continue;
      const int first = static_cast<int>(words.size());
      words.push_back({topology.local_peers[l], control.entered_offset + 8ull * l, true, first + 1});
      words.push_back({topology.local_peers[l], control.op_flag_offset + 8ull * l, true, first});
    }
  }
  // Read on a private non-blocking stream into pinned memory, bounded: a synchronous copy would
  // wait for every blocking stream, where other work (even a kernel waiting for the proxy) may run.
  std::string out;
  if (words.size() > kProbeWords) words.resize(kProbeWords);
  if (words.empty() || probe_stream == nullptr) return out;
  bool read = true;
  for (size_t i = 0; read && i < words.size(); ++i) {
    read = cudaMemcpyAsync(&probe_words[i], static_cast<const char*>(heap->local_base()) + words[i].offset, sizeof(uint64_t),
                           cudaMemcpyDeviceToHost, probe_stream) == cudaSuccess;
  }
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  cudaError_t state = read ? cudaErrorNotReady : cudaErrorUnknown;
  while (state == cudaErrorNotReady && std::chrono::steady_clock::now() < give_up) {
    state = cudaStreamQuery(probe_stream);
    if (state == cudaErrorNotReady) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  for (size_t i = 0; state == cudaSuccess && i < words.size(); ++i) {
    const Word& w = words[i];
    if (w.pair >= 0 && static_cast<size_t>(w.pair) < i) continue;  // reported with its pair
    auto entered = [&](size_t k) {
      return words[k].entry ? entry_reached(probe_words[k], epoch) : epoch_reached(probe_words[k], epoch);
    };
    const bool pair = w.pair >= 0 && static_cast<size_t>(w.pair) < words.size();
    if (!entered(i) && !(pair && entered(static_cast<size_t>(w.pair)))) {
      const uint64_t last = w.entry ? entry_epoch(probe_words[i]) : probe_words[i];
      out += "; rank " + std::to_string(w.rank) + " did not enter this launch (its entry word is at epoch " +
             std::to_string(last) + (w.entry ? " modulo 2^32" : "") + ", the launch's " + std::to_string(epoch) + ")";
    }
  }
  if (state != cudaSuccess) cudaGetLastError();  // a failed read only loses this detail
  return out;
}

namespace {

// A CtaProgress failure word as words: "waiting for a 'K' flag I" or "at the barrier 'B'".
std::string failure_text(uint32_t failure) {
  const auto kind = static_cast<FlagKind>((failure >> 24) & 0x7fu);
  const uint32_t index = failure & 0xffffffu;
  if (kind == FlagKind::kNone) return "at the barrier '" + barrier_text(index) + "'";
  return "waiting for a '" + std::string(flag_kind_name(kind)) + "' flag " + std::to_string(index);
}

bool failed(uint32_t failure) { return (failure >> 31) != 0; }

}  // namespace

std::string Communicator::Impl::describe_thread0(int cta, uint64_t epoch) const {
  if (cta < 0 || static_cast<uint32_t>(cta) >= kProgressSlots) return "";
  const volatile CtaProgress& p = progress_host[cta];
  const uint32_t phase_word = p.phase;
  if ((phase_word >> 8) != (epoch & 0xffffffu)) return "";
  std::string out = "; its thread 0 got to '" + std::string(launch_phase_name(phase_word & 0xffu)) + "'";
  const uint32_t failure = p.failure, other = p.other_failure;
  out += failed(failure) ? " and gave up " + failure_text(failure) : " and was in no loom wait";
  if (failed(other)) out += "; another of its threads gave up " + failure_text(other);
  return out;
}

std::string Communicator::Impl::describe_other_waits(uint64_t epoch, int recorded) const {
  const volatile CtaProgress* progress = progress_host;
  if (progress == nullptr) return "";
  const uint32_t slots = std::min(static_cast<uint32_t>(sm_count), kProgressSlots);
  // Distinct (thread 0's wait, another thread's wait) pairs, each with its first CTA and how many
  // CTAs gave up that way; listed in CTA order.
  struct Waits {
    uint32_t thread0, other;
    uint32_t first_cta;
    uint32_t ctas;
  };
  std::vector<Waits> seen;
  uint32_t ctas = 0;
  for (uint32_t cta = 0; cta < slots; ++cta) {
    if (static_cast<int>(cta) == recorded || (progress[cta].phase >> 8) != (epoch & 0xffffffu)) continue;
    const uint32_t thread0 = progress[cta].failure, other = progress[cta].other_failure;
    if (!failed(thread0) && !failed(other)) continue;
    ++ctas;
    auto same = std::find_if(seen.begin(), seen.end(),
                             [&](const Waits& w) { return w.thread0 == thread0 && w.other == other; });
    if (same != seen.end()) {
      ++same->ctas;
    } else {
      seen.push_back({thread0, other, cta, 1});
    }
  }
  if (ctas == 0) return "";
  constexpr size_t kListed = 6;
  std::string out = "; " + std::to_string(ctas) + " other CTA(s) gave up in a wait:";
  for (size_t i = 0; i < seen.size() && i < kListed; ++i) {
    const Waits& w = seen[i];
    out += std::string(i == 0 ? " " : "; ") + "CTA " + std::to_string(w.first_cta) +
           (w.ctas > 1 ? " and " + std::to_string(w.ctas - 1) + " more" : std::string()) + ":";
    if (failed(w.thread0)) out += " thread 0 " + failure_text(w.thread0);
    if (failed(w.other)) out += std::string(failed(w.thread0) ? "," : "") + " another thread " + failure_text(w.other);
  }
  if (seen.size() > kListed) out += "; and " + std::to_string(seen.size() - kListed) + " other kind(s) of wait";
  return out;
}

std::string Communicator::Impl::error_record_text() const {
  const volatile ErrorRecord* e = error_host;
  const uint32_t code = e->code;
  if (code == static_cast<uint32_t>(DeviceError::kNone)) return "";
  const auto op = static_cast<OpId>(e->op);
  const auto kind = static_cast<FlagKind>(e->flag_kind);
  const int waited_on = e->waited_on;
  // Network kinds name a global rank; the others a local one.
  const int waited_global = flag_kind_names_global_rank(kind)
                                ? waited_on
                                : (waited_on >= 0 && waited_on < static_cast<int>(topology.local_peers.size())
                                       ? topology.local_peers[waited_on]
                                       : -1);
  if (code == static_cast<uint32_t>(DeviceError::kMismatch)) {
    return mismatch_text(op, e->epoch, waited_global, e->flag_index, entry_signature(e->observed));
  }
  const bool timed_out = code == static_cast<uint32_t>(DeviceError::kTimeout);
  // What the CTA was waiting for; the sentence around it is the same for every wait.
  char waiting[512];
  if (timed_out && kind == FlagKind::kRingSpace) {
    std::snprintf(waiting, sizeof(waiting),
                  "waiting for space in command ring %u: the proxy did not retire commands (ring tail stayed at %llu; "
                  "CTA %d)",
                  e->flag_index, static_cast<unsigned long long>(e->observed), e->cta);
  } else if (timed_out && kind == FlagKind::kProxyDone) {
    std::snprintf(waiting, sizeof(waiting),
                  "waiting for the proxy to complete the commands of ring %u (completed %llu; CTA %d): the transport "
                  "did not finish the transfers",
                  e->flag_index, static_cast<unsigned long long>(e->observed), e->cta);
  } else if (kind != FlagKind::kNone) {
    std::snprintf(waiting, sizeof(waiting), "waiting for rank %d's '%s' flag %u (CTA %d, flag at epoch %llu)",
                  waited_global, flag_kind_name(kind), e->flag_index, e->cta,
                  static_cast<unsigned long long>(e->observed));
  } else {
    // An intra-CTA barrier (flag_index = BarrierWhat << 16 | slot).
    std::snprintf(waiting, sizeof(waiting), "at an intra-CTA barrier: %s (CTA %d)", barrier_text(e->flag_index).c_str(),
                  e->cta);
  }
  return std::string(op_name(op)) + " (epoch " + std::to_string(e->epoch) + "): " +
         (timed_out ? "timed out" : "aborted") + " after " + std::to_string(e->waited_ns / 1'000'000ull) + " ms " +
         waiting + describe_thread0(e->cta, e->epoch);
}

std::string Communicator::Impl::mismatch_text(OpId op, uint64_t epoch, int peer, uint32_t ours, uint32_t theirs) const {
  const std::string mine = describe_call(ours);
  const std::string their_call = describe_call(theirs);
  return std::string(op_name(op)) + " (epoch " + std::to_string(epoch) + "): rank " + std::to_string(peer) +
         " called " + (their_call.empty() ? std::string("something else") : their_call) + " [signature " +
         hex32(theirs) + "] where rank " + std::to_string(topology.rank) + " called " +
         (mine.empty() ? std::string(op_name(op)) : mine) + " [signature " + hex32(ours) +
         "]: every rank must make the same loom calls (operation, shapes, dtype, options, buffers at the same heap "
         "offsets) in the same order; nothing was moved between them";
}

Status Communicator::Impl::consume_error_record() {
  std::lock_guard<std::mutex> lock(record_mutex);
  volatile ErrorRecord* e = error_host;
  const uint32_t code = e->code;
  if (code == static_cast<uint32_t>(DeviceError::kNone)) return {};
  std::string message = error_record_text();
  // A timeout, or an abort a peer's failure caused (that peer's news comes with it): which peers
  // never entered this launch.
  if (code == static_cast<uint32_t>(DeviceError::kTimeout) ||
      (code == static_cast<uint32_t>(DeviceError::kAborted) && failed_by_peer())) {
    message += describe_missing_entries(static_cast<OpId>(e->op), e->epoch);
  }
  if (code == static_cast<uint32_t>(DeviceError::kTimeout)) message += describe_other_waits(e->epoch, e->cta);
  // Across nodes the first record seldom tells why data never came: say where the network-send
  // CTA (CTA 0) was and what the proxy did.
  if (network && code == static_cast<uint32_t>(DeviceError::kTimeout)) {
    if (e->cta != 0) {
      const std::string sender = describe_thread0(0, e->epoch);
      if (!sender.empty()) message += "; CTA 0 (network send)" + sender;
    }
    message += "; " + network->describe_state();
  }
  std::memset(const_cast<ErrorRecord*>(e), 0, sizeof(ErrorRecord));
  Status s = code == static_cast<uint32_t>(DeviceError::kTimeout)    ? Status::timeout(message)
             : code == static_cast<uint32_t>(DeviceError::kMismatch) ? Status::invalid_argument(message)
                                                                      : Status::aborted(message);
  // Clear the device abort word so the context is clean; the communicator stays failed.
  cudaMemset(device_abort, 0, sizeof(uint32_t));
  return s;
}

Result<uint64_t> Communicator::Impl::symmetric_offset(const void* ptr, size_t bytes, const char* what) const {
  if (ptr == nullptr) return Status::invalid_argument(std::string(what) + " is null");
  if (!heap->allocated(ptr, bytes)) {
    return Status::invalid_argument(std::string(what) + " (" + std::to_string(bytes) +
                                    " bytes) is not inside one symmetric allocation; allocate it with "
                                    "Communicator::alloc (large enough for the operation)");
  }
  return heap->offset_of(ptr);
}

namespace {

// invalid_argument when `ptr` lies in a cudaMalloc allocation that ends before ptr + bytes. Other
// memory (runtime::DeviceAllocation says which) is not judged: a buffer may span its ranges.
Status check_allocation_holds(const void* ptr, size_t bytes, const char* what) {
  const Result<runtime::DeviceAllocation> a = runtime::device_allocation_of(ptr);
  if (!a.ok() || !a->legacy) return {};
  const uint64_t end = a->base + a->bytes;
  const uint64_t p = reinterpret_cast<uint64_t>(ptr);
  if (p + bytes <= end) return {};
  return Status::invalid_argument(std::string(what) + " needs " + std::to_string(bytes) + " bytes from its address, but its "
                                  "allocation (cudaMalloc of " + std::to_string(a->bytes) + " bytes) ends " +
                                  std::to_string(end - p) + " bytes after it");
}

}  // namespace

Status Communicator::Impl::check_local_device_buffer(const void* ptr, size_t bytes, const char* what) const {
  if (ptr == nullptr) return Status::invalid_argument(std::string(what) + " is null");
  if (heap->allocated(ptr, bytes)) return {};
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status::invalid_argument(std::string(what) + " is not a CUDA pointer");
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return Status::invalid_argument(std::string(what) + " is host memory; loom needs device memory");
  }
  if (attr.device != device) {
    return Status::invalid_argument(std::string(what) + " lives on device " + std::to_string(attr.device) +
                                    " but this rank uses device " + std::to_string(device));
  }
  if (attr.type == cudaMemoryTypeDevice) LOOM_TRY(check_allocation_holds(ptr, bytes, what));
  return {};
}

Communicator::Communicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Communicator::~Communicator() {
  if (!impl_) return;
  // Peers may still read or write our heap in kernels they have queued: each rank waits for its
  // own operator work (bounded, on this communicator's events only), then (bounded) for every rank
  // at the barrier below, before any mapping goes away. Work still running after the op timeout
  // is aborted and given one more second; on a failed communicator (a peer died, say) the abort
  // word is up already and one second is all it gets. The watchdog runs meanwhile, so a peer that
  // dies now ends the wait too.
  cudaSetDevice(impl_->device);
  const bool failed = !impl_->check_usable().ok();
  const auto limit = failed ? std::chrono::milliseconds(1000) : impl_->settings.op_timeout + std::chrono::seconds(1);
  Status done = impl_->wait_for_queued_work("communicator teardown", limit, /*even_if_failed=*/true);
  if (done.code() == StatusCode::kTimeout && !failed) {
    *reinterpret_cast<volatile uint32_t*>(impl_->host_abort_host) = 1;
    done = impl_->wait_for_queued_work("communicator teardown", std::chrono::seconds(1), /*even_if_failed=*/true);
  }
  if (!done.ok()) LOOM_WARN("%s; tearing down anyway", done.to_string().c_str());
  // From here on peers leave too: a closed connection is no failure any more.
  if (impl_->watchdog) impl_->watchdog->stop();
  // The proxy first: it may still carry what our finished kernels asked it to send (peers wait
  // for it), and it writes into other ranks' heaps, which must stay mapped until every rank has
  // stopped its proxy (the barrier below). A failed communicator drains only briefly.
  if (impl_->network) {
    const auto drain = impl_->check_usable().ok() ? impl_->settings.op_timeout : std::chrono::milliseconds(200);
    Status s = impl_->network->shutdown(drain);
    if (!s.ok()) LOOM_WARN("stopping the network proxy: %s", s.to_string().c_str());
  }
  // Our mappings of peers' heaps go first; with legacy IPC a peer must not free its heap
  // while we still have it open, hence the barrier before anyone frees its own.
  if (impl_->heap) {
    Status s = impl_->heap->release_peer_mappings();
    if (!s.ok()) LOOM_WARN("unmapping peer heaps: %s", s.to_string().c_str());
  }
  if (impl_->check_usable().ok() && impl_->bootstrap) {
    Status s = impl_->bootstrap->barrier();
    if (!s.ok()) LOOM_WARN("communicator teardown barrier failed: %s", s.to_string().c_str());
  }
  if (impl_->heap) {
    Status s = impl_->heap->close();
    if (!s.ok()) LOOM_WARN("closing the symmetric heap: %s", s.to_string().c_str());
  }
}

Result<std::unique_ptr<Communicator>> Communicator::from_env(const CommOptions& options) {
  LOOM_TRY(check_comm_options(options));
  LOOM_ASSIGN_OR_RETURN(runtime::BootstrapConfig config, runtime::bootstrap_config_from_env());
  const int rank = config.rank;
  Joining joining;
  joining.connect = [&](std::chrono::milliseconds timeout) {
    config.timeout = timeout;
    return runtime::Bootstrap::connect(config);
  };
  joining.announce = [&](std::chrono::milliseconds timeout, const Status& failure) {
    if (timeout.count() > 0) config.timeout = timeout;
    return runtime::Bootstrap::announce_failure(config, failure);
  };
  LOOM_ASSIGN_OR_RETURN(std::unique_ptr<Impl> impl, build(options, joining, rank));
  return std::unique_ptr<Communicator>(new Communicator(std::move(impl)));
}

Result<std::unique_ptr<Communicator>> Communicator::from_unique_id(const UniqueId& id, int rank, int world_size,
                                                                   const CommOptions& options) {
  LOOM_TRY(check_comm_options(options));
  runtime::UniqueId rid;
  static_assert(sizeof(rid.bytes) == sizeof(id.bytes), "public and runtime unique ids must have the same size");
  std::memcpy(rid.bytes.data(), id.bytes.data(), id.bytes.size());
  Joining joining;
  joining.connect = [&](std::chrono::milliseconds timeout) {
    return runtime::Bootstrap::from_unique_id(rid, rank, world_size, timeout);
  };
  joining.announce = [&](std::chrono::milliseconds timeout, const Status& failure) {
    return runtime::Bootstrap::announce_failure(rid, rank, world_size,
                                                timeout.count() > 0 ? timeout : env::Settings{}.bootstrap_timeout, failure);
  };
  LOOM_ASSIGN_OR_RETURN(std::unique_ptr<Impl> impl, build(options, joining, rank));
  return std::unique_ptr<Communicator>(new Communicator(std::move(impl)));
}

void discard_unique_id(const UniqueId& id) {
  runtime::UniqueId rid;
  std::memcpy(rid.bytes.data(), id.bytes.data(), id.bytes.size());
  runtime::Bootstrap::discard_unique_id(rid);
}

Result<UniqueId> make_unique_id(std::string_view bind_addr) {
  LOOM_ASSIGN_OR_RETURN(runtime::UniqueId rid, runtime::Bootstrap::create_unique_id(bind_addr));
  UniqueId id;
  std::memcpy(id.bytes.data(), rid.bytes.data(), id.bytes.size());
  return id;
}

int Communicator::rank() const { return impl_->topology.rank; }
int Communicator::world_size() const { return impl_->topology.world_size; }
int Communicator::local_rank() const { return impl_->topology.local_rank; }
int Communicator::local_world_size() const { return impl_->topology.local_world_size; }
int Communicator::node() const { return impl_->topology.node; }
int Communicator::num_nodes() const { return impl_->topology.num_nodes; }
int Communicator::device() const { return impl_->device; }
int Communicator::sm_count() const { return impl_->sm_count; }
int Communicator::ranks_per_gpu() const { return impl_->topology.ranks_per_gpu; }
int Communicator::ranks_on_gpu() const { return impl_->topology.ranks_on_my_gpu; }

Result<void*> Communicator::alloc(size_t bytes) {
  LOOM_TRY(impl_->check_usable());
  if (bytes == 0) return Status::invalid_argument("alloc: zero bytes");
  Result<void*> ptr = impl_->heap->allocate(bytes);
  // Every rank must have made the same allocation at the same offset; check, so a divergent
  // call sequence fails here and not as silent corruption in a kernel.
  struct Record {
    uint64_t offset;
    uint64_t bytes;
    int32_t ok;
    int32_t pad;
  } mine{ptr.ok() ? impl_->heap->offset_of(*ptr) : 0, bytes, ptr.ok() ? 1 : 0, 0};
  std::vector<Record> all(world_size());
  LOOM_TRY_CTX(impl_->bootstrap->all_gather(&mine, all.data(), sizeof(Record)), "alloc");
  for (int r = 0; r < world_size(); ++r) {
    if (impl_->topology.node_of_rank[r] != node()) continue;
    if (all[r].ok == 0 || all[r].offset != mine.offset || all[r].bytes != mine.bytes) {
      if (ptr.ok()) (void)impl_->heap->release(*ptr);
      if (!ptr.ok()) return ptr.status();
      return Status::invalid_argument("alloc: rank " + std::to_string(r) + (all[r].ok ? " allocated " + std::to_string(all[r].bytes) +
                                      " bytes at offset " + std::to_string(all[r].offset) : std::string(" failed to allocate")) +
                                      " but this rank asked for " + std::to_string(bytes) + " bytes at offset " +
                                      std::to_string(mine.offset) + "; every rank must allocate the same sizes in the same order");
    }
  }
  return ptr;
}

Status Communicator::free(void* ptr) { return impl_->heap->release(ptr); }

bool Communicator::is_symmetric(const void* ptr, size_t bytes) const { return impl_->heap->allocated(ptr, bytes); }

Result<void*> Communicator::peer_pointer(const void* local_ptr, int local_rank) const {
  if (local_rank < 0 || local_rank >= local_world_size()) {
    return Status::invalid_argument("peer_pointer: local rank " + std::to_string(local_rank) + " outside [0, " +
                                    std::to_string(local_world_size()) + ")");
  }
  LOOM_ASSIGN_OR_RETURN(uint64_t offset, impl_->symmetric_offset(local_ptr, 1, "peer_pointer argument"));
  return static_cast<void*>(static_cast<char*>(impl_->heap->peer_base(local_rank)) + offset);
}

Status Communicator::synchronize(cudaStream_t stream) {
  LOOM_CUDA_TRY(cudaSetDevice(impl_->device));
  LOOM_CUDA_TRY(cudaEventRecord(impl_->sync_event, stream));
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  // Device waits give up after op_timeout; one extra second covers their polling interval.
  const auto soft_deadline = start + impl_->settings.op_timeout + std::chrono::seconds(1);
  const auto hard_deadline = soft_deadline + std::chrono::seconds(1);
  bool aborted_by_host = false;
  Status proxy_failure;  // the proxy's own error, seen while waiting
  auto next_proxy_check = start;
  auto sleep_for = std::chrono::microseconds(2);
  for (;;) {
    const cudaError_t q = cudaEventQuery(impl_->sync_event);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) {
      Status s = cuda_status(q, "cudaEventQuery(stream work)", __FILE__, __LINE__);
      impl_->fail(s);
      if (impl_->network) impl_->network->after_synchronize(impl_->epoch_state, /*failed=*/true);
      return s;
    }
    const auto now = clock::now();
    // A failed proxy (transport error, rejected command, stalled lane) leaves kernels waiting for
    // flags that will not come: abort them now and report the proxy's error.
    if (impl_->network && proxy_failure.ok() && now >= next_proxy_check) {
      next_proxy_check = now + std::chrono::milliseconds(1);
      proxy_failure = impl_->network->health();
      if (!proxy_failure.ok() && !aborted_by_host) {
        *reinterpret_cast<volatile uint32_t*>(impl_->host_abort_host) = 1;
        aborted_by_host = true;
      }
    }
    if (!aborted_by_host && now > soft_deadline) {
      // Something other than a loom wait is stuck (or a kernel is much longer than the
      // timeout): raise the host abort so loom kernels return.
      *reinterpret_cast<volatile uint32_t*>(impl_->host_abort_host) = 1;
      aborted_by_host = true;
    }
    if (now > hard_deadline) {
      const std::string stuck = impl_->describe_stuck_work();
      Status s = Status::timeout("synchronize: stream work did not finish within " +
                                 std::to_string(impl_->settings.op_timeout.count()) +
                                 " ms + 2 s, even after the abort word was raised; " + stuck);
      LOOM_ERROR("%s", s.to_string().c_str());
      impl_->fail(s);
      return s;
    }
    std::this_thread::sleep_for(sleep_for);
    if (sleep_for < std::chrono::microseconds(500)) sleep_for *= 2;
  }
  Status device_error = impl_->consume_error_record();
  if (impl_->network && proxy_failure.ok()) proxy_failure = impl_->network->health();
  // A kernel ended by the abort word that a peer's failure raised (the watchdog), nothing being
  // wrong here: the peer's failure is the news, with what this rank's kernel saw (its record says
  // which peers had not entered the launch).
  if (impl_->failed_by_peer() && proxy_failure.ok() && (device_error.ok() || device_error.code() == StatusCode::kAborted)) {
    if (impl_->network) impl_->network->after_synchronize(impl_->epoch_state, /*failed=*/true);
    const Status peer = impl_->check_usable();
    if (device_error.ok()) return peer;
    return Status(peer.code(), peer.message() + " (this rank's kernel then: " + device_error.message() + ")");
  }
  if (aborted_by_host) {
    if (impl_->check_usable().ok()) *reinterpret_cast<volatile uint32_t*>(impl_->host_abort_host) = 0;
    if (device_error.ok()) {
      device_error = Status::timeout("synchronize: stream work exceeded " +
                                     std::to_string(impl_->settings.op_timeout.count()) + " ms; aborted by the host");
    }
  }
  if (impl_->network) {
    // The proxy's error explains a kernel that waited in vain (or was aborted because of it); it
    // comes first. A proxy error without a failed kernel is reported too: a transfer failed.
    if (!proxy_failure.ok()) {
      Status s = proxy_failure;
      s.with_context(device_error.ok() ? "network proxy" : "network proxy (kernel: " + device_error.to_string() + ")");
      device_error = s;
    }
    impl_->network->after_synchronize(impl_->epoch_state, /*failed=*/!device_error.ok() || !impl_->check_usable().ok());
  }
  if (!device_error.ok()) {
    impl_->fail(device_error);
    impl_->peer_failure_returned.store(true);  // the application has its failure: later calls say aborted
    // A mismatch: the peer reports its side (what it called) just as this rank did; add it.
    if (device_error.code() == StatusCode::kInvalidArgument) return impl_->with_peer_reports(device_error);
    return device_error;
  }
  return impl_->check_usable();
}

Status Communicator::Impl::with_peer_reports(const Status& mismatch) const {
  if (!bootstrap) return mismatch;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  std::vector<Status> notices = bootstrap->peer_notices();
  while (notices.empty() && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    notices = bootstrap->peer_notices();
  }
  std::string said;
  for (const Status& n : notices) {
    if (n.code() == StatusCode::kInvalidArgument) said += "; " + n.message();
  }
  return said.empty() ? mismatch : Status::invalid_argument(mismatch.message() + " (the other side" + said + ")");
}

Status Communicator::barrier() {
  LOOM_TRY(impl_->check_usable());
  return impl_->bootstrap->barrier();
}

void Communicator::abort(std::string_view reason) {
  impl_->fail(Status::aborted("aborted by the application: " + std::string(reason)));
}

Status Communicator::health() const { return impl_->check_usable(); }

}  // namespace loom
