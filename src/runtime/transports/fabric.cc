#include "runtime/transports/fabric.h"

#include <dlfcn.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sys/uio.h>

#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/log.h"
#include "runtime/transports/shared_library.h"

namespace loom::runtime::net {
namespace {

// The exported libfabric entry points loom uses; everything else is reached through the
// objects' operation tables (the inline functions of <rdma/fi_*.h>).
struct FabricApi {
  int (*fi_getinfo)(uint32_t version, const char* node, const char* service, uint64_t flags,
                    const struct fi_info* hints, struct fi_info** info) = nullptr;
  void (*fi_freeinfo)(struct fi_info* info) = nullptr;
  struct fi_info* (*fi_dupinfo)(const struct fi_info* info) = nullptr;
  int (*fi_fabric)(struct fi_fabric_attr* attr, struct fid_fabric** fabric, void* context) = nullptr;
  const char* (*fi_strerror)(int errnum) = nullptr;
  uint32_t (*fi_version)(void) = nullptr;
};

// Opened once per library path and never closed (load_api_once says why).
Result<const FabricApi*> load_fabric_api(const std::string& library) {
  return load_api_once<FabricApi>(library, [&]() -> Result<const FabricApi*> {
    LOOM_ASSIGN_OR_RETURN(void* handle, open_library(library, "fabric",
                                                     "install libfabric (Debian: libfabric1) or choose another LOOM_TRANSPORT"));
    auto* api = new FabricApi();  // lives as long as the library: never freed
    bool missing = false;
    std::string which;
    auto resolve = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(handle, name));
      if (fn == nullptr) {
        missing = true;
        which = name;
      }
    };
    resolve(api->fi_getinfo, "fi_getinfo");
    resolve(api->fi_freeinfo, "fi_freeinfo");
    resolve(api->fi_dupinfo, "fi_dupinfo");
    resolve(api->fi_fabric, "fi_fabric");
    resolve(api->fi_strerror, "fi_strerror");
    resolve(api->fi_version, "fi_version");
    if (missing) {
      delete api;
      return Status::unsupported("fabric: " + library + " lacks " + which);
    }
    return static_cast<const FabricApi*>(api);
  });
}

std::string version_string(const FabricApi& api) {
  const uint32_t v = api.fi_version();
  return std::to_string(FI_MAJOR(v)) + "." + std::to_string(FI_MINOR(v));
}

// The memory-registration modes loom handles (FI_MR_RAW is not: keys must fit 64 bits).
constexpr uint64_t kSupportedMrModes =
    FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT | FI_MR_HMEM;

// Owns an fi_info list.
struct InfoList {
  const FabricApi* api = nullptr;
  fi_info* head = nullptr;
  ~InfoList() {
    if (head != nullptr) api->fi_freeinfo(head);
  }
};

// Queries `options.provider` for RMA over RDM, optionally insisting on write-after-write
// ordering. Returns the list (possibly empty) or an error other than "no match".
Status query_info(const FabricApi& api, const FabricOptions& options, bool want_order, InfoList& out) {
  fi_info* hints = api.fi_dupinfo(nullptr);  // what fi_allocinfo() does
  if (hints == nullptr) return Status::system_error("fabric: fi_dupinfo(NULL) failed");
  hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | (options.device_memory ? FI_HMEM : 0);
  hints->ep_attr->type = FI_EP_RDM;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;  // every operation's context is an fi_context2
  hints->domain_attr->mr_mode = static_cast<int>(kSupportedMrModes & ~(options.device_memory ? 0 : FI_MR_HMEM));
  if (want_order) {
    hints->tx_attr->msg_order = FI_ORDER_WAW;
    hints->rx_attr->msg_order = FI_ORDER_WAW;
  }
  // fi_freeinfo frees these strings: they must come from malloc.
  if (!options.provider.empty()) hints->fabric_attr->prov_name = ::strdup(options.provider.c_str());
  if (!options.domain.empty()) hints->domain_attr->name = ::strdup(options.domain.c_str());
  out.api = &api;
  const int rc = api.fi_getinfo(FI_VERSION(1, 9), nullptr, nullptr, 0, hints, &out.head);
  api.fi_freeinfo(hints);
  if (rc == -FI_ENODATA) return {};
  if (rc != 0) {
    return Status::system_error("fabric: fi_getinfo(provider '" + options.provider + "'): " + api.fi_strerror(-rc));
  }
  return {};
}

