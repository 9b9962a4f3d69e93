#include "runtime/transports/verbs.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "core/log.h"
#include "runtime/transports/shared_library.h"

namespace loom::runtime::net {
namespace {

// ---- the real table ------------------------------------------------------------------------------

// ibv_query_port is an inline over the context's extended ops, with the exported (compat) symbol
// as fallback; this is that inline, with the symbol taken from dlsym.
using CompatQueryPort = int (*)(ibv_context*, uint8_t, _compat_ibv_port_attr*);
CompatQueryPort g_compat_query_port = nullptr;

int real_query_port(ibv_context* context, uint8_t port, ibv_port_attr* attr) {
  verbs_context* vctx = verbs_get_ctx_op(context, query_port);
  if (vctx == nullptr) {
    std::memset(attr, 0, sizeof(*attr));
    return g_compat_query_port(context, port, reinterpret_cast<_compat_ibv_port_attr*>(attr));
  }
  return vctx->query_port(context, port, attr, sizeof(*attr));
}
// The fast-path verbs are inlines through the objects' operation tables.
int real_post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) { return ibv_post_send(qp, wr, bad); }
int real_poll_cq(ibv_cq* cq, int n, ibv_wc* wc) { return ibv_poll_cq(cq, n, wc); }
void real_wr_start(ibv_qp_ex* qp) { ibv_wr_start(qp); }
void real_wr_rdma_write(ibv_qp_ex* qp, uint32_t rkey, uint64_t addr) { ibv_wr_rdma_write(qp, rkey, addr); }
void real_wr_set_sge(ibv_qp_ex* qp, uint32_t lkey, uint64_t addr, uint32_t length) { ibv_wr_set_sge(qp, lkey, addr, length); }
void real_wr_set_ud_addr(ibv_qp_ex* qp, ibv_ah* ah, uint32_t qpn, uint32_t qkey) { ibv_wr_set_ud_addr(qp, ah, qpn, qkey); }
int real_wr_complete(ibv_qp_ex* qp) { return ibv_wr_complete(qp); }

template <typename Fn>
bool resolve(void* handle, Fn& fn, const char* name, const char* version) {
  void* symbol = version != nullptr ? ::dlvsym(handle, name, version) : nullptr;
  if (symbol == nullptr) symbol = ::dlsym(handle, name);
  fn = reinterpret_cast<Fn>(symbol);
  return symbol != nullptr;
}

}  // namespace

