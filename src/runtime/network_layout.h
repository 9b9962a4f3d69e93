// The network flag window: where arrival flags of inter-node transfers land (plain data and
// LOOM_HOST_DEVICE functions: the communicator, the multi-node launchers, the kernels and the CPU
// tests all compute the same indices from here).
//
// One window per rank, `kNetFlagWords` uint64 words in the symmetric heap's reserved prefix, right
// after the control region (net_window_offset; equal on every rank, zero-filled with the prefix
// before any peer can write), on jobs of more than one node. Everything after the prefix is the
// data window peers' network writes may land in; the prefix (control region and this window) is
// outside it, so a data key never reaches a flag (docs/SECURITY.md "RDMA keys"). The transports register it as the flag window;
// the proxy writes flags into it on behalf of senders of other nodes, and local peers write
// into it over NVLink (the multi-node kernels keep all their flags here, apart from the
// single-node operators' op_flags). Every word is an epoch (or an entry_word): never
// reset, a stale value never satisfies a later wait.
//
// Layout (N nodes, L GPUs per node):
//   word [0, L)             nvl_entry[l']   entry_word(e, signature) (device_abi.h), stored by
//                                           local peer l' at launch start
//   word [L, L + N)         net_entry[s]    e, the flag of the entry write from node s's same-index GPU
//   word [L + N, L + 2N)    net_sig[s]      entry_word(e, signature), the data of that same write
//   word [L + 2N]           sig_out         this rank's own entry_word(e, signature): the source of its
//                                           entry writes (the proxy copies it out of this heap)
//   word [launch_base, kNetFlagWords)       per-launch flags of the multi-node operators, laid out
//                                           by each operator from its shape (kernels/tp/multinode/layout.h)
// launch_base = L + 2N + 1 rounded up to 8 words (a 64-byte line).
#pragma once

#include <cstdint>

#include "runtime/device_abi.h"

namespace loom::runtime::net {

// Words in every rank's network flag window (1 MiB): entry words plus the per-launch flags of the
// largest operator call it admits; calls needing more are refused with a message naming the need.
inline constexpr uint32_t kNetFlagWords = 1u << 17;

struct NetWindowLayout {
  uint32_t nodes = 1;  // N
  uint32_t local = 1;  // L

  LOOM_HOST_DEVICE uint32_t nvl_entry(uint32_t local_rank) const { return local_rank; }
  LOOM_HOST_DEVICE uint32_t net_entry(uint32_t node) const { return local + node; }
  LOOM_HOST_DEVICE uint32_t net_sig(uint32_t node) const { return local + nodes + node; }
  LOOM_HOST_DEVICE uint32_t sig_out() const { return local + 2 * nodes; }
  LOOM_HOST_DEVICE uint32_t launch_base() const { return (local + 2 * nodes + 1 + 7) & ~7u; }
  // The words of a destination's window that the same-index GPU of node `sender` writes through
  // the network (the proxy lets it write no other): its entry word net_entry[sender] with the
  // signature word net_sig[sender] as data, and the per-launch flags from launch_base() on (each
  // operator's layout decides which of those a sender sets). Never nvl_entry (local peers store
  // those over NVLink), another node's entry words, nor sig_out.
  LOOM_HOST_DEVICE uint32_t sender_entry(uint32_t sender) const { return net_entry(sender); }
  LOOM_HOST_DEVICE uint32_t sender_sig(uint32_t sender) const { return net_sig(sender); }
  // Per-launch flags available to one operator call.
  LOOM_HOST_DEVICE uint32_t launch_capacity() const {
    return launch_base() < kNetFlagWords ? kNetFlagWords - launch_base() : 0;
  }
};


// Bytes of the window: the words, rounded up to 64 KiB (registration granularity of some NICs;
// the rest stays unused).
LOOM_HOST_DEVICE constexpr uint64_t net_window_bytes() {
  return ((uint64_t{8} * kNetFlagWords) + 65535) & ~uint64_t{65535};
}

// Heap offset of the window: the control region's end (`control_bytes`) rounded up to 64 KiB. The
// heap's reserved prefix then ends at net_window_offset(c) + net_window_bytes().
LOOM_HOST_DEVICE constexpr uint64_t net_window_offset(uint64_t control_bytes) {
  return (control_bytes + 65535) & ~uint64_t{65535};
}

}  // namespace loom::runtime::net
