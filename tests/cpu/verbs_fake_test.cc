// verbs transport against a fake VerbsApi: the fake keeps a call log (the setup sequence and the
// attributes of every queue-pair transition), and executes RDMA writes in-process between two
// transports (rank 0 and rank 1 of one process): RC in order at post time, SRD out of order at
// poll time. Proves the RC and SRD setup sequences, bit-exact data through two proxies with the
// flag never before its data, error completions as a Status carrying the verbs status string,
// a full send queue as back-pressure, dma-buf registration with its fallbacks, device selection,
// and that a missing library (or no device) is `unsupported`.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "runtime/command_ring.h"
#include "runtime/proxy.h"
#include "runtime/transports/transport.h"
#include "runtime/transports/verbs.h"

namespace loom::runtime::net {
namespace {

using namespace std::chrono_literals;

// ---- the fake --------------------------------------------------------------------------------------

class FakeVerbs {
 public:
  struct DeviceSpec {
    std::string name;
    bool active = true;
    uint16_t vendor = 0x15b3;  // Mellanox
    uint8_t link_layer = IBV_LINK_LAYER_INFINIBAND;
    bool efa_rdma_write = true;
  };

  explicit FakeVerbs(std::vector<DeviceSpec> devices) : specs_(std::move(devices)) {
    instance_ = this;
    devices_.resize(specs_.size());
    api_.get_device_list = &get_device_list;
    api_.free_device_list = &free_device_list;
    api_.get_device_name = &get_device_name;
    api_.open_device = &open_device;
    api_.close_device = &close_device;
    api_.query_device = &query_device;
    api_.query_port = &query_port;
    api_.query_gid = &query_gid;
    api_.alloc_pd = &alloc_pd;
    api_.dealloc_pd = &dealloc_pd;
    api_.reg_mr = &reg_mr;
    api_.reg_dmabuf_mr = &reg_dmabuf_mr;
    api_.dereg_mr = &dereg_mr;
    api_.create_cq = &create_cq;
    api_.destroy_cq = &destroy_cq;
    api_.create_qp = &create_qp;
    api_.modify_qp = &modify_qp;
    api_.destroy_qp = &destroy_qp;
    api_.post_send = &post_send;
    api_.poll_cq = &poll_cq;
    api_.wc_status_str = &wc_status_str;
    api_.create_ah = &create_ah;
    api_.destroy_ah = &destroy_ah;
    api_.qp_to_qp_ex = &qp_to_qp_ex;
    api_.efadv_create_qp_ex = &efadv_create_qp_ex;
    api_.efadv_query_device = &efadv_query_device;
    api_.wr_start = &wr_start;
    api_.wr_rdma_write = &wr_rdma_write;
    api_.wr_set_sge = &wr_set_sge;
    api_.wr_set_ud_addr = &wr_set_ud_addr;
    api_.wr_complete = &wr_complete;
    api_.source = "fake";
  }
  ~FakeVerbs() { instance_ = nullptr; }

  VerbsApi& api() { return api_; }
  std::vector<std::string> calls() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return calls_;
  }
  size_t count(const std::string& prefix) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::count_if(calls_.begin(), calls_.end(), [&](const std::string& c) { return c.rfind(prefix, 0) == 0; });
  }
  // Fault injection.
  void fail_next_post_with(int err) { std::lock_guard<std::mutex> l(mutex_); fail_next_post_ = err; }
  void fail_dmabuf_registration(bool fail) { std::lock_guard<std::mutex> l(mutex_); dmabuf_fails_ = fail; }
  // SRD deliveries: random order, a random part per poll.
  void shuffle_srd(uint32_t seed) { std::lock_guard<std::mutex> l(mutex_); rng_.seed(seed); }
  std::vector<int> dmabuf_fds() const { std::lock_guard<std::mutex> l(mutex_); return dmabuf_fds_; }
  // Called (under the fake's lock) after every write lands: the test checks ordering at the
  // moment of delivery instead of racing a polling reader.
  void set_delivery_observer(std::function<void(uint64_t address, uint32_t length)> observer) {
    std::lock_guard<std::mutex> l(mutex_);
    observer_ = std::move(observer);
  }

