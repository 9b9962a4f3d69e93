// loom's version: the one source of it (CMakeLists.txt and pyproject.toml read it from here).
#pragma once

#define LOOM_VERSION_MAJOR 0
#define LOOM_VERSION_MINOR 2
#define LOOM_VERSION_PATCH 0
#define LOOM_VERSION_STRING "0.2.0"

namespace loom {

// The version of the loom library the program runs with (LOOM_VERSION_STRING is the one it was
// compiled against).
const char* version();

}  // namespace loom
