#include "runtime/proxy.h"

#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>

#include "core/log.h"
#include "runtime/bootstrap.h"

namespace loom::runtime::net {
namespace {

// Proxies still running when the process exits (an application that never closed its
// communicator) are stopped before the CUDA runtime unloads: the runtime registered its exit
// handler at the process's first CUDA call, before any proxy started, and exit handlers run last
// registered first. A lane thread still polling CUDA while the runtime unloads gets "driver
// shutting down" errors or crashes the process. The set is never destroyed, so it outlives every
// static destructor.
std::mutex& live_proxies_mutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}
std::set<Proxy*>& live_proxies() {
  static std::set<Proxy*>* live = new std::set<Proxy*>;
  return *live;
}
void stop_live_proxies_at_exit() {
  std::lock_guard<std::mutex> lock(live_proxies_mutex());
  for (Proxy* proxy : live_proxies()) (void)proxy->stop(std::chrono::milliseconds(200));
}
void track_live_proxy(Proxy* proxy) {
  static std::once_flag registered;
  std::call_once(registered, [] { std::atexit(stop_live_proxies_at_exit); });
  std::lock_guard<std::mutex> lock(live_proxies_mutex());
  live_proxies().insert(proxy);
}

using SteadyClock = std::chrono::steady_clock;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now().time_since_epoch()).count();
}

// ---- window blobs: [u64 data offset][u64 data bytes][u64 flag offset][u64 flag bytes]
//                    [u32 n][n key bytes][u32 m][m key bytes] ----

void put_u64(std::vector<uint8_t>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

class Reader {
 public:
  explicit Reader(std::span<const uint8_t> bytes) : bytes_(bytes) {}
  bool u64(uint64_t* v) {
    if (bytes_.size() - at_ < 8) return false;
    *v = 0;
    for (int i = 0; i < 8; ++i) *v |= static_cast<uint64_t>(bytes_[at_ + i]) << (8 * i);
    at_ += 8;
    return true;
  }
  bool u32(uint32_t* v) {
    if (bytes_.size() - at_ < 4) return false;
    *v = 0;
    for (int i = 0; i < 4; ++i) *v |= static_cast<uint32_t>(bytes_[at_ + i]) << (8 * i);
    at_ += 4;
    return true;
  }
  bool take(uint32_t n, std::span<const uint8_t>* out) {
    if (bytes_.size() - at_ < n) return false;
    *out = bytes_.subspan(at_, n);
    at_ += n;
    return true;
  }
  bool done() const { return at_ == bytes_.size(); }

 private:
  std::span<const uint8_t> bytes_;
  size_t at_ = 0;
};

std::vector<uint8_t> encode_windows(const LocalWindows& mine) {
  std::vector<uint8_t> out;
  put_u64(out, mine.data_offset);
  put_u64(out, mine.data.bytes);
  put_u64(out, mine.flag_offset);
  put_u64(out, mine.flags.bytes);
  put_u32(out, static_cast<uint32_t>(mine.data.remote_key.size()));
  out.insert(out.end(), mine.data.remote_key.begin(), mine.data.remote_key.end());
  put_u32(out, static_cast<uint32_t>(mine.flags.remote_key.size()));
  out.insert(out.end(), mine.flags.remote_key.begin(), mine.flags.remote_key.end());
  return out;
}

// Checked: true and the sum when a + b does not wrap.
bool checked_add(uint64_t a, uint64_t b, uint64_t* sum) { return !__builtin_add_overflow(a, b, sum); }

// Whether [offset, offset + bytes) lies inside [begin, begin + size) (no arithmetic wraps).
bool inside(uint64_t offset, uint64_t bytes, uint64_t begin, uint64_t size) {
  uint64_t end = 0;
  return offset >= begin && checked_add(offset, bytes, &end) && end - begin <= size;
}

// Whether a peer's windows make sense: neither wraps, and the flag window (when it lies in the
// heap) does not overlap the data window, so no byte is reachable through both keys.
bool windows_consistent(uint64_t data_offset, uint64_t data_bytes, uint64_t flag_offset, uint64_t flag_bytes) {
  uint64_t data_end = 0, flag_end = 0;
  if (!checked_add(data_offset, data_bytes, &data_end)) return false;
  if (flag_offset == LocalWindows::kNoOffset) return true;
  if (!checked_add(flag_offset, flag_bytes, &flag_end)) return false;
  return flag_end <= data_offset || flag_offset >= data_end;
}

}  // namespace

// ---- windows -----------------------------------------------------------------------------------