  struct QpRecord {
    uint32_t qp_num;
    int state;
    uint32_t dest_qp_num;
    int path_mtu;
    uint16_t dlid;
    uint8_t timeout, retry_cnt, rnr_retry;
    uint32_t qkey;
    uint32_t max_send_wr;
    int access;
  };
  QpRecord qp_record(uint32_t qp_num) const {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& q : qps_) {
      if (q->qpx.qp_base.qp_num == qp_num) return q->record;
    }
    return {};
  }

 private:
  struct Context {
    ibv_context ctx{};
    int device = 0;
  };
  struct Mr {
    ibv_mr mr{};
    Context* owner = nullptr;
    int access = 0;
  };
  // Completion queues: the handed-out ibv_cq, entries kept beside it (cq_entries_).
  using Cq = ibv_cq;
  struct PendingWrite {  // an SRD write travelling
    uint64_t wr_id;
    Cq* cq;
    uint32_t lkey;
    uint64_t local_addr;
    uint32_t length;
    uint32_t rkey;
    uint64_t remote_addr;
    uint32_t dest_qpn;
    uint32_t qp_num;
  };
  struct Qp {
    ibv_qp_ex qpx{};  // qpx.qp_base is the ibv_qp handed out
    Context* owner = nullptr;
    Cq* cq = nullptr;
    bool srd = false;
    bool error = false;
    QpRecord record{};
    PendingWrite building{};  // the extended API builds one WR between wr_start and wr_complete
    uint32_t ah_dest_qpn = 0;
  };
  struct Ah {
    ibv_ah ah{};
    ibv_gid dgid{};
  };

  static FakeVerbs& self() { return *instance_; }
  void log(std::string entry) { calls_.push_back(std::move(entry)); }

  static ibv_device** get_device_list(int* n) {
    FakeVerbs& f = self();
    std::lock_guard<std::mutex> lock(f.mutex_);
    f.log("get_device_list");
    auto* list = new ibv_device*[f.devices_.size() + 1];
    for (size_t i = 0; i < f.devices_.size(); ++i) list[i] = &f.devices_[i];
    list[f.devices_.size()] = nullptr;
    *n = static_cast<int>(f.devices_.size());
    return list;
  }
  static void free_device_list(ibv_device** list) {
    std::lock_guard<std::mutex> lock(self().mutex_);
    self().log("free_device_list");
    delete[] list;
  }
  static const char* get_device_name(ibv_device* d) {
    FakeVerbs& f = self();
    return f.specs_[static_cast<size_t>(d - f.devices_.data())].name.c_str();
  }
  static ibv_context* open_device(ibv_device* d) {
    FakeVerbs& f = self();
    std::lock_guard<std::mutex> lock(f.mutex_);
    const int index = static_cast<int>(d - f.devices_.data());
    f.log("open_device " + f.specs_[index].name);
    auto c = std::make_unique<Context>();
    c->device = index;
    c->ctx.device = d;
    ibv_context* out = &c->ctx;
    f.contexts_.push_back(std::move(c));
    return out;
  }
  static Context* context_of(ibv_context* ctx) { return reinterpret_cast<Context*>(ctx); }  // ctx is the first member
  static int close_device(ibv_context* ctx) {
    std::lock_guard<std::mutex> lock(self().mutex_);
    self().log("close_device");
    return 0;
  }
  static int query_device(ibv_context* ctx, ibv_device_attr* attr) {
    FakeVerbs& f = self();
    std::lock_guard<std::mutex> lock(f.mutex_);
    f.log("query_device");
    *attr = ibv_device_attr{};
    attr->vendor_id = f.specs_[context_of(ctx)->device].vendor;
    attr->max_cqe = 4096;
    attr->max_qp_wr = 1024;
    return 0;
  }
  static int query_port(ibv_context* ctx, uint8_t port, ibv_port_attr* attr) {
    FakeVerbs& f = self();
    std::lock_guard<std::mutex> lock(f.mutex_);
    f.log("query_port " + std::to_string(port));
    const DeviceSpec& spec = f.specs_[context_of(ctx)->device];
    *attr = ibv_port_attr{};
    attr->state = spec.active ? IBV_PORT_ACTIVE : IBV_PORT_DOWN;
    attr->active_mtu = IBV_MTU_4096;
    attr->max_msg_sz = 1u << 30;
    attr->lid = static_cast<uint16_t>(10 + context_of(ctx)->device);
    attr->link_layer = spec.link_layer;
    return 0;
  }
  static int query_gid(ibv_context* ctx, uint8_t, int index, ibv_gid* gid) {
    std::lock_guard<std::mutex> lock(self().mutex_);
    self().log("query_gid " + std::to_string(index));
    std::memset(gid, 0, sizeof(*gid));
    gid->raw[15] = static_cast<uint8_t>(context_of(ctx)->device + 1);
    return 0;
  }
  static ibv_pd* alloc_pd(ibv_context* ctx) {
    FakeVerbs& f = self();
    std::lock_guard<std::mutex> lock(f.mutex_);
    f.log("alloc_pd");
    auto pd = std::make_unique<ibv_pd>();
    pd->context = ctx;
    ibv_pd* out = pd.get();
    f.pds_.push_back(std::move(pd));
    return out;
  }
  static int dealloc_pd(ibv_pd*) {
    std::lock_guard<std::mutex> lock(self().mutex_);
    self().log("dealloc_pd");
    return 0;
  }
  ibv_mr* add_mr(ibv_pd* pd, void* addr, size_t length, int access) {
    auto mr = std::make_unique<Mr>();
    mr->mr.context = pd->context;
    mr->mr.pd = pd;
    mr->mr.addr = addr;
    mr->mr.length = length;
    mr->mr.lkey = next_key_++;
    mr->mr.rkey = next_key_++;
    mr->owner = context_of(pd->context);
    mr->access = access;
    ibv_mr* out = &mr->mr;
    mrs_.push_back(std::move(mr));
    return out;
  }
  static ibv_mr* reg_mr(ibv_pd* pd, void* addr, size_t length, int access) {
    FakeVerbs& f = self();
    std::lock_guard<std::mutex> lock(f.mutex_);
    f.log("reg_mr " + std::to_string(length) + (access & IBV_ACCESS_RELAXED_ORDERING ? " relaxed" : ""));
    return f.add_mr(pd, addr, length, access);
  }
  static ibv_mr* reg_dmabuf_mr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access) {
    FakeVerbs& f = self();
    std::lock_guard<std::mutex> lock(f.mutex_);
    f.log("reg_dmabuf_mr offset=" + std::to_string(offset) + " length=" + std::to_string(length) +
          " iova_is_base=" + std::to_string(iova != 0) + " fd_valid=" + std::to_string(::fcntl(fd, F_GETFD) != -1));
    f.dmabuf_fds_.push_back(fd);
    if (f.dmabuf_fails_) {
      errno = EOPNOTSUPP;
      return nullptr;
    }
    return f.add_mr(pd, reinterpret_cast<void*>(iova), length, access);
  }
  static int dereg_mr(ibv_mr*) {
    std::lock_guard<std::mutex> lock(self().mutex_);
    self().log("dereg_mr");
    return 0;
  }
  static ibv_cq* create_cq(ibv_context* ctx, int cqe, void*, ibv_comp_channel*, int) {
    FakeVerbs& f = self();
    std::lock_guard<std::mutex> lock(f.mutex_);
    f.log("create_cq " + std::to_string(cqe));
    auto cq = std::make_unique<ibv_cq>();
    cq->context = ctx;
    cq->cqe = cqe;
    ibv_cq* out = cq.get();
    f.cqs_.push_back(std::move(cq));
    return out;
  }
  static int destroy_cq(ibv_cq*) {
    std::lock_guard<std::mutex> lock(self().mutex_);
    self().log("destroy_cq");
    return 0;
  }
  Qp* add_qp(ibv_pd* pd, ibv_cq* cq, uint32_t max_send_wr, bool srd) {
    auto qp = std::make_unique<Qp>();
    qp->owner = context_of(pd->context);
    qp->cq = cq;
    qp->srd = srd;
    qp->qpx.qp_base.context = pd->context;
    qp->qpx.qp_base.pd = pd;
    qp->qpx.qp_base.qp_num = next_qpn_++;
    qp->qpx.qp_base.state = IBV_QPS_RESET;
    qp->record.qp_num = qp->qpx.qp_base.qp_num;
    qp->record.max_send_wr = max_send_wr;
    Qp* out = qp.get();
    qps_.push_back(std::move(qp));
    return out;
  }
  static Qp* qp_of(ibv_qp* qp) { return reinterpret_cast<Qp*>(qp); }  // qpx.qp_base is the first member
  static ibv_qp* create_qp(ibv_pd* pd, ibv_qp_init_attr* attr) {
    FakeVerbs& f = self();
    std::lock_guard<std::mutex> lock(f.mutex_);
    f.log(std::string("create_qp ") + (attr->qp_type == IBV_QPT_RC ? "RC" : "?") + " send_wr=" +
          std::to_string(attr->cap.max_send_wr) + " inline=" + std::to_string(attr->cap.max_inline_data));
    return &f.add_qp(pd, attr->send_cq, attr->cap.max_send_wr, false)->qpx.qp_base;
  }
  static ibv_qp* efadv_create_qp_ex(ibv_context*, ibv_qp_init_attr_ex* attr, efadv_qp_init_attr* efa, uint32_t) {
    FakeVerbs& f = self();
    std::lock_guard<std::mutex> lock(f.mutex_);
    f.log(std::string("efadv_create_qp_ex ") + (efa->driver_qp_type == EFADV_QP_DRIVER_TYPE_SRD ? "SRD" : "?") +
          " rdma_write=" + std::to_string((attr->send_ops_flags & IBV_QP_EX_WITH_RDMA_WRITE) != 0));
    return &f.add_qp(attr->pd, attr->send_cq, attr->cap.max_send_wr, true)->qpx.qp_base;
  }
  static int efadv_query_device(ibv_context* ctx, efadv_device_attr* attr, uint32_t) {
    FakeVerbs& f = self();
    std::lock_guard<std::mutex> lock(f.mutex_);
    f.log("efadv_query_device");
    *attr = efadv_device_attr{};
    attr->device_caps = f.specs_[context_of(ctx)->device].efa_rdma_write ? (1u << 3) : 0;
    attr->max_rdma_size = 1u << 30;
    return 0;
  }
  static int modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int mask) {
    FakeVerbs& f = self();
    std::lock_guard<std::mutex> lock(f.mutex_);
    Qp* q = qp_of(qp);
    const char* names[] = {"RESET", "INIT", "RTR", "RTS", "SQD", "SQE", "ERR"};
    f.log(std::string("modify_qp ") + names[attr->qp_state] + " mask=" + std::to_string(mask));
    q->record.state = attr->qp_state;
    q->qpx.qp_base.state = attr->qp_state;
    if (mask & IBV_QP_ACCESS_FLAGS) q->record.access = attr->qp_access_flags;
    if (mask & IBV_QP_QKEY) q->record.qkey = attr->qkey;
    if (mask & IBV_QP_DEST_QPN) q->record.dest_qp_num = attr->dest_qp_num;
    if (mask & IBV_QP_PATH_MTU) q->record.path_mtu = attr->path_mtu;
    if (mask & IBV_QP_AV) q->record.dlid = attr->ah_attr.dlid;
    if (mask & IBV_QP_TIMEOUT) q->record.timeout = attr->timeout;
    if (mask & IBV_QP_RETRY_CNT) q->record.retry_cnt = attr->retry_cnt;
    if (mask & IBV_QP_RNR_RETRY) q->record.rnr_retry = attr->rnr_retry;
    return 0;
  }
  static int destroy_qp(ibv_qp*) {
    std::lock_guard<std::mutex> lock(self().mutex_);
    self().log("destroy_qp");
    return 0;
  }
  static ibv_ah* create_ah(ibv_pd* pd, ibv_ah_attr* attr) {
    FakeVerbs& f = self();
    std::lock_guard<std::mutex> lock(f.mutex_);
    f.log("create_ah global=" + std::to_string(attr->is_global));
    auto ah = std::make_unique<Ah>();
    ah->ah.context = pd->context;
    ah->ah.pd = pd;
    ah->dgid = attr->grh.dgid;
    ibv_ah* out = &ah->ah;
    f.ahs_.push_back(std::move(ah));
    return out;
  }
  static int destroy_ah(ibv_ah*) {
    std::lock_guard<std::mutex> lock(self().mutex_);
    self().log("destroy_ah");
    return 0;
  }
  static ibv_qp_ex* qp_to_qp_ex(ibv_qp* qp) { return &qp_of(qp)->qpx; }
  static const char* wc_status_str(ibv_wc_status status) {
    return status == IBV_WC_REM_ACCESS_ERR ? "remote access error"
           : status == IBV_WC_WR_FLUSH_ERR ? "Work Request Flushed Error"
                                           : "fake status";
  }

  // Finds the destination memory of a write: an MR of the target context with this rkey that
  // covers the range and allows remote writes.
  Mr* target_mr(Context* target, uint32_t rkey, uint64_t addr, uint64_t length) {
    for (auto& m : mrs_) {
      if (m->owner != target || m->mr.rkey != rkey) continue;
      const uint64_t base = reinterpret_cast<uint64_t>(m->mr.addr);
      if (addr < base || addr + length > base + m->mr.length || !(m->access & IBV_ACCESS_REMOTE_WRITE)) return nullptr;
      return m.get();
    }
    return nullptr;
  }
  Qp* qp_by_number(uint32_t qpn) {
    for (auto& q : qps_) {
      if (q->qpx.qp_base.qp_num == qpn) return q.get();
    }
    return nullptr;
  }
  // Performs one write; returns the completion status.
  ibv_wc_status execute(uint32_t dest_qpn, uint32_t rkey, uint64_t remote_addr, const void* source, uint32_t length) {
    Qp* dest = qp_by_number(dest_qpn);
    if (dest == nullptr) return IBV_WC_RETRY_EXC_ERR;
    if (target_mr(dest->owner, rkey, remote_addr, length) == nullptr) return IBV_WC_REM_ACCESS_ERR;
    auto* to = reinterpret_cast<uint8_t*>(remote_addr);
    if (length == sizeof(uint64_t) && remote_addr % 8 == 0) {
      // A flag-sized write: one release store, so a reader that acquires it sees the earlier data.
      uint64_t value;
      std::memcpy(&value, source, sizeof(value));
      std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(to)).store(value, std::memory_order_release);
    } else {
      std::memcpy(to, source, length);
      std::atomic_thread_fence(std::memory_order_release);
    }
    if (observer_) observer_(remote_addr, length);
    return IBV_WC_SUCCESS;
  }
  void complete(Cq* cq, uint64_t wr_id, ibv_wc_status status, uint32_t qp_num) {
    ibv_wc wc{};
    wc.wr_id = wr_id;
    wc.status = status;
    wc.opcode = IBV_WC_RDMA_WRITE;
    wc.qp_num = qp_num;
    wc.vendor_err = status == IBV_WC_SUCCESS ? 0 : 0x88;
    cq_entries_[cq].push_back(wc);
  }

  static int post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
    FakeVerbs& f = self();
    std::lock_guard<std::mutex> lock(f.mutex_);
    Qp* q = qp_of(qp);
    f.log("post_send " + std::to_string(wr->sg_list[0].length) + ((wr->send_flags & IBV_SEND_INLINE) ? " inline" : ""));
    if (f.fail_next_post_ != 0) {
      const int err = f.fail_next_post_;
      f.fail_next_post_ = 0;
      *bad = wr;
      return err;
    }
    if (q->record.state != IBV_QPS_RTS || wr->opcode != IBV_WR_RDMA_WRITE || wr->num_sge != 1 ||
        !(wr->send_flags & IBV_SEND_SIGNALED)) {
      *bad = wr;
      return EINVAL;
    }
    // RC: executed now, in order; after an error the queue pair only flushes.
    const ibv_sge& sge = wr->sg_list[0];
    ibv_wc_status status = IBV_WC_WR_FLUSH_ERR;
    if (!q->error) {
      status = f.execute(q->record.dest_qp_num, wr->wr.rdma.rkey, wr->wr.rdma.remote_addr,
                         reinterpret_cast<const void*>(sge.addr), sge.length);
      if (status != IBV_WC_SUCCESS) q->error = true;
    }
    f.complete(q->cq, wr->wr_id, status, qp->qp_num);
    return 0;
  }
  static int poll_cq(ibv_cq* cq, int n, ibv_wc* wc) {
    FakeVerbs& f = self();
    std::lock_guard<std::mutex> lock(f.mutex_);
    Cq* c = cq;
    std::deque<ibv_wc>& entries = f.cq_entries_[c];
    // SRD writes of this CQ's queue pairs travel now: a random part, in random order.
    std::vector<PendingWrite> keep;
    std::vector<PendingWrite> go;
    for (PendingWrite& p : f.srd_in_flight_) ((p.cq == c && f.rng_() % 3 != 0) ? go : keep).push_back(p);
    std::shuffle(go.begin(), go.end(), f.rng_);
    for (PendingWrite& p : go) {
      const ibv_wc_status status =
          f.execute(p.dest_qpn, p.rkey, p.remote_addr, reinterpret_cast<const void*>(p.local_addr), p.length);
      f.complete(p.cq, p.wr_id, status, p.qp_num);
    }
    f.srd_in_flight_ = std::move(keep);
    int got = 0;
    while (got < n && !entries.empty()) {
      wc[got++] = entries.front();
      entries.pop_front();
    }
    return got;
  }
  static void wr_start(ibv_qp_ex* qpx) {
    std::lock_guard<std::mutex> lock(self().mutex_);
    self().log("wr_start");
    reinterpret_cast<Qp*>(qpx)->building = PendingWrite{};
  }
  static void wr_rdma_write(ibv_qp_ex* qpx, uint32_t rkey, uint64_t addr) {
    std::lock_guard<std::mutex> lock(self().mutex_);
    self().log("wr_rdma_write");
    PendingWrite& p = reinterpret_cast<Qp*>(qpx)->building;
    p.rkey = rkey;
    p.remote_addr = addr;
    p.wr_id = qpx->wr_id;
  }
  static void wr_set_sge(ibv_qp_ex* qpx, uint32_t lkey, uint64_t addr, uint32_t length) {
    std::lock_guard<std::mutex> lock(self().mutex_);
    self().log("wr_set_sge " + std::to_string(length));
    PendingWrite& p = reinterpret_cast<Qp*>(qpx)->building;
    p.lkey = lkey;
    p.local_addr = addr;
    p.length = length;
  }
  static void wr_set_ud_addr(ibv_qp_ex* qpx, ibv_ah*, uint32_t remote_qpn, uint32_t qkey) {
    std::lock_guard<std::mutex> lock(self().mutex_);
    self().log("wr_set_ud_addr qkey_ok=" + std::to_string(qkey == reinterpret_cast<Qp*>(qpx)->record.qkey));
    reinterpret_cast<Qp*>(qpx)->building.dest_qpn = remote_qpn;
  }
  static int wr_complete(ibv_qp_ex* qpx) {
    FakeVerbs& f = self();
    std::lock_guard<std::mutex> lock(f.mutex_);
    f.log("wr_complete");
    Qp* q = reinterpret_cast<Qp*>(qpx);
    if (f.fail_next_post_ != 0) {
      const int err = f.fail_next_post_;
      f.fail_next_post_ = 0;
      return err;
    }
    if (q->record.state != IBV_QPS_RTS || !(qpx->wr_flags & IBV_SEND_SIGNALED)) return EINVAL;
    PendingWrite p = q->building;
    p.cq = q->cq;
    p.qp_num = q->qpx.qp_base.qp_num;
    p.wr_id = qpx->wr_id;
    f.srd_in_flight_.push_back(p);  // travels at a later poll, in any order
    return 0;
  }

  static inline FakeVerbs* instance_ = nullptr;
  std::vector<DeviceSpec> specs_;
  std::vector<ibv_device> devices_;
  VerbsApi api_;
  mutable std::mutex mutex_;
  std::vector<std::string> calls_;
  std::vector<std::unique_ptr<Context>> contexts_;
  std::vector<std::unique_ptr<ibv_pd>> pds_;
  std::vector<std::unique_ptr<Mr>> mrs_;
  std::vector<std::unique_ptr<ibv_cq>> cqs_;
  std::map<ibv_cq*, std::deque<ibv_wc>> cq_entries_;
  std::vector<std::unique_ptr<Qp>> qps_;
  std::vector<std::unique_ptr<Ah>> ahs_;
  std::vector<PendingWrite> srd_in_flight_;
  std::vector<int> dmabuf_fds_;
  std::function<void(uint64_t, uint32_t)> observer_;
  std::mt19937 rng_{1};
  uint32_t next_key_ = 100;
  uint32_t next_qpn_ = 7000;
  int fail_next_post_ = 0;
  bool dmabuf_fails_ = false;
};