Result<const VerbsApi*> load_verbs_api(const std::string& verbs_library, const std::string& efa_library) {
  return load_api_once<VerbsApi>(verbs_library + "|" + efa_library, [&]() -> Result<const VerbsApi*> {
    LOOM_ASSIGN_OR_RETURN(void* handle, open_library(verbs_library, "verbs",
                                                     "install rdma-core (Debian: libibverbs1) or choose another LOOM_TRANSPORT"));
    auto* api = new VerbsApi();  // lives as long as the library: never freed
    api->source = verbs_library;
    const char* v = "IBVERBS_1.1";
    std::string missing;
    auto need = [&](auto& fn, const char* name, const char* version) {
      if (!resolve(handle, fn, name, version)) missing += std::string(missing.empty() ? "" : ", ") + name;
    };
    need(api->get_device_list, "ibv_get_device_list", v);
    need(api->free_device_list, "ibv_free_device_list", v);
    need(api->get_device_name, "ibv_get_device_name", v);
    need(api->open_device, "ibv_open_device", v);
    need(api->close_device, "ibv_close_device", v);
    need(api->query_device, "ibv_query_device", v);
    need(g_compat_query_port, "ibv_query_port", v);
    need(api->query_gid, "ibv_query_gid", v);
    need(api->alloc_pd, "ibv_alloc_pd", v);
    need(api->dealloc_pd, "ibv_dealloc_pd", v);
    need(api->reg_mr, "ibv_reg_mr", v);
    need(api->dereg_mr, "ibv_dereg_mr", v);
    need(api->create_cq, "ibv_create_cq", v);
    need(api->destroy_cq, "ibv_destroy_cq", v);
    need(api->create_qp, "ibv_create_qp", v);
    need(api->modify_qp, "ibv_modify_qp", v);
    need(api->destroy_qp, "ibv_destroy_qp", v);
    need(api->wc_status_str, "ibv_wc_status_str", v);
    need(api->create_ah, "ibv_create_ah", v);
    need(api->destroy_ah, "ibv_destroy_ah", v);
    if (!missing.empty()) {
      delete api;
      return Status::unsupported("verbs: " + verbs_library + " lacks " + missing);
    }
    api->query_port = real_query_port;
    api->post_send = real_post_send;
    api->poll_cq = real_poll_cq;
    // Optional: dma-buf registration (rdma-core >= 34) and the extended QP API (>= 1.6).
    resolve(handle, api->reg_dmabuf_mr, "ibv_reg_dmabuf_mr", "IBVERBS_1.12");
    if (resolve(handle, api->qp_to_qp_ex, "ibv_qp_to_qp_ex", "IBVERBS_1.6")) {
      api->wr_start = real_wr_start;
      api->wr_rdma_write = real_wr_rdma_write;
      api->wr_set_sge = real_wr_set_sge;
      api->wr_set_ud_addr = real_wr_set_ud_addr;
      api->wr_complete = real_wr_complete;
    }
    if (void* efa = ::dlopen(efa_library.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      resolve(efa, api->efadv_create_qp_ex, "efadv_create_qp_ex", nullptr);
      resolve(efa, api->efadv_query_device, "efadv_query_device", nullptr);
    }
    return static_cast<const VerbsApi*>(api);
  });
}

const char* wc_status_name(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_SUCCESS: return "IBV_WC_SUCCESS";
    case IBV_WC_LOC_LEN_ERR: return "IBV_WC_LOC_LEN_ERR";
    case IBV_WC_LOC_QP_OP_ERR: return "IBV_WC_LOC_QP_OP_ERR";
    case IBV_WC_LOC_EEC_OP_ERR: return "IBV_WC_LOC_EEC_OP_ERR";
    case IBV_WC_LOC_PROT_ERR: return "IBV_WC_LOC_PROT_ERR";
    case IBV_WC_WR_FLUSH_ERR: return "IBV_WC_WR_FLUSH_ERR";
    case IBV_WC_MW_BIND_ERR: return "IBV_WC_MW_BIND_ERR";
    case IBV_WC_BAD_RESP_ERR: return "IBV_WC_BAD_RESP_ERR";
    case IBV_WC_LOC_ACCESS_ERR: return "IBV_WC_LOC_ACCESS_ERR";
    case IBV_WC_REM_INV_REQ_ERR: return "IBV_WC_REM_INV_REQ_ERR";
    case IBV_WC_REM_ACCESS_ERR: return "IBV_WC_REM_ACCESS_ERR";
    case IBV_WC_REM_OP_ERR: return "IBV_WC_REM_OP_ERR";
    case IBV_WC_RETRY_EXC_ERR: return "IBV_WC_RETRY_EXC_ERR";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "IBV_WC_RNR_RETRY_EXC_ERR";
    case IBV_WC_LOC_RDD_VIOL_ERR: return "IBV_WC_LOC_RDD_VIOL_ERR";
    case IBV_WC_REM_INV_RD_REQ_ERR: return "IBV_WC_REM_INV_RD_REQ_ERR";
    case IBV_WC_REM_ABORT_ERR: return "IBV_WC_REM_ABORT_ERR";
    case IBV_WC_INV_EECN_ERR: return "IBV_WC_INV_EECN_ERR";
    case IBV_WC_INV_EEC_STATE_ERR: return "IBV_WC_INV_EEC_STATE_ERR";
    case IBV_WC_FATAL_ERR: return "IBV_WC_FATAL_ERR";
    case IBV_WC_RESP_TIMEOUT_ERR: return "IBV_WC_RESP_TIMEOUT_ERR";
    case IBV_WC_GENERAL_ERR: return "IBV_WC_GENERAL_ERR";
    case IBV_WC_TM_ERR: return "IBV_WC_TM_ERR";
    case IBV_WC_TM_RNDV_INCOMPLETE: return "IBV_WC_TM_RNDV_INCOMPLETE";
  }
  return "IBV_WC_(unknown)";
}

