// Operator and flag-kind names: loom's shared ones built in, a family's registered by the family.
#include <gtest/gtest.h>

#include <string>

#include "runtime/names.h"

namespace loom {
namespace {

constexpr uint32_t kTestFamily = 7;  // not used by any loom family
const NameRegistration kTestNames{{{family_flag(kTestFamily, 3), "test kind"}}, {{family_op(kTestFamily, 1), "test_op"}}};

TEST(Names, SharedNamesAreBuiltIn) {
  EXPECT_STREQ(op_name(OpId::kAgGemm), "ag_gemm");
  EXPECT_STREQ(flag_kind_name(FlagKind::kNetChunk), "network chunk");
  EXPECT_TRUE(flag_kind_names_global_rank(FlagKind::kNetEntry));
  EXPECT_FALSE(flag_kind_names_global_rank(FlagKind::kTile));
}

TEST(Names, AFamilyRegistersItsOwnWithoutEditingTheSharedList) {
  EXPECT_STREQ(flag_kind_name(family_flag(kTestFamily, 3)), "test kind");
  EXPECT_STREQ(op_name(family_op(kTestFamily, 1)), "test_op");
  EXPECT_STREQ(flag_kind_name(family_flag(kTestFamily, 4)), "unknown");
  EXPECT_STREQ(op_name(family_op(kTestFamily, 2)), "unknown");
  // A clash keeps the first name.
  register_flag_kind_names({{family_flag(kTestFamily, 3), "other"}});
  EXPECT_STREQ(flag_kind_name(family_flag(kTestFamily, 3)), "test kind");
}

TEST(Names, FamilyFlagCodesFitTheProgressWord) {
  // CtaProgress::failure keeps a flag kind in 7 bits.
  for (uint32_t family = 0; family < 8; ++family) {
    for (uint32_t n = 0; n < 16; ++n) EXPECT_LT(static_cast<uint32_t>(family_flag(family, n)), 128u);
  }
  EXPECT_NE(family_flag(1, 0), family_flag(0, 0));
  EXPECT_LT(static_cast<uint32_t>(FlagKind::kProxyDone), 16u) << "the shared kinds stay in family 0";
}

}  // namespace
}  // namespace loom