// ---- two connected transports (ranks 0 and 1 of one process) ------------------------------------------

struct Side {
  std::unique_ptr<Transport> transport;
  std::vector<uint8_t> source;
  std::vector<uint8_t> window;
  std::vector<uint64_t> flags;
  LocalWindows mine;
  WindowTable table;
};

constexpr uint8_t kGuard = 0x5c;

Status make_pair(FakeVerbs& fake, Side sides[2], uint64_t bytes, size_t flag_count, VerbsOptions options = {}) {
  options.api = &fake.api();
  for (int r = 0; r < 2; ++r) {
    TransportConfig config{r, 2, {r != 0, r != 1}};
    LOOM_ASSIGN_OR_RETURN(sides[r].transport, create_verbs_transport(config, options));
    sides[r].source.resize(bytes);
    for (uint64_t i = 0; i < bytes; ++i) sides[r].source[i] = static_cast<uint8_t>((i * 131 + r * 7 + 1) ^ (i >> 9));
    sides[r].window.assign(bytes, kGuard);
    sides[r].flags.assign(flag_count, 0);
    Transport& t = *sides[r].transport;
    // As the network registers them: the source for this rank's own transport only.
    LOOM_ASSIGN_OR_RETURN(sides[r].mine.source,
                          t.register_memory({sides[r].source.data(), bytes, MemoryKind::kHost, -1, /*remote_write=*/false}));
    LOOM_ASSIGN_OR_RETURN(sides[r].mine.data, t.register_memory({sides[r].window.data(), bytes, MemoryKind::kHost, -1}));
    LOOM_ASSIGN_OR_RETURN(sides[r].mine.flags,
                          t.register_memory({sides[r].flags.data(), flag_count * sizeof(uint64_t), MemoryKind::kHost, -1}));
  }
  std::vector<std::vector<uint8_t>> endpoints(2);
  for (int r = 0; r < 2; ++r) {
    LOOM_ASSIGN_OR_RETURN(endpoints[r], sides[r].transport->local_endpoint());
  }
  for (int r = 0; r < 2; ++r) LOOM_TRY(sides[r].transport->connect(endpoints));
  for (int r = 0; r < 2; ++r) {
    const int peer = 1 - r;
    WindowTable& t = sides[r].table;
    t.rank = r;
    t.world_size = 2;
    t.source_handle = sides[r].mine.source.handle;
    t.source_bytes = bytes;
    t.destinations.resize(2);
    DestinationWindow& d = t.destinations[peer];
    LOOM_ASSIGN_OR_RETURN(d.data_handle, sides[r].transport->import_remote(peer, sides[peer].mine.data.remote_key, bytes));
    LOOM_ASSIGN_OR_RETURN(d.flag_handle, sides[r].transport->import_remote(peer, sides[peer].mine.flags.remote_key,
                                                                           flag_count * sizeof(uint64_t)));
    d.data_bytes = bytes;
    d.flag_count = flag_count;
    d.writable_flags = {WordRange{0, flag_count}};  // the peer's whole flag window (no scopes here)
    d.present = true;
  }
  return {};
}