namespace {

// ---- wire formats ---------------------------------------------------------------------------------

enum class Mode : uint8_t { kRc = 1, kSrd = 2 };

// Endpoint blob: this header, then world_size queue pair numbers (RC: the QP this rank created
// for each peer, 0 for non-peers; SRD: unused, the header's qpn serves every peer).
struct EndpointHeader {
  uint32_t magic;       // "LVRB"
  uint16_t version;
  uint8_t mode;         // Mode
  uint8_t link_layer;   // IBV_LINK_LAYER_*
  uint16_t lid;
  uint8_t mtu;          // ibv_mtu
  uint8_t port;
  uint8_t gid[16];
  uint32_t world_size;
  uint32_t srd_qpn;
  uint32_t qkey;
};
static_assert(sizeof(EndpointHeader) == 40, "fixed endpoint header: 40 bytes, then 4 bytes per rank");
constexpr uint32_t kEndpointMagic = 0x4252564c;  // "LVRB" in memory order
constexpr uint16_t kEndpointVersion = 1;

// remote_key bytes of a verbs registration.
struct WireKey {
  uint64_t address;
  uint32_t rkey;
  uint32_t reserved;
  uint64_t bytes;
};
static_assert(sizeof(WireKey) == 24, "address, rkey, pad, length");

constexpr uint32_t kQkey = 0x4c4f4f4d;  // SRD queue key: any value both sides agree on
// rdma-core releases older than v47 lack the name; the bit is EFA's "RDMA write supported".
constexpr uint32_t kEfaCapRdmaWrite = 1u << 3;
constexpr uint16_t kAmazonVendorId = 0x1d0f;

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

const char* link_layer_name(uint8_t link_layer) {
  return link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : link_layer == IBV_LINK_LAYER_INFINIBAND ? "InfiniBand" : "unspecified link";
}

// ---- device selection (shared by the probe and the factory) -------------------------------------

struct OpenedDevice {
  ibv_context* context = nullptr;
  std::string name;
  ibv_device_attr device_attr{};
  ibv_port_attr port_attr{};
  bool efa = false;
  efadv_device_attr efa_attr{};
};

Result<OpenedDevice> open_device(const VerbsApi& api, const VerbsOptions& options) {
  int count = 0;
  ibv_device** list = api.get_device_list(&count);
  if (list == nullptr || count == 0) {
    if (list != nullptr) api.free_device_list(list);
    return Status::unsupported("verbs: no RDMA devices (ibv_get_device_list found none)");
  }
  std::string seen;
  std::string inactive;
  OpenedDevice found;
  for (int i = 0; i < count && found.context == nullptr; ++i) {
    const char* name = api.get_device_name(list[i]);
    const std::string device_name = name != nullptr ? name : "?";
    seen += (seen.empty() ? "" : ", ") + device_name;
    if (!options.device.empty() && options.device != device_name) continue;
    ibv_context* context = api.open_device(list[i]);
    if (context == nullptr) {
      inactive += " " + device_name + " (open failed: " + errno_text(errno) + ")";
      continue;
    }
    OpenedDevice d;
    d.context = context;
    d.name = device_name;
    if (api.query_device(context, &d.device_attr) != 0 || api.query_port(context, options.port, &d.port_attr) != 0) {
      inactive += " " + device_name + " (query failed)";
      api.close_device(context);
      continue;
    }
    if (d.port_attr.state != IBV_PORT_ACTIVE) {
      inactive += " " + device_name + " (port " + std::to_string(options.port) + " not active)";
      api.close_device(context);
      continue;
    }
    // EFA: the Amazon vendor id, confirmed by efadv (which also says whether RDMA write exists).
    if (d.device_attr.vendor_id == kAmazonVendorId) {
      if (api.efadv_query_device == nullptr || api.efadv_create_qp_ex == nullptr || api.qp_to_qp_ex == nullptr) {
        inactive += " " + device_name + " (EFA device, but libefa or the extended QP API is missing)";
        api.close_device(context);
        continue;
      }
      if (api.efadv_query_device(context, &d.efa_attr, sizeof(d.efa_attr)) != 0 ||
          (d.efa_attr.device_caps & kEfaCapRdmaWrite) == 0) {
        inactive += " " + device_name + " (EFA device without RDMA write)";
        api.close_device(context);
        continue;
      }
      d.efa = true;
    }
    found = d;
  }
  api.free_device_list(list);
  if (found.context == nullptr) {
    if (!options.device.empty() && seen.find(options.device) == std::string::npos) {
      return Status::unsupported("verbs: device '" + options.device + "' not found (devices: " + seen + ")");
    }
    return Status::unsupported("verbs: no usable device:" + inactive);
  }
  return found;
}

std::string describe_device(const OpenedDevice& d, uint8_t port) {
  return d.name + " port " + std::to_string(port) + " (" + (d.efa ? "EFA, SRD" : std::string(link_layer_name(d.port_attr.link_layer)) + ", RC") + ")";
}

// ---- the transport ---------------------------------------------------------------------------------

class VerbsTransport final : public TransportBase {
 public:
  VerbsTransport(const VerbsApi& api, TransportConfig config, VerbsOptions options)
      : TransportBase(TransportKind::kVerbs, "verbs"),
        api_(api), config_(std::move(config)), options_(std::move(options)) {}
  ~VerbsTransport() override { (void)close(); }

