// The umbrella header <loom/loom.h> exposes the whole public API: the operators' signatures are
// checked at compile time (no CUDA is linked into the CPU tests, so nothing is called), the plain
// types at run time.
#include <gtest/gtest.h>

#include <string>
#include <type_traits>

#include "loom/loom.h"

namespace loom {
namespace {

static_assert(std::is_same_v<decltype(&all_reduce), Status (*)(Communicator&, const void*, void*, size_t, DType,
                                                                cudaStream_t, const CollectiveOptions&)>,
              "loom.h must declare loom::all_reduce (loom/collectives.h)");
static_assert(std::is_same_v<decltype(&gemm), Status (*)(const GemmArgs&, cudaStream_t, const GemmOptions&)>,
              "loom.h must declare loom::gemm (loom/gemm.h)");
static_assert(std::is_same_v<decltype(&grouped_gemm),
                             Status (*)(const GroupedGemmArgs&, cudaStream_t, const GroupedGemmOptions&)>,
              "loom.h must declare loom::grouped_gemm (loom/moe.h)");
static_assert(std::is_same_v<decltype(&ag_gemm), Status (*)(Communicator&, const TpGemmArgs&, cudaStream_t,
                                                             const TpGemmOptions&)>,
              "loom.h must declare loom::ag_gemm (loom/tensor_parallel.h)");
static_assert(std::is_same_v<decltype(&gemm_rs), decltype(&ag_gemm)> && std::is_same_v<decltype(&gemm_ar), decltype(&ag_gemm)>,
              "loom.h must declare loom::gemm_rs and loom::gemm_ar like loom::ag_gemm");

TEST(PublicApi, VersionOfTheHeaderAndTheLibraryAgree) {
  EXPECT_STREQ(version(), LOOM_VERSION_STRING);
  EXPECT_EQ(std::to_string(LOOM_VERSION_MAJOR) + "." + std::to_string(LOOM_VERSION_MINOR) + "." +
                std::to_string(LOOM_VERSION_PATCH),
            LOOM_VERSION_STRING);
}

TEST(PublicApi, UmbrellaHeaderCarriesOptionsAndDiagnostics) {
  const TpGemmOptions tp;
  EXPECT_EQ(tp.algorithm, TpAlgorithm::kAuto);
  EXPECT_EQ(tp.timeline, nullptr);
  const GemmOptions g;
  EXPECT_EQ(g.timeline, nullptr);
  EXPECT_EQ(sizeof(TileTimelineRecord), 64u);
  EXPECT_EQ(tile_timeline_capacity(1, 1), 1);
  EXPECT_EQ(tile_timeline_capacity(1000, 1536), 16 * 24);
}

}  // namespace
}  // namespace loom