// Rank 0 sends `count` writes of varying size to rank 1 through a proxy on each side (rank 1's
// proxy idles: RDMA needs nothing from the target's CPU); rank 1 checks each message the moment
// its flag is seen.
void run_through_proxies(FakeVerbs& fake, Side sides[2], int count, uint64_t max_length) {
  Result<ring::HostRing> rings[2] = {ring::HostRing::create(64), ring::HostRing::create(64)};
  ASSERT_TRUE(rings[0].ok() && rings[1].ok());
  std::unique_ptr<Proxy> proxies[2];
  for (int r = 0; r < 2; ++r) {
    ProxyOptions options;
    options.epochs = EpochRange{9, 1};
    Result<std::unique_ptr<Proxy>> p = Proxy::start({ProxyLane{rings[r]->view(), sides[r].transport.get(), sides[r].table}}, options);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    proxies[r] = std::move(p).value();
  }
  std::vector<uint64_t> offsets, lengths;
  uint64_t at = 0;
  std::mt19937 rng(11);
  for (int i = 0; i < count; ++i) {
    const uint64_t length = 1 + rng() % max_length;
    offsets.push_back(at);
    lengths.push_back(length);
    at += length + 16;  // gaps keep the guard pattern
  }
  ASSERT_LE(at, sides[1].window.size());
  // At the moment a flag lands, its message must already be complete in rank 1's window.
  std::atomic<int> flags_landed_before_data{0};
  const uint64_t flag_base = reinterpret_cast<uint64_t>(sides[1].flags.data());
  fake.set_delivery_observer([&](uint64_t address, uint32_t length) {
    if (address < flag_base || address >= flag_base + 8 * sides[1].flags.size() || length != 8) return;
    const size_t i = (address - flag_base) / 8;
    const uint64_t src = (static_cast<uint64_t>(i) * 37) % 512;
    if (std::memcmp(sides[1].window.data() + offsets[i], sides[0].source.data() + src, lengths[i]) != 0) {
      ++flags_landed_before_data;
    }
  });
  uint32_t host_abort = 0, device_abort = 0;
  ErrorRecord error{};
  ring::CpuProducer producer(rings[0]->view(), WaitParams{0, &host_abort, &device_abort, &error}, 10s);
  std::thread sender([&] {
    for (int i = 0; i < count; ++i) {
      ring::Command c{};
      c.header = ring::type_only_header(ring::CommandType::kWrite);
      c.dst_rank = 1;
      c.flag_index = static_cast<uint32_t>(i);
      c.epoch = 9;
      c.flag_value = 9;
      c.src_offset = (static_cast<uint64_t>(i) * 37) % 512;
      c.dst_offset = offsets[i];
      c.length = lengths[i];
      if (!producer.push(c)) return;
    }
  });
  // Receiver: each flag, once seen, must find its data complete.
  std::vector<bool> seen(count, false);
  int remaining = count, early_flags = 0;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (remaining > 0 && std::chrono::steady_clock::now() < deadline) {
    for (int i = 0; i < count; ++i) {
      if (seen[i] || std::atomic_ref<uint64_t>(sides[1].flags[i]).load(std::memory_order_acquire) != 9) continue;
      seen[i] = true;
      --remaining;
      const uint64_t src = (static_cast<uint64_t>(i) * 37) % 512;
      if (std::memcmp(sides[1].window.data() + offsets[i], sides[0].source.data() + src, lengths[i]) != 0) ++early_flags;
    }
  }
  sender.join();
  EXPECT_EQ(remaining, 0) << "messages never arrived";
  EXPECT_EQ(early_flags, 0) << "a flag was visible before its data";
  EXPECT_EQ(flags_landed_before_data.load(), 0) << "a flag landed before its data";
  fake.set_delivery_observer({});
  EXPECT_TRUE(proxies[0]->drain(10s).ok());
  for (auto& p : proxies) EXPECT_TRUE(p->stop().ok());
  // Guards between messages untouched.
  std::vector<bool> written(sides[1].window.size(), false);
  for (int i = 0; i < count; ++i) std::fill(written.begin() + offsets[i], written.begin() + offsets[i] + lengths[i], true);
  size_t bad_guards = 0;
  for (size_t i = 0; i < written.size(); ++i) bad_guards += (!written[i] && sides[1].window[i] != kGuard) ? 1 : 0;
  EXPECT_EQ(bad_guards, 0u);
  EXPECT_EQ(proxies[0]->stats().flags_posted, static_cast<uint64_t>(count));
}