  Status init() {
    LOOM_ASSIGN_OR_RETURN(device_, open_device(api_, options_));
    mode_ = device_.efa ? Mode::kSrd : Mode::kRc;
    describe_ = describe_device(device_, options_.port);
    caps_.ordered_writes = mode_ == Mode::kRc;
    caps_.max_outstanding = options_.queue_depth;
    const uint64_t max_message = mode_ == Mode::kSrd ? device_.efa_attr.max_rdma_size : device_.port_attr.max_msg_sz;
    caps_.max_write_bytes = std::clamp<uint64_t>(max_message, 4096, uint64_t{1} << 30);
    if (mode_ == Mode::kSrd || device_.port_attr.link_layer == IBV_LINK_LAYER_ETHERNET) {
      if (api_.query_gid(device_.context, options_.port, options_.gid_index, &gid_) != 0) {
        return Status::system_error("verbs: ibv_query_gid(" + device_.name + ", index " +
                                    std::to_string(options_.gid_index) + "): " + errno_text(errno));
      }
    }
    pd_ = api_.alloc_pd(device_.context);
    if (pd_ == nullptr) return Status::system_error("verbs: ibv_alloc_pd(" + device_.name + "): " + errno_text(errno));

    int peers = 0;
    for (int r = 0; r < config_.world_size; ++r) peers += config_.peers[r] ? 1 : 0;
    const int wanted_cqe = static_cast<int>(std::min<uint64_t>(uint64_t{options_.queue_depth} * std::max(1, peers) * 2, 1u << 20));
    const int cqe = device_.device_attr.max_cqe > 0 ? std::min(wanted_cqe, device_.device_attr.max_cqe) : wanted_cqe;
    cq_ = api_.create_cq(device_.context, cqe, nullptr, nullptr, 0);
    if (cq_ == nullptr) return Status::system_error("verbs: ibv_create_cq(" + std::to_string(cqe) + "): " + errno_text(errno));

    qps_.assign(static_cast<size_t>(config_.world_size), nullptr);
    outstanding_per_peer_.assign(static_cast<size_t>(config_.world_size), 0);
    if (mode_ == Mode::kRc) {
      for (int r = 0; r < config_.world_size; ++r) {
        if (r == config_.rank || !config_.peers[r]) continue;
        LOOM_ASSIGN_OR_RETURN(qps_[r], create_rc_qp(r));
      }
    } else {
      LOOM_TRY(create_srd_qp());
      ahs_.assign(static_cast<size_t>(config_.world_size), nullptr);
      remote_qpns_.assign(static_cast<size_t>(config_.world_size), 0);
    }
    // Flag staging for queue pairs without inline data (SRD; RC devices with no inline room).
    flag_staging_.assign(options_.queue_depth, 0);
    for (uint32_t i = 0; i < options_.queue_depth; ++i) free_staging_.push_back(options_.queue_depth - 1 - i);
    LOOM_ASSIGN_OR_RETURN(LocalRegistration staging,
                          register_memory({flag_staging_.data(), flag_staging_.size() * sizeof(uint64_t), MemoryKind::kHost, -1,
                                           /*remote_write=*/false}));
    staging_handle_ = staging.handle;
    LOOM_INFO("verbs transport: %s, %d peers, queue depth %u", describe_.c_str(), peers, options_.queue_depth);
    return {};
  }

  Result<LocalRegistration> register_memory(const MemoryRegion& region) override {
    LOOM_TRY(check_registrable(region));
    // No IBV_ACCESS_RELAXED_ORDERING: the flag must never be placed before its data.
    const int access = IBV_ACCESS_LOCAL_WRITE | (region.remote_write ? IBV_ACCESS_REMOTE_WRITE : 0);
    ibv_mr* mr = nullptr;
    std::string dmabuf_note;
    if (region.kind == MemoryKind::kDevice && options_.export_dmabuf && api_.reg_dmabuf_mr != nullptr) {
      Result<int> fd = options_.export_dmabuf(region.base, region.bytes);
      if (fd.ok()) {
        mr = api_.reg_dmabuf_mr(pd_, 0, region.bytes, reinterpret_cast<uint64_t>(region.base), *fd, access);
        const int err = errno;
        ::close(*fd);  // the registration holds its own reference to the buffer
        if (mr == nullptr) dmabuf_note = "ibv_reg_dmabuf_mr: " + errno_text(err);
      } else {
        dmabuf_note = fd.status().to_string();
      }
      if (mr == nullptr) {
        LOOM_INFO("verbs: dma-buf registration of %llu bytes failed (%s); trying ibv_reg_mr (nvidia-peermem)",
                  static_cast<unsigned long long>(region.bytes), dmabuf_note.c_str());
      }
    }
    if (mr == nullptr) {
      mr = api_.reg_mr(pd_, region.base, region.bytes, access);
      if (mr == nullptr) {
        return Status::system_error("verbs: ibv_reg_mr(" + std::to_string(region.bytes) + " bytes of " +
                                    (region.kind == MemoryKind::kDevice ? "GPU" : "host") + " memory): " +
                                    errno_text(errno) + (dmabuf_note.empty() ? "" : "; before that " + dmabuf_note));
      }
    }
    mrs_.push_back(LocalMr{mr, static_cast<char*>(region.base), region.bytes});
    LocalRegistration out;
    out.handle = static_cast<uint32_t>(mrs_.size() - 1);
    out.bytes = region.bytes;
    WireKey key{reinterpret_cast<uint64_t>(region.base), mr->rkey, 0, region.bytes};
    out.remote_key.resize(sizeof(key));
    std::memcpy(out.remote_key.data(), &key, sizeof(key));
    return out;
  }

  Result<std::vector<uint8_t>> local_endpoint() override {
    LOOM_TRY(check_open());
    EndpointHeader h{};
    h.magic = kEndpointMagic;
    h.version = kEndpointVersion;
    h.mode = static_cast<uint8_t>(mode_);
    h.link_layer = device_.port_attr.link_layer;
    h.lid = device_.port_attr.lid;
    h.mtu = static_cast<uint8_t>(device_.port_attr.active_mtu);
    h.port = options_.port;
    std::memcpy(h.gid, gid_.raw, sizeof(h.gid));
    h.world_size = static_cast<uint32_t>(config_.world_size);
    h.srd_qpn = srd_qp_ != nullptr ? srd_qp_->qp_num : 0;
    h.qkey = kQkey;
    std::vector<uint8_t> blob(sizeof(h) + 4 * static_cast<size_t>(config_.world_size));
    std::memcpy(blob.data(), &h, sizeof(h));
    for (int r = 0; r < config_.world_size; ++r) {
      const uint32_t qpn = qps_[r] != nullptr ? qps_[r]->qp_num : 0;
      std::memcpy(blob.data() + sizeof(h) + 4 * static_cast<size_t>(r), &qpn, 4);
    }
    return blob;
  }

