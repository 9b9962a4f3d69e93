// Umbrella header: the whole public C++ API of loom.
#pragma once

#include "loom/collectives.h"
#include "loom/communicator.h"
#include "loom/diagnostics.h"
#include "loom/gemm.h"
#include "loom/moe.h"
#include "loom/status.h"
#include "loom/tensor_parallel.h"
#include "loom/types.h"
#include "loom/version.h"