bool log_contains_in_order(const std::vector<std::string>& calls, const std::vector<std::string>& expected) {
  size_t at = 0;
  for (const std::string& c : calls) {
    if (at < expected.size() && c.rfind(expected[at], 0) == 0) ++at;
  }
  return at == expected.size();
}

std::string joined(const std::vector<std::string>& calls) {
  std::string s;
  for (const std::string& c : calls) s += "  " + c + "\n";
  return s;
}

// ---- tests ---------------------------------------------------------------------------------------------

TEST(VerbsLoad, MissingLibraryIsUnsupported) {
  Result<const VerbsApi*> api = load_verbs_api("libibverbs-that-does-not-exist.so.1");
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(api.status().message().find("libibverbs-that-does-not-exist.so.1"), std::string::npos);
  VerbsOptions options;
  options.library = "libibverbs-that-does-not-exist.so.1";
  Result<std::unique_ptr<Transport>> t = create_verbs_transport(TransportConfig{0, 2, {false, true}}, options);
  EXPECT_EQ(t.status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(probe_verbs(options).status().code(), StatusCode::kUnsupported);
}

// Where rdma-core is installed (CI installs libibverbs-dev), the real table loads with every
// entry; on a machine without RDMA devices, the probe says so instead of failing.
TEST(VerbsLoad, RealLibraryLoadsAndReportsMissingDevices) {
  Result<const VerbsApi*> api = load_verbs_api();
  if (!api.ok()) GTEST_SKIP() << "libibverbs is not installed here: " << api.status().message();
  EXPECT_NE((*api)->post_send, nullptr);
  EXPECT_NE((*api)->poll_cq, nullptr);
  EXPECT_NE((*api)->query_port, nullptr);
  EXPECT_NE((*api)->reg_dmabuf_mr, nullptr) << "rdma-core >= 34 exports ibv_reg_dmabuf_mr";
  Result<std::string> probe = probe_verbs(VerbsOptions{});
  if (probe.ok()) {
    RecordProperty("device", *probe);
  } else {
    EXPECT_EQ(probe.status().code(), StatusCode::kUnsupported) << probe.status().to_string();
    RecordProperty("probe", probe.status().message());
  }
}

TEST(VerbsFake, RcSetupSequenceAndQueuePairAttributes) {
  FakeVerbs fake({{"mlx5_0"}});
  Side sides[2];
  Status made = make_pair(fake, sides, 4096, 8);
  ASSERT_TRUE(made.ok()) << made.to_string();
  const std::vector<std::string> calls = fake.calls();
  EXPECT_TRUE(log_contains_in_order(calls, {"get_device_list", "open_device mlx5_0", "query_device", "query_port 1",
                                            "free_device_list", "alloc_pd", "create_cq", "create_qp RC send_wr=256 inline=64",
                                            "modify_qp INIT", "reg_mr", "modify_qp RTR", "modify_qp RTS"}))
      << joined(calls);
  EXPECT_EQ(fake.count("create_qp RC"), 2u) << "one queue pair per peer, per rank";
  EXPECT_EQ(fake.count("query_gid"), 0u) << "InfiniBand addresses by LID";
  EXPECT_EQ(fake.count("reg_mr 4096 relaxed"), 0u) << "never relaxed ordering";
  // Each rank's queue pair points at the other's: dest_qp_num is the peer's qp_num.
  const FakeVerbs::QpRecord a = fake.qp_record(7000), b = fake.qp_record(7001);
  EXPECT_EQ(a.dest_qp_num, 7001u);
  EXPECT_EQ(b.dest_qp_num, 7000u);
  EXPECT_EQ(a.state, IBV_QPS_RTS);
  EXPECT_EQ(a.path_mtu, IBV_MTU_4096);
  EXPECT_EQ(a.dlid, 10u);
  EXPECT_EQ(a.timeout, 14);
  EXPECT_EQ(a.retry_cnt, 7);
  EXPECT_EQ(a.access & IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_WRITE);
  EXPECT_EQ(sides[0].transport->caps().ordered_writes, true);
  EXPECT_NE(sides[0].transport->describe().find("mlx5_0 port 1 (InfiniBand, RC)"), std::string::npos);

  for (Side& s : sides) EXPECT_TRUE(s.transport->close().ok());
  EXPECT_TRUE(log_contains_in_order(fake.calls(), {"destroy_qp", "destroy_cq", "dereg_mr", "dealloc_pd", "close_device"}))
      << joined(fake.calls());
}

TEST(VerbsFake, RoceUsesTheGidTable) {
  FakeVerbs fake({{"mlx5_1", true, 0x15b3, IBV_LINK_LAYER_ETHERNET}});
  Side sides[2];
  VerbsOptions options;
  options.gid_index = 3;
  ASSERT_TRUE(make_pair(fake, sides, 64, 1, options).ok());
  EXPECT_EQ(fake.count("query_gid 3"), 2u);
  EXPECT_NE(sides[0].transport->describe().find("RoCE"), std::string::npos);
}

TEST(VerbsFake, RcDataAndFlagsThroughTwoProxies) {
  FakeVerbs fake({{"mlx5_0"}});
  Side sides[2];
  ASSERT_TRUE(make_pair(fake, sides, 1 << 20, 200).ok());
  run_through_proxies(fake, sides, 200, 3000);
  EXPECT_GE(fake.count("post_send 8 inline"), 200u) << "RC flags are 8-byte inline writes";
}

TEST(VerbsFake, ErrorCompletionBecomesAStatusWithTheVerbsString) {
  FakeVerbs fake({{"mlx5_0"}});
  Side sides[2];
  ASSERT_TRUE(make_pair(fake, sides, 4096, 4).ok());
  Transport& t = *sides[0].transport;
  // A window of rank 1 with an rkey it never issued (reliability R5: a stale key).
  std::vector<uint8_t> forged = sides[1].mine.data.remote_key;
  forged[8] ^= 0x40;
  Result<uint32_t> stale = t.import_remote(1, forged, 4096);
  ASSERT_TRUE(stale.ok());
  const WriteOp bad{41, 1, sides[0].mine.source.handle, 0, *stale, 0, 128};
  ASSERT_EQ(*t.post_writes(std::span<const WriteOp>(&bad, 1)), 1u);
  const WriteOp later{42, 1, sides[0].mine.source.handle, 0, sides[0].table.destinations[1].data_handle, 0, 128};
  ASSERT_EQ(*t.post_writes(std::span<const WriteOp>(&later, 1)), 1u);
  std::vector<Completion> done;
  ASSERT_TRUE(t.poll(done).ok());
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0].id, 41u);
  EXPECT_EQ(done[0].status.code(), StatusCode::kPeerFailure);
  EXPECT_NE(done[0].status.message().find("remote access error"), std::string::npos) << done[0].status.to_string();
  EXPECT_NE(done[0].status.message().find("IBV_WC_REM_ACCESS_ERR"), std::string::npos);
  EXPECT_NE(done[0].status.message().find("rank 1"), std::string::npos);
  EXPECT_NE(done[0].status.message().find("vendor error 0x88"), std::string::npos);
  // The queue pair is in error now: the next write is flushed, also reported.
  EXPECT_EQ(done[1].id, 42u);
  EXPECT_NE(done[1].status.message().find("IBV_WC_WR_FLUSH_ERR"), std::string::npos) << done[1].status.to_string();
  EXPECT_EQ(t.outstanding(), 0u);
  EXPECT_TRUE(std::all_of(sides[1].window.begin(), sides[1].window.end(), [](uint8_t b) { return b == kGuard; }));
}

