// The smallest loom program: prints the library's version, then creates a one-rank communicator
// and prints what that gave. On a machine without a (Hopper) GPU creation fails with a Status,
// which is printed; that is a successful run too (exit 0). Exit 1: the library and headers differ.
#include <cstdio>
#include <cstring>

#include "loom/loom.h"

int main() {
  std::printf("loom %s (headers %s)\n", loom::version(), LOOM_VERSION_STRING);
  if (std::strcmp(loom::version(), LOOM_VERSION_STRING) != 0) {
    std::fprintf(stderr, "libloom %s does not match the headers %s\n", loom::version(), LOOM_VERSION_STRING);
    return 1;
  }

  loom::Result<loom::UniqueId> id = loom::make_unique_id("127.0.0.1");
  if (!id.ok()) {
    std::printf("make_unique_id: %s\n", id.status().to_string().c_str());
    return 0;
  }
  loom::Result<std::unique_ptr<loom::Communicator>> comm =
      loom::Communicator::from_unique_id(*id, /*rank=*/0, /*world_size=*/1);
  if (!comm.ok()) {
    // Creation can fail before it takes the id's listener (no GPU): close it.
    loom::discard_unique_id(*id);
    std::printf("communicator: %s\n", comm.status().to_string().c_str());
    return 0;
  }
  std::printf("communicator: rank %d of %d on device %d (%d SMs)\n", (*comm)->rank(), (*comm)->world_size(),
              (*comm)->device(), (*comm)->sm_count());
  return 0;
}
