#include "loom/version.h"

namespace loom {

const char* version() { return LOOM_VERSION_STRING; }

}  // namespace loom