  Status connect(std::span<const std::vector<uint8_t>> endpoints) override {
    if (endpoints.size() != static_cast<size_t>(config_.world_size)) return Status::internal("verbs: endpoint count");
    for (int r = 0; r < config_.world_size; ++r) {
      if (r == config_.rank || !config_.peers[r]) continue;
      const std::vector<uint8_t>& blob = endpoints[r];
      EndpointHeader h{};
      if (blob.size() != sizeof(h) + 4 * static_cast<size_t>(config_.world_size)) {
        return Status::internal("verbs: endpoint of rank " + std::to_string(r) + " has " + std::to_string(blob.size()) + " bytes");
      }
      std::memcpy(&h, blob.data(), sizeof(h));
      if (h.magic != kEndpointMagic || h.version != kEndpointVersion ||
          h.world_size != static_cast<uint32_t>(config_.world_size)) {
        return Status::internal("verbs: endpoint of rank " + std::to_string(r) + " is not a loom verbs endpoint");
      }
      if (h.mode != static_cast<uint8_t>(mode_)) {
        return Status::unsupported("verbs: rank " + std::to_string(r) + " uses " + (h.mode == 1 ? "RC" : "SRD") +
                                   " but this rank uses " + (mode_ == Mode::kRc ? "RC" : "SRD") +
                                   " (mixed EFA and ConnectX jobs are not supported)");
      }
      uint32_t peer_qpn = 0;
      std::memcpy(&peer_qpn, blob.data() + sizeof(h) + 4 * static_cast<size_t>(config_.rank), 4);
      if (mode_ == Mode::kRc) {
        LOOM_TRY_CTX(connect_rc(r, h, peer_qpn), "verbs: connecting to rank " + std::to_string(r));
      } else {
        LOOM_TRY_CTX(connect_srd(r, h), "verbs: connecting to rank " + std::to_string(r));
      }
    }
    return {};
  }

  Result<uint32_t> import_remote(int rank, std::span<const uint8_t> remote_key, uint64_t bytes) override {
    WireKey key{};
    if (remote_key.size() != sizeof(key)) {
      return Status::internal("verbs: window key of rank " + std::to_string(rank) + " has " +
                              std::to_string(remote_key.size()) + " bytes");
    }
    std::memcpy(&key, remote_key.data(), sizeof(key));
    if (key.bytes != bytes) return Status::internal("verbs: window size of rank " + std::to_string(rank) + " disagrees");
    if (!connected(rank)) return Status::internal("verbs: window of rank " + std::to_string(rank) + ", which is not connected");
    remotes_.push_back(RemoteMr{rank, key.address, key.rkey, key.bytes});
    return static_cast<uint32_t>(remotes_.size() - 1);
  }

  Result<size_t> post_writes(std::span<const WriteOp> ops) override {
    LOOM_TRY(check_open());
    size_t taken = 0;
    for (const WriteOp& op : ops) {
      if (op.local >= mrs_.size() || op.remote >= remotes_.size() || remotes_[op.remote].rank != op.rank) {
        return Status::internal("verbs: write " + std::to_string(op.id) + " names an unknown registration");
      }
      const LocalMr& local = mrs_[op.local];
      const RemoteMr& remote = remotes_[op.remote];
      if (!within(op.local_offset, op.bytes, local.bytes) || !within(op.remote_offset, op.bytes, remote.bytes) ||
          op.bytes > caps_.max_write_bytes) {
        return Status::internal("verbs: write " + std::to_string(op.id) + " outside its registration");
      }
      LOOM_ASSIGN_OR_RETURN(bool posted, post(op.id, op.rank, local.mr->lkey, reinterpret_cast<uint64_t>(local.base) + op.local_offset,
                                              static_cast<uint32_t>(op.bytes), remote.rkey, remote.address + op.remote_offset,
                                              /*inline_flag=*/false, -1));
      if (!posted) break;
      ++taken;
    }
    return taken;
  }

