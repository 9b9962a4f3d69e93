// Names of an enum's values for options, environment variables and messages: one table per
// enum, read both ways.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "loom/status.h"

namespace loom {

template <class Enum>
struct EnumName {
  Enum value;
  std::string_view name;
};

// The name of `value` in `table`, `unknown` when the table lacks it.
template <class Enum, size_t N>
constexpr std::string_view name_in(const EnumName<Enum> (&table)[N], Enum value, std::string_view unknown = "?") {
  for (const EnumName<Enum>& entry : table) {
    if (entry.value == value) return entry.name;
  }
  return unknown;
}

// The value `table` names `name`; else invalid_argument "unknown <what> 'name' (expected a, b or
// c)", the names listed in the table's order.
template <class Enum, size_t N>
Result<Enum> parse_name_in(const EnumName<Enum> (&table)[N], std::string_view name, std::string_view what) {
  std::string expected;
  for (size_t i = 0; i < N; ++i) {
    if (table[i].name == name) return table[i].value;
    if (i > 0) expected += i + 1 == N ? " or " : ", ";
    expected += table[i].name;
  }
  return Status::invalid_argument("unknown " + std::string(what) + " '" + std::string(name) + "' (expected " + expected +
                                  ")");
}

}  // namespace loom