// Rank 0's proxy posts one 100-byte write to rank 1 (with flag 0 when `flag`), with rank 0's
// data handle for rank 1 replaced by an import of `key`; the proxy's health after draining.
Status write_through_key(Side sides[2], const std::vector<uint8_t>& key, bool flag) {
  LOOM_ASSIGN_OR_RETURN(sides[0].table.destinations[1].data_handle, sides[0].transport->import_remote(1, key, 4096));
  LOOM_ASSIGN_OR_RETURN(ring::HostRing host_ring, ring::HostRing::create(8));
  ProxyOptions options;
  options.epochs = EpochRange{1, 4};
  LOOM_ASSIGN_OR_RETURN(std::unique_ptr<Proxy> proxy,
                        Proxy::start({ProxyLane{host_ring.view(), sides[0].transport.get(), sides[0].table}}, options));
  uint32_t host_abort = 0, device_abort = 0;
  ErrorRecord error{};
  ring::CpuProducer producer(host_ring.view(), WaitParams{0, &host_abort, &device_abort, &error}, 5s);
  ring::Command c{};
  c.header = ring::type_only_header(ring::CommandType::kWrite);
  c.dst_rank = 1;
  c.flag_index = flag ? 0 : ring::kNoFlag;
  c.epoch = 1;
  c.flag_value = 1;
  c.length = 100;
  if (!producer.push(c)) return Status::internal("push failed");
  return proxy->drain(5s);
}

