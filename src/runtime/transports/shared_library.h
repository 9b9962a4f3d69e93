// The transports' RDMA libraries, loaded with dlopen at run time so that libloom needs none of
// them to load.
#pragma once

#include <dlfcn.h>

#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "loom/status.h"

namespace loom::runtime::net {

// dlopen(library) with every symbol bound now; unsupported "transport: cannot load library
// (why); remedy" when it fails.
inline Result<void*> open_library(const std::string& library, const char* transport, const char* remedy) {
  void* handle = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = ::dlerror();
    return Status::unsupported(std::string(transport) + ": cannot load " + library + " (" + (why ? why : "unknown error") +
                               "); " + remedy);
  }
  return handle;
}

// The API table `load` builds for `key`, built once per key and kept, failure included, for the
// life of the process: libraries are never closed, as providers start threads and register
// atexit handlers, so unloading one while the process runs is not safe.
template <class Api>
Result<const Api*> load_api_once(const std::string& key, const std::function<Result<const Api*>()>& load) {
  static std::mutex mutex;
  static std::map<std::string, Result<const Api*>> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = loaded.find(key); it != loaded.end()) return it->second;
  Result<const Api*> result = load();
  loaded.emplace(key, result);
  return result;
}

}  // namespace loom::runtime::net