Result<WindowTable> exchange_windows(Bootstrap& bootstrap, Transport& transport, const TransportConfig& config,
                                     const LocalWindows& mine, const FlagScope& scope) {
  if (mine.flags.bytes % sizeof(uint64_t) != 0 ||
      !windows_consistent(mine.data_offset, mine.data.bytes, mine.flag_offset, mine.flags.bytes)) {
    Status bad = Status::invalid_argument("windows: data [" + std::to_string(mine.data_offset) + ", +" +
                                          std::to_string(mine.data.bytes) + "), flags of " +
                                          std::to_string(mine.flags.bytes) + " bytes at " + std::to_string(mine.flag_offset) +
                                          ": the flags must be whole uint64 words outside the data window");
    bootstrap.report_failure(bad.to_string());
    return bad;
  }
  const std::vector<uint8_t> blob = encode_windows(mine);
  LOOM_ASSIGN_OR_RETURN(std::vector<std::vector<uint8_t>> all, all_gather_blobs(bootstrap, blob));
  WindowTable table;
  table.rank = config.rank;
  table.world_size = config.world_size;
  table.source_handle = mine.source.handle;
  table.source_bytes = mine.source.bytes;
  table.destinations.assign(static_cast<size_t>(config.world_size), DestinationWindow{});
  // Local from here on: a failure is told to the others, who go on to their next collective step.
  auto fail = [&](Status status) {
    bootstrap.report_failure(status.to_string());
    return status;
  };
  for (int r = 0; r < config.world_size; ++r) {
    if (r == config.rank || !config.peers[r]) continue;
    Reader in(all[r]);
    uint64_t data_offset = 0, data_bytes = 0, flag_offset = 0, flag_bytes = 0;
    uint32_t data_len = 0, flag_len = 0;
    std::span<const uint8_t> data_key, flag_key;
    if (!in.u64(&data_offset) || !in.u64(&data_bytes) || !in.u64(&flag_offset) || !in.u64(&flag_bytes) ||
        !in.u32(&data_len) || !in.take(data_len, &data_key) || !in.u32(&flag_len) || !in.take(flag_len, &flag_key) ||
        !in.done() || flag_bytes % sizeof(uint64_t) != 0 ||
        !windows_consistent(data_offset, data_bytes, flag_offset, flag_bytes)) {
      return fail(Status::internal("window blob of rank " + std::to_string(r) + " is malformed (" +
                                   std::to_string(all[r].size()) + " bytes)"));
    }
    DestinationWindow& d = table.destinations[r];
    Result<uint32_t> data_handle = transport.import_remote(r, data_key, data_bytes);
    if (!data_handle.ok()) return fail(data_handle.status());
    Result<uint32_t> flag_handle = transport.import_remote(r, flag_key, flag_bytes);
    if (!flag_handle.ok()) return fail(flag_handle.status());
    d.data_handle = *data_handle;
    d.flag_handle = *flag_handle;
    d.data_offset = data_offset;
    d.data_bytes = data_bytes;
    d.flag_offset = flag_offset;
    d.flag_count = flag_bytes / sizeof(uint64_t);
    d.writable_flags = scope ? scope(r, d.flag_count) : std::vector<WordRange>{WordRange{0, d.flag_count}};
    d.present = true;
  }
  return table;
}

// ---- validation --------------------------------------------------------------------------------

const char* rejection_name(Rejection reason) {
  switch (reason) {
    case Rejection::kNone: return "none";
    case Rejection::kUnknownType: return "unknown type";
    case Rejection::kReservedNonZero: return "reserved word not zero";
    case Rejection::kRankOutOfRange: return "rank out of range";
    case Rejection::kNotAPeer: return "not a peer";
    case Rejection::kEpochOutOfRange: return "epoch out of range";
    case Rejection::kFlagValueOutOfRange: return "flag value out of range";
    case Rejection::kEmptyWrite: return "empty write";
    case Rejection::kSourceOutOfRange: return "source out of range";
    case Rejection::kDestinationOutOfRange: return "destination out of range";
    case Rejection::kFlagOutOfRange: return "flag out of range";
    case Rejection::kProtectedDestination: return "protected destination";
    case Rejection::kFlagNotWritable: return "flag of another sender";
    case Rejection::kCount: break;
  }
  return "unknown";
}

