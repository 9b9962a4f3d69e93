#include "runtime/cuda_check.h"

#include <cstring>

namespace loom {

Status cuda_status(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return {};
  const char* slash = std::strrchr(file, '/');
  std::string m(expr);
  m += ": ";
  m += cudaGetErrorString(err);
  m += " (";
  m += cudaGetErrorName(err);
  m += ") at ";
  m += slash ? slash + 1 : file;
  m += ":";
  m += std::to_string(line);
  return Status::cuda_error(std::move(m));
}

}  // namespace loom