  Result<bool> post_flag(const FlagOp& op) override {
    LOOM_TRY(check_open());
    if (!flag_in_window(remotes_, op)) {
      return Status::internal("verbs: flag outside its window");
    }
    const RemoteMr& remote = remotes_[op.remote];
    if (mode_ == Mode::kRc && max_inline_ >= sizeof(uint64_t)) {
      // Inline: the value is copied into the work request at post time.
      inline_value_ = op.value;
      return post(op.id, op.rank, 0, reinterpret_cast<uint64_t>(&inline_value_), sizeof(uint64_t), remote.rkey,
                  remote.address + op.remote_offset, /*inline_flag=*/true, -1);
    }
    if (free_staging_.empty()) return false;
    const uint32_t slot = free_staging_.back();
    flag_staging_[slot] = op.value;
    const LocalMr& staging = mrs_[staging_handle_];
    LOOM_ASSIGN_OR_RETURN(bool posted, post(op.id, op.rank, staging.mr->lkey, reinterpret_cast<uint64_t>(&flag_staging_[slot]),
                                            sizeof(uint64_t), remote.rkey, remote.address + op.remote_offset,
                                            /*inline_flag=*/false, static_cast<int>(slot)));
    if (posted) free_staging_.pop_back();
    return posted;
  }

  Status poll(std::vector<Completion>& out) override {
    if (closed_) return {};
    ibv_wc wc[32];
    while (true) {
      const int n = api_.poll_cq(cq_, 32, wc);
      if (n < 0) return Status::system_error("verbs: ibv_poll_cq(" + device_.name + ") failed: " + std::to_string(n));
      for (int i = 0; i < n; ++i) {
        Completion c;
        c.id = wc[i].wr_id;
        auto it = in_flight_.find(wc[i].wr_id);
        int rank = -1;
        if (it != in_flight_.end()) {
          rank = it->second.rank;
          if (rank >= 0) --outstanding_per_peer_[rank];
          if (it->second.staging_slot >= 0) free_staging_.push_back(static_cast<uint32_t>(it->second.staging_slot));
          in_flight_.erase(it);
        }
        if (wc[i].status != IBV_WC_SUCCESS) c.status = completion_error(wc[i], rank);
        out.push_back(std::move(c));
      }
      if (n < 32) return {};
    }
  }

  uint32_t outstanding() const override { return static_cast<uint32_t>(in_flight_.size()); }

  Status close() override {
    if (closed_) return {};
    closed_ = true;
    Status first;
    auto note = [&](int rc, const std::string& what) {
      if (rc != 0 && first.ok()) first = Status::system_error("verbs: " + what + ": " + errno_text(rc > 0 ? rc : errno));
    };
    for (ibv_ah* ah : ahs_) {
      if (ah != nullptr) note(api_.destroy_ah(ah), "ibv_destroy_ah");
    }
    for (ibv_qp* qp : qps_) {
      if (qp != nullptr) note(api_.destroy_qp(qp), "ibv_destroy_qp");
    }
    if (srd_qp_ != nullptr) note(api_.destroy_qp(srd_qp_), "ibv_destroy_qp");
    if (cq_ != nullptr) note(api_.destroy_cq(cq_), "ibv_destroy_cq");
    for (LocalMr& m : mrs_) note(api_.dereg_mr(m.mr), "ibv_dereg_mr");
    if (pd_ != nullptr) note(api_.dealloc_pd(pd_), "ibv_dealloc_pd");
    if (device_.context != nullptr) note(api_.close_device(device_.context), "ibv_close_device");
    ahs_.clear();
    qps_.clear();
    srd_qp_ = nullptr;
    cq_ = nullptr;
    mrs_.clear();
    pd_ = nullptr;
    device_.context = nullptr;
    return first;
  }

 private:
  struct LocalMr {
    ibv_mr* mr;
    char* base;
    uint64_t bytes;
  };
  struct RemoteMr {
    int rank;
    uint64_t address;
    uint32_t rkey;
    uint64_t bytes;
  };
  struct InFlight {
    int rank;
    int staging_slot;  // -1: none
  };

  bool connected(int rank) const {
    if (rank < 0 || rank >= config_.world_size) return false;
    return mode_ == Mode::kRc ? qps_[rank] != nullptr : ahs_[rank] != nullptr;
  }

  Result<ibv_qp*> create_rc_qp(int rank) {
    ibv_qp_init_attr init{};
    init.send_cq = cq_;
    init.recv_cq = cq_;
    init.qp_type = IBV_QPT_RC;
    init.sq_sig_all = 0;
    init.cap.max_send_wr = options_.queue_depth;
    init.cap.max_recv_wr = 1;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    init.cap.max_inline_data = 64;
    ibv_qp* qp = api_.create_qp(pd_, &init);
    if (qp == nullptr) {
      return Status::system_error("verbs: ibv_create_qp(RC for rank " + std::to_string(rank) + "): " + errno_text(errno));
    }
    max_inline_ = std::min(max_inline_, init.cap.max_inline_data);  // the device may grant less
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = options_.port;
    attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
    const int rc = api_.modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (rc != 0) {
      api_.destroy_qp(qp);
      return Status::system_error("verbs: RC queue pair for rank " + std::to_string(rank) + " to INIT: " + errno_text(rc));
    }
    return qp;
  }