Rejection validate_command(const ring::Command& c, const WindowTable& table, const EpochRange& epochs,
                           WriteTarget* target) {
  const uint8_t type = ring::header_type(c.header);
  if (type != static_cast<uint8_t>(ring::CommandType::kWrite) && type != static_cast<uint8_t>(ring::CommandType::kSignal)) {
    return Rejection::kUnknownType;
  }
  if (c.reserved != 0) return Rejection::kReservedNonZero;
  if (c.dst_rank >= static_cast<uint32_t>(table.world_size)) return Rejection::kRankOutOfRange;
  const DestinationWindow& d = table.destinations[c.dst_rank];
  if (static_cast<int>(c.dst_rank) == table.rank || !d.present) return Rejection::kNotAPeer;
  if (!epochs.contains(c.epoch)) return Rejection::kEpochOutOfRange;
  const bool is_write = type == static_cast<uint8_t>(ring::CommandType::kWrite);
  const bool has_flag = c.flag_index != ring::kNoFlag;
  if (has_flag && !epochs.contains(c.flag_value)) return Rejection::kFlagValueOutOfRange;
  if (is_write) {
    if (c.length == 0) return Rejection::kEmptyWrite;
    uint64_t end = 0;
    if (!checked_add(c.src_offset, c.length, &end) || end > table.source_bytes) return Rejection::kSourceOutOfRange;
    if (!checked_add(c.dst_offset, c.length, &end)) return Rejection::kDestinationOutOfRange;
    WriteTarget where;
    if (inside(c.dst_offset, c.length, d.data_offset, d.data_bytes)) {
      where = {d.data_handle, c.dst_offset - d.data_offset};
    } else if (d.flag_offset != LocalWindows::kNoOffset &&
               inside(c.dst_offset, c.length, d.flag_offset, d.flag_count * sizeof(uint64_t))) {
      // Whole words of the flag window, each one this rank's to write.
      const uint64_t at = c.dst_offset - d.flag_offset;
      if (at % sizeof(uint64_t) != 0 || c.length % sizeof(uint64_t) != 0) return Rejection::kProtectedDestination;
      for (uint64_t word = at / sizeof(uint64_t); word < (at + c.length) / sizeof(uint64_t); ++word) {
        if (!d.may_write_flag(word)) return Rejection::kProtectedDestination;
      }
      where = {d.flag_handle, at};
    } else if (c.dst_offset < d.data_offset) {
      return Rejection::kProtectedDestination;  // the control region, or flag words of others
    } else {
      return Rejection::kDestinationOutOfRange;
    }
    if (target != nullptr) *target = where;
  }
  if (!has_flag) return is_write ? Rejection::kNone : Rejection::kFlagOutOfRange;
  if (c.flag_index >= d.flag_count) return Rejection::kFlagOutOfRange;
  if (!d.may_write_flag(c.flag_index)) return Rejection::kFlagNotWritable;
  return Rejection::kNone;
}

// ---- NUMA --------------------------------------------------------------------------------------

Result<std::vector<int>> parse_cpu_list(std::string_view text) {
  std::vector<int> cpus;
  auto bad = [&] { return Status::invalid_argument("cpu list '" + std::string(text) + "' is malformed"); };
  std::string_view t = text;
  while (!t.empty() && std::isspace(static_cast<unsigned char>(t.back()))) t.remove_suffix(1);
  if (t.empty()) return cpus;
  size_t at = 0;
  auto number = [&](int* out) {
    if (at >= t.size() || !std::isdigit(static_cast<unsigned char>(t[at]))) return false;
    long v = 0;
    while (at < t.size() && std::isdigit(static_cast<unsigned char>(t[at]))) {
      v = v * 10 + (t[at] - '0');
      if (v > 1 << 20) return false;
      ++at;
    }
    *out = static_cast<int>(v);
    return true;
  };
  while (true) {
    int first = 0;
    if (!number(&first)) return bad();
    int last = first;
    if (at < t.size() && t[at] == '-') {
      ++at;
      if (!number(&last) || last < first) return bad();
    }
    for (int c = first; c <= last; ++c) cpus.push_back(c);
    if (at == t.size()) break;
    if (t[at] != ',') return bad();
    ++at;
  }
  return cpus;
}

Result<std::vector<int>> numa_cpus_of_pci_device(const std::string& sysfs_root, const std::string& bus_id) {
  // sysfs names devices "dddd:bb:dd.f" in lower case; CUDA may print "00000000:18:00.0".
  std::string id;
  for (char ch : bus_id) id.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(ch))));
  const size_t colon = id.find(':');
  if (colon == std::string::npos) return Status::invalid_argument("PCI bus id '" + bus_id + "' has no domain");
  if (colon > 4) id.erase(0, colon - 4);
  const std::string node_path = sysfs_root + "/bus/pci/devices/" + id + "/numa_node";
  std::ifstream node_file(node_path);
  int node = -1;
  if (!(node_file >> node)) return Status::system_error("cannot read " + node_path);
  if (node < 0) return std::vector<int>{};
  const std::string cpus_path = sysfs_root + "/devices/system/node/node" + std::to_string(node) + "/cpulist";
  std::ifstream cpus_file(cpus_path);
  std::string list;
  if (!std::getline(cpus_file, list)) return Status::system_error("cannot read " + cpus_path);
  return parse_cpu_list(list);
}

