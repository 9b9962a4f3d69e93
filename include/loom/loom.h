// Umbrella header: the whole public C++ API of loom.
#pragma once

#include "loom/collectives.h"
#include "loom/communicator.h"
#include "loom/status.h"
#include "loom/types.h"