TEST(VerbsFake, ErrorCompletionReachesTheProxysHealth) {
  FakeVerbs fake({{"mlx5_0"}});
  Side sides[2];
  ASSERT_TRUE(make_pair(fake, sides, 4096, 4).ok());
  std::vector<uint8_t> forged = sides[1].mine.data.remote_key;
  forged[8] ^= 0x40;
  const Status health = write_through_key(sides, forged, /*flag=*/true);
  EXPECT_EQ(health.code(), StatusCode::kPeerFailure) << health.to_string();
  EXPECT_NE(health.message().find("remote access error"), std::string::npos) << health.to_string();
  EXPECT_EQ(sides[1].flags[0], 0u) << "the flag of a failed write must not land";
}

// The source registration (the whole heap in a communicator) is never offered to peers and is
// registered without remote write access: even a write that names its key (leaked, or guessed)
// is refused by the NIC, and the refusal reaches the proxy's health as a remote access error.
TEST(VerbsFake, SourceRegistrationRefusesRemoteWrites) {
  FakeVerbs fake({{"mlx5_0"}});
  Side sides[2];
  ASSERT_TRUE(make_pair(fake, sides, 4096, 4).ok());
  const std::vector<uint8_t> before = sides[1].source;
  const Status health = write_through_key(sides, sides[1].mine.source.remote_key, /*flag=*/false);
  EXPECT_EQ(health.code(), StatusCode::kPeerFailure) << health.to_string();
  EXPECT_NE(health.message().find("remote access error"), std::string::npos) << health.to_string();
  EXPECT_EQ(sides[1].source, before) << "the NIC wrote into a registration without remote write access";
}

TEST(VerbsFake, FullSendQueueIsBackPressureNotAnError) {
  FakeVerbs fake({{"mlx5_0"}});
  Side sides[2];
  ASSERT_TRUE(make_pair(fake, sides, 4096, 4).ok());
  Transport& t = *sides[0].transport;
  const WriteOp w{1, 1, sides[0].mine.source.handle, 0, sides[0].table.destinations[1].data_handle, 0, 64};
  fake.fail_next_post_with(ENOMEM);
  Result<size_t> taken = t.post_writes(std::span<const WriteOp>(&w, 1));
  ASSERT_TRUE(taken.ok()) << taken.status().to_string();
  EXPECT_EQ(*taken, 0u);
  EXPECT_EQ(*t.post_writes(std::span<const WriteOp>(&w, 1)), 1u);
  // Any other post failure is a Status naming the call.
  fake.fail_next_post_with(EINVAL);
  Result<size_t> failed = t.post_writes(std::span<const WriteOp>(&w, 1));
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("ibv_post_send"), std::string::npos);
  // Out-of-registration writes never reach the device.
  const size_t posts = fake.count("post_send");
  const WriteOp outside{2, 1, sides[0].mine.source.handle, 4000, sides[0].table.destinations[1].data_handle, 0, 200};
  EXPECT_EQ(t.post_writes(std::span<const WriteOp>(&outside, 1)).status().code(), StatusCode::kInternal);
  EXPECT_EQ(fake.count("post_send"), posts);
}