// ---- lanes -------------------------------------------------------------------------------------

struct Proxy::Lane {
  int index = 0;
  ProxyLane config;
  ring::RingConsumer consumer;
  int wake_fd = -1;
  std::thread thread;
  std::atomic<int64_t> heartbeat_ns{0};
  std::atomic<uint64_t> turns{0};  // loop turns taken (drain waits for fresh ones)
  std::atomic<bool> exited{false};
  std::atomic<bool> idle{true};  // nothing published, queued or outstanding at the last turn
  std::atomic<uint64_t> outstanding{0};
  std::atomic<uint64_t> commands{0}, writes{0}, bytes{0}, flags{0}, completions{0}, completion_errors{0}, rejected{0};
  std::array<std::atomic<uint64_t>, kRejectionReasons> by_reason{};

  ~Lane() {
    if (wake_fd >= 0) ::close(wake_fd);
  }
  void wake() const {
    const uint64_t one = 1;
    (void)!::write(wake_fd, &one, sizeof(one));
  }
  // Sleeps until woken or `timeout` passes; drains the eventfd.
  void sleep(std::chrono::nanoseconds timeout) const {
    pollfd fd{wake_fd, POLLIN, 0};
    timespec ts{static_cast<time_t>(timeout.count() / 1'000'000'000), static_cast<long>(timeout.count() % 1'000'000'000)};
    if (::ppoll(&fd, 1, &ts, nullptr) > 0) {
      uint64_t value = 0;
      (void)!::read(wake_fd, &value, sizeof(value));
    }
  }
};

// The loop one lane thread runs. Only that thread touches this state.
struct LaneRunner {
  Proxy& proxy;
  Proxy::Lane& lane;
  Transport& transport;
  const TransportCaps caps;

  // A kWrite in flight: how many of its data pieces have not completed yet.
  struct Record {
    uint32_t pieces_left = 0;
  };
  // What waits to be posted, in order.
  struct Pending {
    bool is_flag = false;
    WriteOp write;
    FlagOp flag;
    uint64_t record = 0;   // flags of kWrite: the record whose pieces gate it (unordered transports)
    bool gated = false;    // kWrite flag on an unordered transport
    bool fence = false;    // kSignal: waits for every earlier data piece of the lane
    uint64_t fence_id = 0; // ... i.e. every data op id below this
  };

  static constexpr uint64_t kFlagIdBit = uint64_t{1} << 63;

  std::vector<ring::Command> batch;
  std::deque<Pending> queue;
  std::vector<Pending> waiting;  // gated flags set aside until their gate opens
  std::unordered_map<uint64_t, uint64_t> piece_record;  // data op id -> record id
  std::unordered_map<uint64_t, Record> records;
  std::set<uint64_t> incomplete_data;  // data op ids enqueued and not completed
  std::vector<Completion> completions;
  std::vector<WriteOp> write_batch;
  uint64_t next_data_id = 1;
  uint64_t next_flag_id = 1;
  uint64_t next_record = 1;
  uint64_t command_number = 0;  // commands taken by this lane (messages)
  bool poisoned = false;        // a data write failed: post no more flags

  // Completion in ring order (RingControl::completed): for every command taken from `done_base`
  // on, the operations (data pieces, flag) still outstanding; a rejected command has none. Each
  // transport operation maps back to its command.
  std::deque<uint32_t> remaining;
  uint64_t done_base = 0;
  std::unordered_map<uint64_t, uint64_t> op_command;
  uint64_t* completed_word = nullptr;

  LaneRunner(Proxy& p, Proxy::Lane& l)
      : proxy(p), lane(l), transport(*l.config.transport), caps(l.config.transport->caps()) {
    batch.resize(std::max<uint32_t>(1, p.options_.batch));
    done_base = lane.consumer.position();
    completed_word = ring::ring_completed(lane.config.ring);
    std::atomic_ref<uint64_t>(*completed_word).store(done_base, std::memory_order_release);
  }

