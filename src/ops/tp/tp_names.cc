// Names of the tensor-parallel family's flag kinds (kernels/tp/flags.h), for error messages.
#include "kernels/tp/flags.h"
#include "runtime/names.h"

namespace loom::ops::tp {
namespace {

const NameRegistration kNames{{{kernels::tp::kPartialFlag, "partial tile"},
                               {kernels::tp::kFinalFlag, "final tile"},
                               {kernels::tp::kPieceFlag, "split-tile piece"}}};

}  // namespace
}  // namespace loom::ops::tp
