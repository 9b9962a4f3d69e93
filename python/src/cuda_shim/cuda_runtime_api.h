// Stand-in for the CUDA runtime header, used only to build the Python extension on a machine
// without CUDA toolkit headers (cmake/python.cmake picks it last). The extension needs nothing
// from the runtime but the stream handle type that loom's public headers name; this declaration
// is the runtime's own (an opaque pointer), so the ABI is the same.
#pragma once
typedef struct CUstream_st* cudaStream_t;