  // One operation of a command completed (or will never be posted): the command may be complete
  // now, and with it a run of commands in ring order.
  void complete_op(uint64_t id) {
    auto it = op_command.find(id);
    if (it == op_command.end()) return;
    const uint64_t command = it->second;
    op_command.erase(it);
    if (command >= done_base && command - done_base < remaining.size() && remaining[command - done_base] > 0) {
      --remaining[command - done_base];
    }
    advance_completed();
  }
  void advance_completed() {
    const uint64_t before = done_base;
    while (!remaining.empty() && remaining.front() == 0) {
      remaining.pop_front();
      ++done_base;
    }
    // Release: the transport reported these operations complete (data in the destination)
    // before a producer that acquires the word reuses their source.
    if (done_base != before) std::atomic_ref<uint64_t>(*completed_word).store(done_base, std::memory_order_release);
  }

  void fail(Status status) {
    proxy.record_error(std::move(status).with_context("proxy lane " + std::to_string(lane.index) + " (" +
                                                      transport_kind_name(transport.kind()) + ")"));
  }

  void reject(const ring::Command& c, Rejection reason) {
    lane.rejected.fetch_add(1, std::memory_order_relaxed);
    lane.by_reason[static_cast<size_t>(reason)].fetch_add(1, std::memory_order_relaxed);
    std::ostringstream what;
    what << "lane " << lane.index << " command #" << command_number << " (producer " << c.producer << ", type "
         << int(ring::header_type(c.header)) << ", rank " << c.dst_rank << ", epoch " << c.epoch << ", src "
         << c.src_offset << ", dst " << c.dst_offset << ", length " << c.length << ", flag " << c.flag_index
         << "): " << rejection_name(reason);
    std::lock_guard<std::mutex> lock(proxy.error_mutex_);
    if (proxy.first_rejection_.empty()) {
      proxy.first_rejection_ = what.str();
      LOOM_ERROR("proxy rejected a command: %s", proxy.first_rejection_.c_str());
    }
  }

  // Turns one valid command (number `command` in ring order) into queued operations.
  void enqueue(const ring::Command& c, uint64_t command, const WriteTarget& target) {
    const DestinationWindow& d = lane.config.windows.destinations[c.dst_rank];
    const int rank = static_cast<int>(c.dst_rank);
    const bool has_flag = c.flag_index != ring::kNoFlag;
    FlagOp flag;
    if (has_flag) {
      flag.id = kFlagIdBit | next_flag_id++;
      flag.rank = rank;
      flag.remote = d.flag_handle;
      flag.remote_offset = uint64_t{c.flag_index} * sizeof(uint64_t);
      flag.value = c.flag_value;
    }
    if (ring::header_type(c.header) == static_cast<uint8_t>(ring::CommandType::kSignal)) {
      Pending p;
      p.is_flag = true;
      p.flag = flag;
      p.fence = true;
      p.fence_id = next_data_id;
      queue.push_back(p);
      op_command[flag.id] = command;
      remaining.push_back(1);
      return;
    }
    uint32_t operations = has_flag ? 1 : 0;
    const uint64_t record_id = next_record++;
    Record& record = records[record_id];
    const uint64_t piece = std::max<uint64_t>(1, caps.max_write_bytes);
    for (uint64_t done = 0; done < c.length; done += piece) {
      Pending p;
      p.write.id = next_data_id++;
      p.write.rank = rank;
      p.write.local = lane.config.windows.source_handle;
      p.write.local_offset = c.src_offset + done;
      p.write.remote = target.handle;
      p.write.remote_offset = target.offset + done;
      p.write.bytes = std::min(piece, c.length - done);
      piece_record[p.write.id] = record_id;
      incomplete_data.insert(p.write.id);
      ++record.pieces_left;
      op_command[p.write.id] = command;
      ++operations;
      queue.push_back(p);
    }
    if (has_flag) {
      Pending p;
      p.is_flag = true;
      p.flag = flag;
      p.record = record_id;
      p.gated = !caps.ordered_writes;
      op_command[flag.id] = command;
      queue.push_back(p);
    }
    remaining.push_back(operations);
  }

  bool gate_open(const Pending& p) const {
    if (p.fence) return incomplete_data.empty() || *incomplete_data.begin() >= p.fence_id;
    if (p.gated) {
      auto it = records.find(p.record);
      return it == records.end() || it->second.pieces_left == 0;
    }
    return true;
  }

  // Posts one flag; false when the transport is full.
  bool post_flag(const FlagOp& flag) {
    if (poisoned) {  // dropped: its data (or an earlier write) failed; it will never complete
      complete_op(flag.id);
      return true;
    }
    Result<bool> posted = transport.post_flag(flag);
    if (!posted.ok()) {
      fail(posted.status());
      complete_op(flag.id);
      return true;
    }
    if (*posted) lane.flags.fetch_add(1, std::memory_order_relaxed);
    return *posted;
  }