// Whether `info` gives data ordering for writes of any size (a flag may follow its data).
bool gives_write_order(const fi_info* info) {
  return (info->tx_attr->msg_order & FI_ORDER_WAW) != 0 && (info->rx_attr->msg_order & FI_ORDER_WAW) != 0 &&
         info->ep_attr->max_order_waw_size >= (uint64_t{1} << 30);
}

std::string describe_info(const FabricApi& api, const fi_info* info, bool ordered) {
  return std::string(info->fabric_attr->prov_name) + " on " + info->domain_attr->name + " (libfabric " +
         version_string(api) + (ordered ? ", ordered writes" : ", flags after completion") + ")";
}

// Whether `info` is on the requested domain (providers do not all filter by the hint's name).
bool on_domain(const fi_info* info, const FabricOptions& options) {
  return options.domain.empty() || (info->domain_attr->name != nullptr && options.domain == info->domain_attr->name);
}

// Finds the info to use: ordered when allowed and offered, else any, on the requested domain.
Status choose_info(const FabricApi& api, const FabricOptions& options, InfoList& list, fi_info** chosen, bool* ordered) {
  if (options.use_ordering) {
    LOOM_TRY(query_info(api, options, /*want_order=*/true, list));
    for (fi_info* i = list.head; i != nullptr; i = i->next) {
      if (gives_write_order(i) && on_domain(i, options)) {
        *chosen = i;
        *ordered = true;
        return {};
      }
    }
    if (list.head != nullptr) api.fi_freeinfo(list.head);
    list.head = nullptr;
  }
  LOOM_TRY(query_info(api, options, /*want_order=*/false, list));
  std::string offered;
  for (fi_info* i = list.head; i != nullptr; i = i->next) {
    if (on_domain(i, options)) {
      *chosen = i;
      *ordered = false;
      return {};
    }
    const std::string name = i->domain_attr->name != nullptr ? i->domain_attr->name : "?";
    if (offered.find(name) == std::string::npos) offered += (offered.empty() ? "" : ", ") + name;
  }
  return Status::unsupported("fabric: provider '" + options.provider + "'" +
                             (options.domain.empty() ? "" : " on domain '" + options.domain + "'") +
                             " offers no FI_RMA over FI_EP_RDM endpoints (libfabric " + version_string(api) +
                             (offered.empty() ? "" : "; domains offered: " + offered) + ")");
}

// remote_key bytes of a fabric registration: address (or 0 when offsets are used), key, length.
struct WireKey {
  uint64_t address;
  uint64_t key;
  uint64_t bytes;
};
static_assert(sizeof(WireKey) == 24, "three little-endian 64-bit words");

class FabricTransport final : public TransportBase {
 public:
  FabricTransport(const FabricApi& api, TransportConfig config, FabricOptions options)
      : TransportBase(TransportKind::kFabric, "fabric"),
        api_(api), config_(std::move(config)), options_(std::move(options)) {}
  ~FabricTransport() override { (void)close(); }