  Status connect_rc(int rank, const EndpointHeader& peer, uint32_t peer_qpn) {
    if (peer_qpn == 0) return Status::internal("peer created no queue pair for this rank");
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = static_cast<ibv_mtu>(std::min<int>(device_.port_attr.active_mtu, peer.mtu));
    attr.dest_qp_num = peer_qpn;
    attr.rq_psn = 0;
    attr.max_dest_rd_atomic = 1;
    attr.min_rnr_timer = 12;
    attr.ah_attr.port_num = options_.port;
    attr.ah_attr.dlid = peer.lid;
    attr.ah_attr.sl = 0;
    attr.ah_attr.src_path_bits = 0;
    // RoCE (and any fabric without LIDs) routes by GID.
    if (peer.link_layer == IBV_LINK_LAYER_ETHERNET || peer.lid == 0) {
      attr.ah_attr.is_global = 1;
      std::memcpy(attr.ah_attr.grh.dgid.raw, peer.gid, sizeof(peer.gid));
      attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(options_.gid_index);
      attr.ah_attr.grh.hop_limit = 255;
    }
    int rc = api_.modify_qp(qps_[rank], &attr,
                            IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc != 0) return Status::system_error("queue pair to RTR: " + errno_text(rc));
    ibv_qp_attr rts{};
    rts.qp_state = IBV_QPS_RTS;
    rts.timeout = options_.timeout;
    rts.retry_cnt = options_.retry_count;
    rts.rnr_retry = 7;
    rts.sq_psn = 0;
    rts.max_rd_atomic = 1;
    rc = api_.modify_qp(qps_[rank], &rts,
                        IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                            IBV_QP_MAX_QP_RD_ATOMIC);
    if (rc != 0) return Status::system_error("queue pair to RTS: " + errno_text(rc));
    return {};
  }

  Status create_srd_qp() {
    ibv_qp_init_attr_ex init{};
    init.send_cq = cq_;
    init.recv_cq = cq_;
    init.qp_type = IBV_QPT_DRIVER;
    init.cap.max_send_wr = options_.queue_depth;
    init.cap.max_recv_wr = 1;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    init.cap.max_inline_data = 0;
    init.pd = pd_;
    init.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    init.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE;
    efadv_qp_init_attr efa{};
    efa.driver_qp_type = EFADV_QP_DRIVER_TYPE_SRD;
    srd_qp_ = api_.efadv_create_qp_ex(device_.context, &init, &efa, sizeof(efa));
    if (srd_qp_ == nullptr) return Status::system_error("verbs: efadv_create_qp_ex(SRD): " + errno_text(errno));
    max_inline_ = 0;
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = options_.port;
    attr.qkey = kQkey;
    int rc = api_.modify_qp(srd_qp_, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY);
    if (rc != 0) return Status::system_error("verbs: SRD queue pair to INIT: " + errno_text(rc));
    ibv_qp_attr rtr{};
    rtr.qp_state = IBV_QPS_RTR;
    rc = api_.modify_qp(srd_qp_, &rtr, IBV_QP_STATE);
    if (rc != 0) return Status::system_error("verbs: SRD queue pair to RTR: " + errno_text(rc));
    ibv_qp_attr rts{};
    rts.qp_state = IBV_QPS_RTS;
    rts.sq_psn = 0;
    rc = api_.modify_qp(srd_qp_, &rts, IBV_QP_STATE | IBV_QP_SQ_PSN);
    if (rc != 0) return Status::system_error("verbs: SRD queue pair to RTS: " + errno_text(rc));
    srd_qpx_ = api_.qp_to_qp_ex(srd_qp_);
    if (srd_qpx_ == nullptr) return Status::system_error("verbs: ibv_qp_to_qp_ex(SRD) returned null");
    return {};
  }

  Status connect_srd(int rank, const EndpointHeader& peer) {
    ibv_ah_attr attr{};
    attr.port_num = options_.port;
    attr.is_global = 1;
    std::memcpy(attr.grh.dgid.raw, peer.gid, sizeof(peer.gid));
    attr.grh.sgid_index = static_cast<uint8_t>(options_.gid_index);
    ibv_ah* ah = api_.create_ah(pd_, &attr);
    if (ah == nullptr) return Status::system_error("ibv_create_ah: " + errno_text(errno));
    ahs_[rank] = ah;
    remote_qpns_[rank] = peer.srd_qpn;
    return {};
  }