  // Posts queued operations in order until the transport is full. Returns whether any was posted.
  bool post_queue() {
    bool progress = false;
    // Gated flags whose data has landed first: they are the oldest.
    for (size_t i = 0; i < waiting.size();) {
      if (!gate_open(waiting[i])) {
        ++i;
        continue;
      }
      if (!post_flag(waiting[i].flag)) return progress;
      progress = true;
      waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(i));
    }
    while (!queue.empty()) {
      Pending& front = queue.front();
      if (front.is_flag) {
        if (!gate_open(front)) {
          waiting.push_back(front);
          queue.pop_front();
          continue;
        }
        if (!post_flag(front.flag)) return progress;
        queue.pop_front();
        progress = true;
        continue;
      }
      write_batch.clear();
      for (size_t i = 0; i < queue.size() && !queue[i].is_flag; ++i) write_batch.push_back(queue[i].write);
      Result<size_t> taken = transport.post_writes(write_batch);
      if (!taken.ok()) {
        // Nothing of this batch will complete: fail its pieces so their flags are never posted.
        fail(taken.status());
        poisoned = true;
        for (const WriteOp& w : write_batch) finish_data(w.id, false);
        queue.erase(queue.begin(), queue.begin() + static_cast<std::ptrdiff_t>(write_batch.size()));
        return true;
      }
      for (size_t i = 0; i < *taken; ++i) {
        lane.writes.fetch_add(1, std::memory_order_relaxed);
        lane.bytes.fetch_add(write_batch[i].bytes, std::memory_order_relaxed);
      }
      queue.erase(queue.begin(), queue.begin() + static_cast<std::ptrdiff_t>(*taken));
      progress = progress || *taken > 0;
      if (*taken < write_batch.size()) return progress;
    }
    return progress;
  }

  void finish_data(uint64_t id, bool ok) {
    complete_op(id);
    incomplete_data.erase(id);
    auto it = piece_record.find(id);
    if (it == piece_record.end()) return;
    const uint64_t record_id = it->second;
    piece_record.erase(it);
    auto rec = records.find(record_id);
    if (rec == records.end()) return;
    if (!ok) poisoned = true;
    if (--rec->second.pieces_left == 0) records.erase(rec);
  }

  bool poll_completions() {
    completions.clear();
    Status polled = transport.poll(completions);
    if (!polled.ok()) {
      fail(std::move(polled));
      poisoned = true;
    }
    for (Completion& c : completions) {
      lane.completions.fetch_add(1, std::memory_order_relaxed);
      const bool is_flag = (c.id & kFlagIdBit) != 0;
      if (!c.status.ok()) {
        lane.completion_errors.fetch_add(1, std::memory_order_relaxed);
        fail(std::move(c.status));
        if (!is_flag) poisoned = true;
      }
      if (is_flag) {
        complete_op(c.id);
      } else {
        finish_data(c.id, c.status.ok());
      }
    }
    return !completions.empty();
  }

  bool take_commands() {
    if (queue.size() >= batch.size()) return false;  // back-pressure: the ring fills up
    const uint64_t first = lane.consumer.position();  // ring number of batch[0]
    const size_t n = lane.consumer.poll(std::span<ring::Command>(batch.data(), batch.size() - queue.size()));
    if (n == 0) return false;
    const EpochRange epochs{proxy.epoch_floor_.load(std::memory_order_acquire), proxy.options_.epochs.window};
    for (size_t i = 0; i < n; ++i) {
      ++command_number;
      WriteTarget target;
      const Rejection verdict = validate_command(batch[i], lane.config.windows, epochs, &target);
      if (verdict != Rejection::kNone) {
        reject(batch[i], verdict);
        remaining.push_back(0);  // nothing to wait for
      } else {
        enqueue(batch[i], first + i, target);
      }
    }
    advance_completed();
    // The commands are copied out: their slots may be reused at once.
    lane.consumer.retire();
    lane.commands.fetch_add(n, std::memory_order_relaxed);
    return true;
  }

  uint64_t in_flight() const { return transport.outstanding() + queue.size() + waiting.size(); }

  void run() {
    uint32_t idle_turns = 0;
    while (!proxy.stopping_.load(std::memory_order_acquire)) {
      if (proxy.paused_.load(std::memory_order_acquire)) {
        lane.sleep(std::chrono::milliseconds(10));
        continue;
      }
      lane.heartbeat_ns.store(now_ns(), std::memory_order_release);
      lane.turns.fetch_add(1, std::memory_order_release);
      bool progress = poll_completions();
      progress = post_queue() || progress;
      const bool took = take_commands();
      if (took) progress = post_queue() || true;
      const uint64_t pending = in_flight();
      lane.outstanding.store(pending, std::memory_order_release);
      lane.idle.store(!took && pending == 0, std::memory_order_release);
      if (progress) {
        idle_turns = 0;
        continue;
      }
      // Nothing moved. With work in flight keep polling (manual-progress providers need it);
      // otherwise back off to short sleeps the stop eventfd cuts short.
      if (++idle_turns < 256 || pending > 0) {
        std::this_thread::yield();
      } else {
        lane.sleep(proxy.options_.idle_sleep);
      }
    }
    drain_for_stop();
    lane.exited.store(true, std::memory_order_release);
  }

  // After stop: wait (bounded) for posted operations to complete so their buffers are no longer
  // in use; queued ones are dropped.
  void drain_for_stop() {
    const auto deadline = SteadyClock::now() + proxy.stop_drain_;
    while (transport.outstanding() > 0 && SteadyClock::now() < deadline) {
      if (!poll_completions()) std::this_thread::yield();
    }
    if (transport.outstanding() > 0) {
      LOOM_WARN("proxy lane %d stopped with %u operations still outstanding", lane.index, transport.outstanding());
    }
    lane.outstanding.store(transport.outstanding(), std::memory_order_release);
  }
};