TEST(VerbsFake, GpuMemoryUsesDmabufThenFallsBackToPeerMemory) {
  FakeVerbs fake({{"mlx5_0"}});
  std::vector<uint8_t> pretend_gpu(1 << 16);
  int exports = 0;
  VerbsOptions options;
  options.api = &fake.api();
  options.export_dmabuf = [&](void* base, uint64_t bytes) -> Result<int> {
    ++exports;
    if (base != pretend_gpu.data() || bytes != pretend_gpu.size()) return Status::internal("wrong range");
    const int fd = ::memfd_create("fake-dmabuf", MFD_CLOEXEC);
    if (fd < 0) return Status::errno_error("memfd_create", errno);
    return fd;
  };
  Result<std::unique_ptr<Transport>> t = create_verbs_transport(TransportConfig{0, 2, {false, true}}, options);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  const MemoryRegion gpu{pretend_gpu.data(), pretend_gpu.size(), MemoryKind::kDevice, 0};

  ASSERT_TRUE((*t)->register_memory(gpu).ok());
  EXPECT_EQ(fake.count("reg_dmabuf_mr offset=0 length=65536 iova_is_base=1 fd_valid=1"), 1u) << joined(fake.calls());
  ASSERT_EQ(fake.dmabuf_fds().size(), 1u);
  EXPECT_EQ(::fcntl(fake.dmabuf_fds()[0], F_GETFD), -1) << "the dma-buf fd is closed after registration";

  fake.fail_dmabuf_registration(true);
  const size_t plain_before = fake.count("reg_mr 65536");
  ASSERT_TRUE((*t)->register_memory(gpu).ok());
  EXPECT_EQ(fake.count("reg_mr 65536"), plain_before + 1) << "dma-buf failed: ibv_reg_mr (peer memory)";

  options.export_dmabuf = [](void*, uint64_t) -> Result<int> { return Status::unsupported("no dma-buf here"); };
  Result<std::unique_ptr<Transport>> t2 = create_verbs_transport(TransportConfig{0, 2, {false, true}}, options);
  ASSERT_TRUE(t2.ok());
  ASSERT_TRUE((*t2)->register_memory(gpu).ok());
  EXPECT_EQ(fake.count("reg_mr 65536"), plain_before + 2);

  fake.api().reg_dmabuf_mr = nullptr;  // rdma-core older than v34
  Result<std::unique_ptr<Transport>> t3 = create_verbs_transport(TransportConfig{0, 2, {false, true}}, options);
  ASSERT_TRUE(t3.ok());
  const int exports_before = exports;
  ASSERT_TRUE((*t3)->register_memory(gpu).ok());
  EXPECT_EQ(exports, exports_before) << "no export without ibv_reg_dmabuf_mr";
}

TEST(VerbsFake, DeviceSelection) {
  {
    FakeVerbs fake({{"mlx5_0", /*active=*/false}, {"mlx5_1"}});
    VerbsOptions options;
    options.api = &fake.api();
    Result<std::string> probe = probe_verbs(options);
    ASSERT_TRUE(probe.ok()) << probe.status().to_string();
    EXPECT_EQ(*probe, "mlx5_1 port 1 (InfiniBand, RC)") << "the first device with an active port";
    options.device = "mlx5_0";
    Result<std::string> down = probe_verbs(options);
    EXPECT_EQ(down.status().code(), StatusCode::kUnsupported);
    EXPECT_NE(down.status().message().find("not active"), std::string::npos) << down.status().to_string();
    options.device = "mlx5_9";
    Result<std::string> absent = probe_verbs(options);
    EXPECT_EQ(absent.status().code(), StatusCode::kUnsupported);
    EXPECT_NE(absent.status().message().find("mlx5_0, mlx5_1"), std::string::npos) << absent.status().to_string();
  }
  {
    FakeVerbs none({});
    VerbsOptions options;
    options.api = &none.api();
    Result<std::string> probe = probe_verbs(options);
    EXPECT_EQ(probe.status().code(), StatusCode::kUnsupported);
    EXPECT_NE(probe.status().message().find("no RDMA devices"), std::string::npos);
  }
  {
    FakeVerbs efa_old({{"efa_0", true, 0x1d0f, IBV_LINK_LAYER_UNSPECIFIED, /*efa_rdma_write=*/false}});
    VerbsOptions options;
    options.api = &efa_old.api();
    Result<std::string> probe = probe_verbs(options);
    EXPECT_EQ(probe.status().code(), StatusCode::kUnsupported);
    EXPECT_NE(probe.status().message().find("without RDMA write"), std::string::npos) << probe.status().to_string();
  }
}

TEST(VerbsFake, SrdOnEfaPostsFlagsOnlyAfterOutOfOrderCompletions) {
  FakeVerbs fake({{"efa_0", true, 0x1d0f, IBV_LINK_LAYER_UNSPECIFIED, true}});
  fake.shuffle_srd(5);
  Side sides[2];
  Status made = make_pair(fake, sides, 1 << 20, 300);
  ASSERT_TRUE(made.ok()) << made.to_string();
  EXPECT_FALSE(sides[0].transport->caps().ordered_writes) << "SRD delivers out of order";
  EXPECT_NE(sides[0].transport->describe().find("(EFA, SRD)"), std::string::npos);
  const std::vector<std::string> calls = fake.calls();
  EXPECT_TRUE(log_contains_in_order(calls, {"open_device efa_0", "query_device", "query_port 1", "efadv_query_device",
                                            "query_gid 0", "alloc_pd", "create_cq", "efadv_create_qp_ex SRD rdma_write=1",
                                            "modify_qp INIT", "modify_qp RTR", "modify_qp RTS", "create_ah global=1"}))
      << joined(calls);
  EXPECT_EQ(fake.count("create_qp"), 0u);
  EXPECT_EQ(fake.count("create_ah"), 2u) << "one address handle per peer, per rank";
  EXPECT_EQ(fake.qp_record(7000).qkey, fake.qp_record(7001).qkey);
  run_through_proxies(fake, sides, 300, 3000);
  EXPECT_EQ(fake.count("post_send"), 0u) << "SRD posts through the extended work-request API";
  EXPECT_TRUE(log_contains_in_order(fake.calls(), {"wr_start", "wr_rdma_write", "wr_set_sge", "wr_set_ud_addr qkey_ok=1",
                                                   "wr_complete"}))
      << "one work request: start, opcode, buffer, destination, complete";
  EXPECT_GE(fake.count("wr_set_ud_addr qkey_ok=1"), 600u);
  EXPECT_GE(fake.count("wr_set_sge 8"), 300u) << "flags are staged 8-byte writes (no inline on EFA)";
}

}  // namespace
}  // namespace loom::runtime::net
