// fabric: the Transport over libfabric RMA (FI_RMA on FI_EP_RDM endpoints).
//
// libfabric is opened with dlopen ("libfabric.so.1"); only the few exported entry points are
// resolved (fi_getinfo, fi_freeinfo, fi_dupinfo, fi_fabric, fi_strerror, fi_version) — every
// other call in <rdma/fabric.h> is an inline through the objects' operation tables, so loom never
// links libfabric and builds and runs where it is absent (the factory then says unsupported).
//
// Ordering: when the provider grants write-after-write ordering with data ordering for any size
// (FI_ORDER_WAW and max_order_waw_size), the transport is ordered and the proxy posts a flag right
// behind its data (tcp;ofi_rxm does). Otherwise (shm, efa) it is unordered and the proxy posts the
// flag only after the data's completion. Every write asks for FI_DELIVERY_COMPLETE, so a
// completion always means the bytes are in the target's memory (kSignal fences rely on it).
//
// Providers drive target-side progress from CQ reads (FI_PROGRESS_MANUAL): the receiving rank's
// proxy must be polling for writes to it to land, which a running proxy always does.
#pragma once

#include <memory>
#include <string>

#include "loom/status.h"
#include "runtime/transports/transport.h"

namespace loom::runtime::net {

struct FabricOptions {
  std::string provider = "tcp";    // fi_info prov_name, e.g. "tcp", "shm", "efa", "verbs"
  std::string domain;              // e.g. "lo", "rdmap0s6-rdm"; empty: the first offered
  std::string library = "libfabric.so.1";
  uint32_t queue_depth = 256;      // operations in flight; the completion queue holds twice this
  bool use_ordering = true;        // false: ignore WAW ordering (tests drive the unordered path)
  bool device_memory = false;      // register CUDA memory (FI_HMEM); needs a provider with HMEM
};

// A transport for `config`'s peers; unsupported when libfabric cannot be loaded or `provider`
// offers no RMA over reliable datagram endpoints.
Result<std::unique_ptr<Transport>> create_fabric_transport(const TransportConfig& config, const FabricOptions& options);

// Options from the environment: LOOM_FABRIC_PROVIDER, or else the first of efa, verbs and tcp
// that offers RMA here; LOOM_NET_DEVICE as the domain. unsupported when none does.
Result<FabricOptions> fabric_options_from_settings(const NetworkSettings& settings);

// Whether create_fabric_transport() would find a provider: "tcp;ofi_rxm on lo (libfabric 1.17)"
// or unsupported with the reason. Opens no endpoint.
Result<std::string> probe_fabric(const FabricOptions& options);

}  // namespace loom::runtime::net