// ---- proxy -------------------------------------------------------------------------------------

Result<std::unique_ptr<Proxy>> Proxy::start(std::vector<ProxyLane> lanes, const ProxyOptions& options) {
  if (lanes.empty()) return Status::invalid_argument("proxy: no lanes");
  std::unique_ptr<Proxy> proxy(new Proxy());
  proxy->options_ = options;
  proxy->epoch_floor_.store(options.epochs.floor);
  for (size_t i = 0; i < lanes.size(); ++i) {
    ProxyLane& config = lanes[i];
    if (config.transport == nullptr || config.ring.slots == nullptr || config.ring.tail == nullptr) {
      return Status::invalid_argument("proxy lane " + std::to_string(i) + ": no transport or ring");
    }
    LOOM_TRY(ring::check_ring_capacity(config.ring.capacity));
    if (config.windows.destinations.size() != static_cast<size_t>(config.windows.world_size)) {
      return Status::invalid_argument("proxy lane " + std::to_string(i) + ": window table does not cover the world");
    }
    auto lane = std::make_unique<Lane>();
    lane->index = static_cast<int>(i);
    lane->config = std::move(config);
    lane->consumer = ring::RingConsumer(lane->config.ring);
    lane->wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (lane->wake_fd < 0) return Status::errno_error("proxy: eventfd", errno);
    lane->heartbeat_ns.store(now_ns());
    proxy->lanes_.push_back(std::move(lane));
  }

  std::vector<int> cpus;
  if (!options.gpu_pci_bus_id.empty()) {
    Result<std::vector<int>> found = numa_cpus_of_pci_device(options.sysfs_root, options.gpu_pci_bus_id);
    if (!found.ok()) {
      LOOM_WARN("proxy threads not pinned: %s", found.status().to_string().c_str());
    } else if (found->empty()) {
      LOOM_INFO("proxy threads not pinned: GPU %s reports no NUMA node", options.gpu_pci_bus_id.c_str());
    } else {
      cpus = std::move(found).value();
    }
  }

  Proxy* self = proxy.get();
  for (auto& lane_ptr : proxy->lanes_) {
    Lane* lane = lane_ptr.get();
    lane->thread = std::thread([self, lane, cpus] {
      if (!cpus.empty()) {
        cpu_set_t set;
        CPU_ZERO(&set);
        for (int c : cpus) {
          if (c < CPU_SETSIZE) CPU_SET(c, &set);
        }
        const int err = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
        if (err != 0) {
          LOOM_WARN("proxy lane %d not pinned to the GPU's NUMA node: %s", lane->index, std::strerror(err));
        } else {
          self->pinned_.store(true);
        }
      }
      LaneRunner runner(*self, *lane);
      runner.run();
    });
  }
  track_live_proxy(self);
  return proxy;
}

Proxy::~Proxy() {
  {
    std::lock_guard<std::mutex> lock(live_proxies_mutex());
    live_proxies().erase(this);
  }
  (void)stop(std::chrono::milliseconds(200));
}

void Proxy::set_epoch_floor(uint64_t floor) { epoch_floor_.store(floor, std::memory_order_release); }