  Status init() {
    fi_info* chosen = nullptr;
    bool ordered = false;
    LOOM_TRY(choose_info(api_, options_, infos_, &chosen, &ordered));
    info_ = api_.fi_dupinfo(chosen);
    if (info_ == nullptr) return Status::system_error("fabric: fi_dupinfo failed");
    const int mr_mode = info_->domain_attr->mr_mode;
    virt_addr_ = (mr_mode & FI_MR_VIRT_ADDR) != 0;
    prov_key_ = (mr_mode & FI_MR_PROV_KEY) != 0;
    mr_endpoint_ = (mr_mode & FI_MR_ENDPOINT) != 0;
    caps_.ordered_writes = ordered;
    caps_.max_write_bytes = std::min<uint64_t>(info_->ep_attr->max_msg_size, uint64_t{1} << 30);
    caps_.max_outstanding = options_.queue_depth;
    describe_ = describe_info(api_, info_, ordered);

    LOOM_TRY(check(api_.fi_fabric(info_->fabric_attr, &fabric_, nullptr), "fi_fabric"));
    LOOM_TRY(check(fi_domain(fabric_, info_, &domain_, nullptr), "fi_domain"));
    fi_cq_attr cq_attr{};
    cq_attr.size = 2 * static_cast<size_t>(options_.queue_depth);
    cq_attr.format = FI_CQ_FORMAT_CONTEXT;
    cq_attr.wait_obj = FI_WAIT_NONE;
    LOOM_TRY(check(fi_cq_open(domain_, &cq_attr, &cq_, nullptr), "fi_cq_open"));
    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    av_attr.count = static_cast<size_t>(config_.world_size);
    LOOM_TRY(check(fi_av_open(domain_, &av_attr, &av_, nullptr), "fi_av_open"));
    LOOM_TRY(check(fi_endpoint(domain_, info_, &ep_, nullptr), "fi_endpoint"));
    // Receive-side binding too: manual-progress providers advance incoming writes on CQ reads.
    LOOM_TRY(check(fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)"));
    LOOM_TRY(check(fi_ep_bind(ep_, &av_->fid, 0), "fi_ep_bind(av)"));
    LOOM_TRY(check(fi_enable(ep_), "fi_enable"));

    contexts_.resize(options_.queue_depth);
    for (uint32_t i = 0; i < options_.queue_depth; ++i) free_contexts_.push_back(options_.queue_depth - 1 - i);
    // Flag values are staged in registered memory, one slot per context (never reused in flight).
    flag_staging_.assign(options_.queue_depth, 0);
    MemoryRegion staging{flag_staging_.data(), flag_staging_.size() * sizeof(uint64_t), MemoryKind::kHost, -1};
    LOOM_ASSIGN_OR_RETURN(LocalRegistration reg, register_memory(staging));
    staging_handle_ = reg.handle;
    peer_addresses_.assign(static_cast<size_t>(config_.world_size), FI_ADDR_NOTAVAIL);
    LOOM_INFO("fabric transport: %s", describe_.c_str());
    return {};
  }

  Result<LocalRegistration> register_memory(const MemoryRegion& region) override {
    LOOM_TRY(check_registrable(region));
    if (region.kind == MemoryKind::kDevice && !options_.device_memory) {
      return Status::unsupported("fabric: device memory needs FabricOptions::device_memory (FI_HMEM)");
    }
    iovec iov{region.base, region.bytes};
    fi_mr_attr attr{};
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = FI_WRITE | (region.remote_write ? FI_REMOTE_WRITE : 0);
    attr.requested_key = prov_key_ ? 0 : next_key_++;
    attr.iface = region.kind == MemoryKind::kDevice ? FI_HMEM_CUDA : FI_HMEM_SYSTEM;
    if (region.kind == MemoryKind::kDevice) attr.device.cuda = region.device;
    fid_mr* mr = nullptr;
    LOOM_TRY(check(fi_mr_regattr(domain_, &attr, 0, &mr), "fi_mr_regattr"));
    if (mr_endpoint_) {
      // Bound to the endpoint and enabled before use (FI_MR_ENDPOINT).
      Status bound = check(fi_mr_bind(mr, &ep_->fid, 0), "fi_mr_bind");
      if (bound.ok()) bound = check(fi_mr_enable(mr), "fi_mr_enable");
      if (!bound.ok()) {
        fi_close(&mr->fid);
        return bound;
      }
    }
    LocalMr local{mr, static_cast<char*>(region.base), region.bytes, fi_mr_desc(mr)};
    locals_.push_back(local);
    LocalRegistration out;
    out.handle = static_cast<uint32_t>(locals_.size() - 1);
    out.bytes = region.bytes;
    WireKey key{virt_addr_ ? reinterpret_cast<uint64_t>(region.base) : 0, fi_mr_key(mr), region.bytes};
    out.remote_key.resize(sizeof(key));
    std::memcpy(out.remote_key.data(), &key, sizeof(key));
    return out;
  }

  Result<std::vector<uint8_t>> local_endpoint() override {
    LOOM_TRY(check_open());
    size_t length = 0;
    // First call learns the size (-FI_ETOOSMALL), the second fills the name.
    int rc = fi_getname(&ep_->fid, nullptr, &length);
    if (rc != -FI_ETOOSMALL && rc != 0) LOOM_TRY(check(rc, "fi_getname(size)"));
    std::vector<uint8_t> name(length);
    LOOM_TRY(check(fi_getname(&ep_->fid, name.data(), &length), "fi_getname"));
    name.resize(length);
    return name;
  }

  Status connect(std::span<const std::vector<uint8_t>> endpoints) override {
    if (endpoints.size() != static_cast<size_t>(config_.world_size)) {
      return Status::internal("fabric: " + std::to_string(endpoints.size()) + " endpoints for a world of " +
                              std::to_string(config_.world_size));
    }
    for (int r = 0; r < config_.world_size; ++r) {
      if (r == config_.rank || !config_.peers[r]) continue;
      if (endpoints[r].empty()) return Status::internal("fabric: rank " + std::to_string(r) + " sent no endpoint");
      fi_addr_t address = FI_ADDR_NOTAVAIL;
      const int inserted = fi_av_insert(av_, endpoints[r].data(), 1, &address, 0, nullptr);
      if (inserted != 1) {
        return Status::system_error("fabric: fi_av_insert(rank " + std::to_string(r) + "): " +
                                    (inserted < 0 ? api_.fi_strerror(-inserted) : "address not inserted"));
      }
      peer_addresses_[r] = address;
    }
    return {};
  }

  Result<uint32_t> import_remote(int rank, std::span<const uint8_t> remote_key, uint64_t bytes) override {
    if (rank < 0 || rank >= config_.world_size || peer_addresses_[rank] == FI_ADDR_NOTAVAIL) {
      return Status::internal("fabric: window of rank " + std::to_string(rank) + ", which is not a connected peer");
    }
    WireKey key{};
    if (remote_key.size() != sizeof(key)) {
      return Status::internal("fabric: window key of rank " + std::to_string(rank) + " has " +
                              std::to_string(remote_key.size()) + " bytes, expected " + std::to_string(sizeof(key)));
    }
    std::memcpy(&key, remote_key.data(), sizeof(key));
    if (key.bytes != bytes) return Status::internal("fabric: window size of rank " + std::to_string(rank) + " disagrees");
    remotes_.push_back(RemoteMr{rank, key.address, key.key, key.bytes});
    return static_cast<uint32_t>(remotes_.size() - 1);
  }

  Result<size_t> post_writes(std::span<const WriteOp> ops) override {
    LOOM_TRY(check_open());
    size_t taken = 0;
    for (const WriteOp& op : ops) {
      if (free_contexts_.empty()) break;
      // Defence in depth: the proxy validated the command; the transport still never posts
      // outside a registration.
      if (op.local >= locals_.size() || op.remote >= remotes_.size() || remotes_[op.remote].rank != op.rank) {
        return Status::internal("fabric: write " + std::to_string(op.id) + " names an unknown registration");
      }
      const LocalMr& local = locals_[op.local];
      const RemoteMr& remote = remotes_[op.remote];
      if (!within(op.local_offset, op.bytes, local.bytes) || !within(op.remote_offset, op.bytes, remote.bytes)) {
        return Status::internal("fabric: write " + std::to_string(op.id) + " outside its registration");
      }
      LOOM_ASSIGN_OR_RETURN(bool posted, post(op.id, op.rank, local, op.local_offset, remote, op.remote_offset, op.bytes));
      if (!posted) break;
      ++taken;
    }
    return taken;
  }

  Result<bool> post_flag(const FlagOp& op) override {
    LOOM_TRY(check_open());
    if (free_contexts_.empty()) return false;
    if (!flag_in_window(remotes_, op)) {
      return Status::internal("fabric: flag " + std::to_string(op.id & ~(uint64_t{1} << 63)) + " outside its window");
    }
    // The context slot about to be taken owns the staging word for as long as the op is in flight.
    const uint32_t slot = free_contexts_.back();
    flag_staging_[slot] = op.value;
    return post(op.id, op.rank, locals_[staging_handle_], slot * sizeof(uint64_t), remotes_[op.remote], op.remote_offset,
                sizeof(uint64_t));
  }

  Status poll(std::vector<Completion>& out) override {
    if (closed_) return {};
    fi_cq_entry entries[64];
    while (true) {
      const ssize_t n = fi_cq_read(cq_, entries, 64);
      if (n == -FI_EAGAIN) return {};
      if (n == -FI_EAVAIL) {
        fi_cq_err_entry err{};
        const ssize_t got = fi_cq_readerr(cq_, &err, 0);
        if (got < 0) return Status::system_error(std::string("fabric: fi_cq_readerr: ") + api_.fi_strerror(static_cast<int>(-got)));
        char provider_text[256] = {};
        const char* detail = fi_cq_strerror(cq_, err.prov_errno, err.err_data, provider_text, sizeof(provider_text));
        OpContext* ctx = static_cast<OpContext*>(err.op_context);
        Completion c;
        c.id = ctx != nullptr ? ctx->id : 0;
        c.status = Status::peer_failure("fabric: " + std::string(ctx != nullptr && ctx->is_flag ? "flag" : "RDMA") +
                                        " write to rank " + std::to_string(ctx != nullptr ? ctx->rank : -1) +
                                        " failed: " + api_.fi_strerror(err.err) + " (provider error " +
                                        std::to_string(err.prov_errno) + ": " + (detail ? detail : "") + ")");
        if (ctx != nullptr) release(ctx);
        out.push_back(std::move(c));
        continue;
      }
      if (n < 0) return Status::system_error(std::string("fabric: fi_cq_read: ") + api_.fi_strerror(static_cast<int>(-n)));
      for (ssize_t i = 0; i < n; ++i) {
        OpContext* ctx = static_cast<OpContext*>(entries[i].op_context);
        out.push_back(Completion{ctx->id, {}});
        release(ctx);
      }
      if (n < 64) return {};
    }
  }

  uint32_t outstanding() const override { return options_.queue_depth - static_cast<uint32_t>(free_contexts_.size()); }

  Status close() override {
    if (closed_) return {};
    closed_ = true;
    Status first;
    auto close_fid = [&](fid_t fid, const char* what) {
      if (fid == nullptr) return;
      const int rc = fi_close(fid);
      if (rc != 0 && first.ok()) first = Status::system_error(std::string("fabric: closing ") + what + ": " + api_.fi_strerror(-rc));
    };
    // Endpoint first (it references the CQ, AV and MRs), then registrations, then the rest.
    if (ep_ != nullptr) close_fid(&ep_->fid, "endpoint");
    for (LocalMr& m : locals_) close_fid(&m.mr->fid, "memory registration");
    locals_.clear();
    if (av_ != nullptr) close_fid(&av_->fid, "address vector");
    if (cq_ != nullptr) close_fid(&cq_->fid, "completion queue");
    if (domain_ != nullptr) close_fid(&domain_->fid, "domain");
    if (fabric_ != nullptr) close_fid(&fabric_->fid, "fabric");
    if (info_ != nullptr) api_.fi_freeinfo(info_);
    ep_ = nullptr;
    av_ = nullptr;
    cq_ = nullptr;
    domain_ = nullptr;
    fabric_ = nullptr;
    info_ = nullptr;
    return first;
  }

 private:
  struct LocalMr {
    fid_mr* mr;
    char* base;
    uint64_t bytes;
    void* desc;
  };
  struct RemoteMr {
    int rank;
    uint64_t address;  // base the key's offsets start from (0 without FI_MR_VIRT_ADDR)
    uint64_t key;
    uint64_t bytes;
  };
  struct OpContext {
    fi_context2 fi;  // first member: providers in FI_CONTEXT mode use it as scratch space
    uint64_t id = 0;
    int rank = -1;
    bool is_flag = false;
  };

  Status check(int rc, const char* what) const {
    if (rc == 0) return {};
    return Status::system_error(std::string("fabric: ") + what + ": " + api_.fi_strerror(rc < 0 ? -rc : rc) + " (" +
                                describe_ + ")");
  }

  // One fi_writemsg; false when the provider is out of resources (poll, then retry).
  Result<bool> post(uint64_t id, int rank, const LocalMr& local, uint64_t local_offset, const RemoteMr& remote,
                    uint64_t remote_offset, uint64_t bytes) {
    const uint32_t slot = free_contexts_.back();
    OpContext& ctx = contexts_[slot];
    ctx.id = id;
    ctx.rank = rank;
    ctx.is_flag = (id >> 63) != 0;
    iovec iov{local.base + local_offset, bytes};
    void* desc = local.desc;
    fi_rma_iov rma{remote.address + remote_offset, bytes, remote.key};
    fi_msg_rma msg{};
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = peer_addresses_[rank];
    msg.rma_iov = &rma;
    msg.rma_iov_count = 1;
    msg.context = &ctx;
    // Delivery complete: the completion means the bytes are in the target's memory.
    const ssize_t rc = fi_writemsg(ep_, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE);
    if (rc == -FI_EAGAIN) return false;
    if (rc != 0) {
      return Status::system_error("fabric: fi_writemsg(" + std::to_string(bytes) + " bytes to rank " +
                                  std::to_string(rank) + "): " + api_.fi_strerror(static_cast<int>(-rc)));
    }
    free_contexts_.pop_back();
    return true;
  }

  void release(OpContext* ctx) {
    free_contexts_.push_back(static_cast<uint32_t>(ctx - contexts_.data()));
  }

  const FabricApi& api_;
  TransportConfig config_;
  FabricOptions options_;
  InfoList infos_;
  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  fid_ep* ep_ = nullptr;
  bool virt_addr_ = false;
  bool prov_key_ = false;
  bool mr_endpoint_ = false;
  uint64_t next_key_ = 1;
  std::vector<LocalMr> locals_;
  std::vector<RemoteMr> remotes_;
  std::vector<OpContext> contexts_;
  std::vector<uint32_t> free_contexts_;
  std::vector<uint64_t> flag_staging_;
  uint32_t staging_handle_ = 0;
  std::vector<fi_addr_t> peer_addresses_;
};

}  // namespace

