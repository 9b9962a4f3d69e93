// Names of operators and flag kinds, for messages (error records name both). loom's shared ones
// (device_abi.h) are built in; an operator family registers its own ids once, at static
// initialization, with a NameRegistration in one of its host files, so adding a family edits no
// central list.
#pragma once

#include <initializer_list>

#include "runtime/device_abi.h"

namespace loom {

struct FlagKindName {
  FlagKind kind;
  const char* name;  // a string literal
};
struct OpName {
  OpId op;
  const char* name;  // a string literal
};

// Registers names; a second registration of a code keeps the first (and logs the clash).
void register_flag_kind_names(std::initializer_list<FlagKindName> names);
void register_op_names(std::initializer_list<OpName> names);

// `static const NameRegistration tp_names{{...flags...}, {...ops...}};` in a family's host file.
struct NameRegistration {
  NameRegistration(std::initializer_list<FlagKindName> flags, std::initializer_list<OpName> ops = {}) {
    register_flag_kind_names(flags);
    register_op_names(ops);
  }
};

}  // namespace loom
