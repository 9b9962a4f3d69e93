// The roles of a persistent kernel's CTAs: each role takes a contiguous range of CTAs, in the
// order of its enum values; the last role (by convention the compute role) takes every CTA left.
// The first CTAs are dispatched first, so the data-moving roles, listed before the compute role,
// start at once even on a GPU shared with other work.
//
// The host fills the table (a planner), the kernel reads it from its parameters. A CTA's role may
// change at a task boundary: a data role joins the last role when its items are done, and an
// on-GPU controller may later move the split; rest_index() orders the CTAs of the last role after
// such joins.
#pragma once

#include <cstdint>

#include "runtime/device_abi.h"  // LOOM_HOST_DEVICE

namespace loom::kernels::frame {

template <class Role, Role kLast>
struct RoleTable {
  static constexpr uint32_t kSizedRoles = static_cast<uint32_t>(kLast);  // the roles before the last
  static_assert(kSizedRoles >= 1, "a role table needs at least one role before the last (the compute role)");

  uint32_t sized[kSizedRoles] = {};  // CTAs of each role before the last

  LOOM_HOST_DEVICE void set(Role role, uint32_t ctas) { sized[static_cast<uint32_t>(role)] = ctas; }
  // First CTA of `role`.
  LOOM_HOST_DEVICE uint32_t begin(Role role) const {
    uint32_t first = 0;
    for (uint32_t r = 0; r < static_cast<uint32_t>(role) && r < kSizedRoles; ++r) first += sized[r];
    return first;
  }
  // CTAs of every role before the last: the last role's first CTA.
  LOOM_HOST_DEVICE uint32_t rest_begin() const { return begin(kLast); }
  // CTAs of `role` in a grid of `grid` CTAs (the grid matters only for the last role).
  LOOM_HOST_DEVICE uint32_t count(Role role, uint32_t grid = 0) const {
    if (role != kLast) return sized[static_cast<uint32_t>(role)];
    return grid > rest_begin() ? grid - rest_begin() : 0;
  }
  LOOM_HOST_DEVICE Role role_of(uint32_t cta) const {
    uint32_t end = 0;
    for (uint32_t r = 0; r < kSizedRoles; ++r) {
      end += sized[r];
      if (cta < end) return static_cast<Role>(r);
    }
    return kLast;
  }
  // Index of `cta` among the CTAs of its role.
  LOOM_HOST_DEVICE uint32_t index_in_role(uint32_t cta) const { return cta - begin(role_of(cta)); }
  // Index of `cta` in the last role once every CTA has joined it: the last role's own CTAs
  // first, then the others in CTA order (a queue hands out the work; the index orders claims).
  LOOM_HOST_DEVICE uint32_t rest_index(uint32_t cta, uint32_t grid) const {
    const uint32_t first = rest_begin();
    return cta >= first ? cta - first : count(kLast, grid) + cta;
  }
};

}  // namespace loom::kernels::frame
