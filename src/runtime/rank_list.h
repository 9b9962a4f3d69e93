// Rank lists as people read them in messages: "3", "1, 3", "4-7".
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace loom::runtime {

// Consecutive ranks of `sorted_ranks` fold into a range. Once the text passes `cut_after_chars`,
// the rest is replaced by a count so that a message about a large job stays one readable line.
inline std::string format_rank_list(const std::vector<int>& sorted_ranks, size_t cut_after_chars = std::string::npos) {
  std::string text;
  size_t i = 0;
  while (i < sorted_ranks.size()) {
    size_t j = i;
    while (j + 1 < sorted_ranks.size() && sorted_ranks[j + 1] == sorted_ranks[j] + 1) ++j;
    if (!text.empty()) text += ", ";
    if (text.size() > cut_after_chars) return text + "and " + std::to_string(sorted_ranks.size() - i) + " more";
    text += std::to_string(sorted_ranks[i]);
    if (j > i) {
      text += '-';
      text += std::to_string(sorted_ranks[j]);
    }
    i = j + 1;
  }
  return text;
}

}  // namespace loom::runtime