Result<std::unique_ptr<Transport>> create_fabric_transport(const TransportConfig& config, const FabricOptions& options) {
  if (config.world_size < 1 || config.rank < 0 || config.rank >= config.world_size ||
      config.peers.size() != static_cast<size_t>(config.world_size)) {
    return Status::invalid_argument("fabric: inconsistent transport config");
  }
  if (options.queue_depth == 0) return Status::invalid_argument("fabric: queue depth 0");
  LOOM_ASSIGN_OR_RETURN(const FabricApi* api, load_fabric_api(options.library));
  auto transport = std::make_unique<FabricTransport>(*api, config, options);
  LOOM_TRY(transport->init());
  return std::unique_ptr<Transport>(std::move(transport));
}

Result<FabricOptions> fabric_options_from_settings(const NetworkSettings& settings) {
  FabricOptions options;
  options.domain = settings.net_device;
  if (!settings.fabric_provider.empty()) {
    options.provider = settings.fabric_provider;
    LOOM_TRY(probe_fabric(options).status());
    return options;
  }
  // Hardware providers first; tcp works anywhere but is slow.
  std::string tried;
  for (const char* provider : {"efa", "verbs", "tcp"}) {
    options.provider = provider;
    Result<std::string> found = probe_fabric(options);
    if (found.ok()) return options;
    if (found.status().message().find("cannot load") != std::string::npos) return found.status();
    tried += std::string(tried.empty() ? "" : "; ") + found.status().message();
  }
  return Status::unsupported("fabric: no provider offers RMA here (" + tried + ")");
}

Result<std::string> probe_fabric(const FabricOptions& options) {
  LOOM_ASSIGN_OR_RETURN(const FabricApi* api, load_fabric_api(options.library));
  InfoList list;
  fi_info* chosen = nullptr;
  bool ordered = false;
  LOOM_TRY(choose_info(*api, options, list, &chosen, &ordered));
  return describe_info(*api, chosen, ordered);
}

}  // namespace loom::runtime::net