  // One signaled RDMA write; false when the queue is full.
  Result<bool> post(uint64_t id, int rank, uint32_t lkey, uint64_t address, uint32_t length, uint32_t rkey,
                    uint64_t remote_address, bool inline_flag, int staging_slot) {
    // RC: one send queue per peer; SRD: one send queue for all (the CQ holds twice either).
    if (outstanding_per_peer_[rank] >= options_.queue_depth) return false;
    if (mode_ == Mode::kSrd && in_flight_.size() >= options_.queue_depth) return false;
    if (mode_ == Mode::kRc) {
      ibv_sge sge{address, length, lkey};
      ibv_send_wr wr{};
      wr.wr_id = id;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.send_flags = IBV_SEND_SIGNALED | (inline_flag ? IBV_SEND_INLINE : 0);
      wr.wr.rdma.remote_addr = remote_address;
      wr.wr.rdma.rkey = rkey;
      ibv_send_wr* bad = nullptr;
      const int rc = api_.post_send(qps_[rank], &wr, &bad);
      if (rc == ENOMEM) return false;  // send queue full
      if (rc != 0) {
        return Status::system_error("verbs: ibv_post_send(" + std::to_string(length) + " bytes to rank " +
                                    std::to_string(rank) + "): " + errno_text(rc));
      }
    } else {
      api_.wr_start(srd_qpx_);
      srd_qpx_->wr_id = id;
      srd_qpx_->wr_flags = IBV_SEND_SIGNALED;
      api_.wr_rdma_write(srd_qpx_, rkey, remote_address);
      api_.wr_set_sge(srd_qpx_, lkey, address, length);
      api_.wr_set_ud_addr(srd_qpx_, ahs_[rank], remote_qpns_[rank], kQkey);
      const int rc = api_.wr_complete(srd_qpx_);
      if (rc == ENOMEM) return false;  // EFA reports a full send queue this way, before its nominal depth
      if (rc != 0) {
        return Status::system_error("verbs: ibv_wr_complete(" + std::to_string(length) + " bytes to rank " +
                                    std::to_string(rank) + "): " + errno_text(rc));
      }
    }
    ++outstanding_per_peer_[rank];
    in_flight_[id] = InFlight{rank, staging_slot};
    return true;
  }

  Status completion_error(const ibv_wc& wc, int rank) const {
    const char* prose = api_.wc_status_str != nullptr ? api_.wc_status_str(wc.status) : "";
    std::string what = "verbs: " + std::string((wc.wr_id >> 63) != 0 ? "flag" : "RDMA") + " write to rank " +
                       std::to_string(rank) + " failed on " + device_.name + ": " + prose + " (" +
                       wc_status_name(wc.status) + ", vendor error 0x" +
                       [&] {
                         char hex[16];
                         std::snprintf(hex, sizeof(hex), "%x", wc.vendor_err);
                         return std::string(hex);
                       }() + ")";
    switch (wc.status) {
      case IBV_WC_REM_ACCESS_ERR:
      case IBV_WC_REM_OP_ERR:
      case IBV_WC_REM_INV_REQ_ERR:
      case IBV_WC_REM_ABORT_ERR:
      case IBV_WC_RETRY_EXC_ERR:
      case IBV_WC_RNR_RETRY_EXC_ERR:
      case IBV_WC_RESP_TIMEOUT_ERR:
        return Status::peer_failure(what);  // the peer (or the path to it) failed the operation
      default:
        return Status::system_error(what);
    }
  }

  const VerbsApi& api_;
  TransportConfig config_;
  VerbsOptions options_;
  OpenedDevice device_;
  Mode mode_ = Mode::kRc;
  ibv_gid gid_{};
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  std::vector<ibv_qp*> qps_;           // RC: [world], null for non-peers
  ibv_qp* srd_qp_ = nullptr;
  ibv_qp_ex* srd_qpx_ = nullptr;
  std::vector<ibv_ah*> ahs_;           // SRD: [world]
  std::vector<uint32_t> remote_qpns_;  // SRD: [world]
  uint32_t max_inline_ = 64;
  uint64_t inline_value_ = 0;
  std::vector<LocalMr> mrs_;
  std::vector<RemoteMr> remotes_;
  std::vector<uint64_t> flag_staging_;
  std::vector<uint32_t> free_staging_;
  uint32_t staging_handle_ = 0;
  std::vector<uint32_t> outstanding_per_peer_;
  std::unordered_map<uint64_t, InFlight> in_flight_;
};

}  // namespace

Result<std::unique_ptr<Transport>> create_verbs_transport(const TransportConfig& config, const VerbsOptions& options) {
  if (config.world_size < 1 || config.rank < 0 || config.rank >= config.world_size ||
      config.peers.size() != static_cast<size_t>(config.world_size)) {
    return Status::invalid_argument("verbs: inconsistent transport config");
  }
  if (options.queue_depth == 0) return Status::invalid_argument("verbs: queue depth 0");
  const VerbsApi* api = options.api;
  if (api == nullptr) {
    LOOM_ASSIGN_OR_RETURN(api, load_verbs_api(options.library, options.efa_library));
  }
  auto transport = std::make_unique<VerbsTransport>(*api, config, options);
  LOOM_TRY(transport->init());
  return std::unique_ptr<Transport>(std::move(transport));
}

VerbsOptions verbs_options_from_settings(const NetworkSettings& settings) {
  VerbsOptions options;
  options.device = settings.net_device;
  options.gid_index = settings.ib_gid_index;
  return options;
}

Result<std::string> probe_verbs(const VerbsOptions& options) {
  const VerbsApi* api = options.api;
  if (api == nullptr) {
    LOOM_ASSIGN_OR_RETURN(api, load_verbs_api(options.library, options.efa_library));
  }
  LOOM_ASSIGN_OR_RETURN(OpenedDevice device, open_device(*api, options));
  std::string description = describe_device(device, options.port);
  api->close_device(device.context);
  return description;
}

}  // namespace loom::runtime::net
