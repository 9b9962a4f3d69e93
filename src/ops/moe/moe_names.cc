// Names of the MoE family's operators and flag kinds (kernels/moe/flags.h), for error messages.
#include "kernels/moe/flags.h"
#include "runtime/names.h"

namespace loom::ops::moe {
namespace {

namespace km = kernels::moe;

const NameRegistration kNames{{{km::kChunkFlag, "moe routing chunk"},
                               {km::kCountsFlag, "moe expert counts"},
                               {km::kLayoutFlag, "moe routing layout"},
                               {km::kArrivalFlag, "moe row arrival"},
                               {km::kReadDoneFlag, "moe combine read"},
                               {km::kDoneFlag, "moe combine done"},
                               {km::kReadyFlag, "moe receive block ready"},
                               {km::kSentFlag, "moe network windows sent"},
                               {km::kStagedFlag, "moe staged tokens of this plan"},
                               {km::kHiddenDoneFlag, "moe_layer fc1 tile row done"},
                               {km::kOutReadyFlag, "moe_layer expert output row ready"},
                               {km::kPushesDoneFlag, "moe_layer push CTAs done"}},
                              {{km::kRoutingOp, "moe_routing"},
                               {km::kDispatchOp, "moe_dispatch"},
                               {km::kCombineOp, "moe_combine"},
                               {km::kDispatchGemmOp, "moe_dispatch_gemm"},
                               {km::kLayerOp, "moe_layer"}}};

}  // namespace
}  // namespace loom::ops::moe
