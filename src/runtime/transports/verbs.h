// verbs: the Transport over libibverbs.
//
// Two modes, chosen from the device:
//   RC   (ConnectX, InfiniBand or RoCE) one reliable-connected queue pair per peer. Writes to a
//        peer are placed in order, so the arrival flag (an 8-byte inline RDMA write) is posted
//        right behind its data.
//   SRD  (AWS EFA, through efadv) one scalable-reliable-datagram queue pair and an address
//        handle per peer, posted through the extended work-request API. SRD delivers out of
//        order: the transport is unordered and the proxy posts a flag only after its data's
//        completion. Flags are staged in registered memory (EFA drops IBV_SEND_INLINE on this
//        path). Write-with-immediate is not used: it would need a receive-side host hop.
//
// Every libibverbs / libefa function loom calls goes through VerbsApi, a table of function
// pointers: load_verbs_api() fills it with dlopen/dlsym (the inline verbs, ibv_post_send and
// ibv_poll_cq, become small wrappers), and tests fill it with a fake. loom never links
// rdma-core; without it the factory returns unsupported.
//
// GPU memory is registered through dma-buf (ibv_reg_dmabuf_mr with a file descriptor from
// cuMemGetHandleForAddressRange, supplied by VerbsOptions::export_dmabuf because this file is
// host-only); when that is unavailable or fails, through ibv_reg_mr (nvidia-peermem). Relaxed
// ordering is never requested: it would let the NIC place the flag before the data.
//
// Every work request is signaled; an error completion becomes a Status naming the peer and
// the verbs status (ibv_wc_status_str and the IBV_WC_* name).
#pragma once

#include <infiniband/efadv.h>
#include <infiniband/verbs.h>

#include <functional>
#include <memory>
#include <string>

#include "loom/status.h"
#include "runtime/transports/transport.h"

namespace loom::runtime::net {

// Member names are the verbs without their ibv_ prefix. EFA entries are null when libefa is
// absent; reg_dmabuf_mr is null with rdma-core older than v34.
struct VerbsApi {
  ibv_device** (*get_device_list)(int* num_devices) = nullptr;
  void (*free_device_list)(ibv_device** list) = nullptr;
  const char* (*get_device_name)(ibv_device* device) = nullptr;
  ibv_context* (*open_device)(ibv_device* device) = nullptr;
  int (*close_device)(ibv_context* context) = nullptr;
  int (*query_device)(ibv_context* context, ibv_device_attr* attr) = nullptr;
  int (*query_port)(ibv_context* context, uint8_t port, ibv_port_attr* attr) = nullptr;
  int (*query_gid)(ibv_context* context, uint8_t port, int index, ibv_gid* gid) = nullptr;
  ibv_pd* (*alloc_pd)(ibv_context* context) = nullptr;
  int (*dealloc_pd)(ibv_pd* pd) = nullptr;
  ibv_mr* (*reg_mr)(ibv_pd* pd, void* addr, size_t length, int access) = nullptr;
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access) = nullptr;
  int (*dereg_mr)(ibv_mr* mr) = nullptr;
  ibv_cq* (*create_cq)(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel, int vector) = nullptr;
  int (*destroy_cq)(ibv_cq* cq) = nullptr;
  ibv_qp* (*create_qp)(ibv_pd* pd, ibv_qp_init_attr* attr) = nullptr;
  int (*modify_qp)(ibv_qp* qp, ibv_qp_attr* attr, int mask) = nullptr;
  int (*destroy_qp)(ibv_qp* qp) = nullptr;
  int (*post_send)(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) = nullptr;
  int (*poll_cq)(ibv_cq* cq, int entries, ibv_wc* wc) = nullptr;
  const char* (*wc_status_str)(ibv_wc_status status) = nullptr;
  // SRD (EFA)
  ibv_ah* (*create_ah)(ibv_pd* pd, ibv_ah_attr* attr) = nullptr;
  int (*destroy_ah)(ibv_ah* ah) = nullptr;
  ibv_qp_ex* (*qp_to_qp_ex)(ibv_qp* qp) = nullptr;
  ibv_qp* (*efadv_create_qp_ex)(ibv_context* context, ibv_qp_init_attr_ex* attr, efadv_qp_init_attr* efa_attr,
                                uint32_t inlen) = nullptr;
  int (*efadv_query_device)(ibv_context* context, efadv_device_attr* attr, uint32_t inlen) = nullptr;
  void (*wr_start)(ibv_qp_ex* qp) = nullptr;
  void (*wr_rdma_write)(ibv_qp_ex* qp, uint32_t rkey, uint64_t remote_addr) = nullptr;
  void (*wr_set_sge)(ibv_qp_ex* qp, uint32_t lkey, uint64_t addr, uint32_t length) = nullptr;
  void (*wr_set_ud_addr)(ibv_qp_ex* qp, ibv_ah* ah, uint32_t remote_qpn, uint32_t remote_qkey) = nullptr;
  int (*wr_complete)(ibv_qp_ex* qp) = nullptr;
  std::string source;  // the library it came from ("libibverbs.so.1"), or a fake's name
};

// The table from the real libraries (opened once per path, never closed). unsupported when
// libibverbs cannot be loaded; a missing libefa only leaves the EFA entries null.
Result<const VerbsApi*> load_verbs_api(const std::string& verbs_library = "libibverbs.so.1",
                                       const std::string& efa_library = "libefa.so.1");

struct VerbsOptions {
  const VerbsApi* api = nullptr;        // null: load_verbs_api(library, efa_library)
  std::string library = "libibverbs.so.1";
  std::string efa_library = "libefa.so.1";
  std::string device;                   // "" : the first device with an active port
  uint8_t port = 1;
  int gid_index = 0;                    // RoCE and EFA address (LOOM_IB_GID_INDEX)
  uint32_t queue_depth = 256;           // send queue entries per queue pair
  uint8_t timeout = 14;                 // RC ack timeout 4.096 us * 2^timeout (reliability H8)
  uint8_t retry_count = 7;
  // Device memory: a dma-buf fd for [base, base + bytes), or an error (then ibv_reg_mr is tried).
  std::function<Result<int>(void* base, uint64_t bytes)> export_dmabuf;
};

// Options from the environment: LOOM_NET_DEVICE, LOOM_IB_GID_INDEX (the dma-buf exporter is the
// caller's to set: it needs the CUDA driver).
VerbsOptions verbs_options_from_settings(const NetworkSettings& settings);

// A transport for `config`'s peers on the chosen device; unsupported without libibverbs, without
// a device or without an active port.
Result<std::unique_ptr<Transport>> create_verbs_transport(const TransportConfig& config, const VerbsOptions& options);

// "mlx5_0 port 1 (InfiniBand, RC)" / "rdmap0s6 port 1 (EFA, SRD)", or unsupported with the reason.
Result<std::string> probe_verbs(const VerbsOptions& options);

// "IBV_WC_REM_ACCESS_ERR" for a completion status (the table's wc_status_str gives the prose).
const char* wc_status_name(ibv_wc_status status);

}  // namespace loom::runtime::net
