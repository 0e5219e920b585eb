#include "weightlift/train/tokenizer.h"

namespace wl::train {

std::vector<int64_t> encode(std::string_view text, bool add_bos) {
  std::vector<int64_t> ids;
  ids.reserve(text.size() + 1);
  if (add_bos) ids.push_back(kBosToken);
  for (unsigned char c : text) ids.push_back(int64_t(c));
  return ids;
}

std::string decode(const std::vector<int64_t>& ids) {
  std::string s;
  for (int64_t id : ids) {
    if (id >= 0 && id < 256) {
      s.push_back(char(id));
    } else if (id >= kByteVocab) {
      s += "\xEF\xBF\xBD";
    }
  }
  return s;
}

}  // namespace wl::train