void Proxy::record_error(const Status& status) {
  std::lock_guard<std::mutex> lock(error_mutex_);
  if (first_error_.ok()) {
    first_error_ = status;
    LOOM_ERROR("%s", status.to_string().c_str());
  }
}

Status Proxy::health() const {
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (!first_error_.ok()) return first_error_;
  }
  const ProxyStats s = stats();
  if (s.rejected > 0) {
    std::string counts;
    for (size_t r = 1; r < kRejectionReasons; ++r) {
      if (s.rejected_by_reason[r] == 0) continue;
      if (!counts.empty()) counts += ", ";
      counts += std::string(rejection_name(static_cast<Rejection>(r))) + ": " + std::to_string(s.rejected_by_reason[r]);
    }
    std::lock_guard<std::mutex> lock(error_mutex_);
    return Status::internal("proxy rejected " + std::to_string(s.rejected) + " invalid commands (" + counts +
                            "); first: " + first_rejection_);
  }
  const int64_t now = now_ns();
  const int64_t limit = std::chrono::duration_cast<std::chrono::nanoseconds>(options_.stall_limit).count();
  for (const auto& lane : lanes_) {
    if (lane->exited.load()) continue;
    const int64_t silent = now - lane->heartbeat_ns.load(std::memory_order_acquire);
    if (silent > limit) {
      return Status::timeout("proxy lane " + std::to_string(lane->index) + " not progressing for " +
                             std::to_string(silent / 1'000'000) + " ms (" + std::to_string(lane->outstanding.load()) +
                             " operations pending)");
    }
  }
  return {};
}

ProxyStats Proxy::stats() const {
  ProxyStats s;
  for (const auto& lane : lanes_) {
    s.commands += lane->commands.load(std::memory_order_relaxed);
    s.writes_posted += lane->writes.load(std::memory_order_relaxed);
    s.bytes_posted += lane->bytes.load(std::memory_order_relaxed);
    s.flags_posted += lane->flags.load(std::memory_order_relaxed);
    s.completions += lane->completions.load(std::memory_order_relaxed);
    s.completion_errors += lane->completion_errors.load(std::memory_order_relaxed);
    s.rejected += lane->rejected.load(std::memory_order_relaxed);
    for (size_t r = 0; r < kRejectionReasons; ++r) s.rejected_by_reason[r] += lane->by_reason[r].load(std::memory_order_relaxed);
  }
  return s;
}

uint64_t Proxy::outstanding() const {
  uint64_t total = 0;
  for (const auto& lane : lanes_) total += lane->outstanding.load(std::memory_order_acquire);
  return total;
}

Status Proxy::drain(std::chrono::milliseconds limit) {
  const auto deadline = SteadyClock::now() + limit;
  // Idle must hold over three fresh turns of every lane: a command published after a lane's last
  // look at the ring is then either taken (not idle) or was not published before drain() began.
  std::vector<uint64_t> seen_turns(lanes_.size(), 0);
  std::vector<int> idle_turns(lanes_.size(), 0);
  while (true) {
    bool done = true;
    for (size_t i = 0; i < lanes_.size(); ++i) {
      const Lane& lane = *lanes_[i];
      const uint64_t turns = lane.turns.load(std::memory_order_acquire);
      if (!lane.idle.load(std::memory_order_acquire)) {
        idle_turns[i] = 0;
      } else if (turns != seen_turns[i]) {
        ++idle_turns[i];
      }
      seen_turns[i] = turns;
      if (idle_turns[i] < 3) done = false;
    }
    if (done) return health();
    if (SteadyClock::now() > deadline) {
      return Status::timeout("proxy drain: " + std::to_string(outstanding()) + " operations still pending after " +
                             std::to_string(limit.count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

Status Proxy::stop(std::chrono::milliseconds drain) {
  std::lock_guard<std::mutex> lock(stop_mutex_);
  if (!stopped_) {
    stop_drain_ = drain;
    stopping_.store(true, std::memory_order_release);
    for (auto& lane : lanes_) lane->wake();
    for (auto& lane : lanes_) {
      if (lane->thread.joinable()) lane->thread.join();
    }
    stopped_ = true;
  }
  std::lock_guard<std::mutex> error_lock(error_mutex_);
  return first_error_;
}

void Proxy::pause_for_test(bool paused) {
  paused_.store(paused, std::memory_order_release);
  if (!paused) {
    for (auto& lane : lanes_) lane->heartbeat_ns.store(now_ns(), std::memory_order_release);
  }
  for (auto& lane : lanes_) lane->wake();
}

}  // namespace loom::runtime::net
