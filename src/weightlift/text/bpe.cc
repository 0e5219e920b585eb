#include "weightlift/text/bpe.h"

#include <cstdio>
#include <nlohmann/json.hpp>
#include <queue>

namespace wl::text {

namespace {

std::string pair_key(std::string_view a, std::string_view b) {
  std::string k;
  k.reserve(a.size() + b.size() + 1);
  k.append(a);
  k.push_back('\xFF');
  k.append(b);
  return k;
}

// Length of the UTF-8 character that starts with byte `b` (1 for a stray byte).
size_t char_length(unsigned char b) { return b < 0xC0 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4; }

}  // namespace

Result<Bpe> Bpe::from_json(const nlohmann::json& m, std::string_view where) {
  const std::string at(where);
  Bpe bpe;
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (m.contains(key) && m[key].is_string() && !m[key].get<std::string>().empty()) {
      return invalid_argument(at + ": model." + key + " '" + m[key].get<std::string>() +
                              "' is not supported");
    }
  }
  if (m.contains("dropout") && !m["dropout"].is_null()) {
    return invalid_argument(at + ": model.dropout is not supported (BPE dropout samples)");
  }
  if (!m.contains("vocab") || !m["vocab"].is_object()) {
    return invalid_argument(at + ": model.vocab must be an object of token -> id");
  }
  bpe.vocab_.reserve(m["vocab"].size());
  for (const auto& [token, id] : m["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0) {
      return invalid_argument(at + ": model.vocab['" + token + "'] is not a token id");
    }
    bpe.vocab_.emplace(token, id.get<int64_t>());
  }
  const nlohmann::json& merges = m.value("merges", nlohmann::json::array());
  bpe.ranks_.reserve(merges.size());
  int32_t rank = 0;
  for (const nlohmann::json& merge : merges) {
    std::string a, b;
    if (merge.is_string()) {  // "left right", the older form
      const std::string s = merge.get<std::string>();
      const size_t space = s.find(' ', 1);
      if (space == std::string::npos) {
        return invalid_argument(at + ": model.merges[" + std::to_string(rank) + "] '" + s +
                                "' is not two tokens separated by a space");
      }
      a = s.substr(0, space), b = s.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() &&
               merge[1].is_string()) {
      a = merge[0].get<std::string>(), b = merge[1].get<std::string>();
    } else {
      return invalid_argument(at + ": model.merges[" + std::to_string(rank) +
                              "] is neither \"a b\" nor [\"a\", \"b\"]");
    }
    bpe.ranks_.emplace(pair_key(a, b), rank++);  // the first of a repeated pair keeps its rank
  }
  if (m.contains("unk_token") && m["unk_token"].is_string()) bpe.unk_ = m["unk_token"];
  bpe.byte_fallback_ = m.value("byte_fallback", false);
  bpe.ignore_merges_ = m.value("ignore_merges", false);
  return bpe;
}

void Bpe::encode(const std::string& piece, std::vector<std::string>& out) const {
  if (piece.empty()) return;
  if (ignore_merges_ && vocab_.count(piece)) {
    out.push_back(piece);
    return;
  }
  // The piece's characters as a linked list of symbols; merged symbols are marked dead.
  struct Symbol {
    std::string text;
    int prev = -1, next = -1;
    bool alive = true;
  };
  std::vector<Symbol> s;
  for (size_t i = 0; i < piece.size();) {
    const size_t n = std::min(char_length(static_cast<unsigned char>(piece[i])), piece.size() - i);
    s.push_back({piece.substr(i, n), int(s.size()) - 1, int(s.size()) + 1});
    i += n;
  }
  s.back().next = -1;
  // Candidate merges (rank, left symbol, the right symbol's text then): stale ones are skipped.
  struct Candidate {
    int32_t rank;
    int left;
    size_t right_len, left_len;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto consider = [&](int left) {
    const int right = s[size_t(left)].next;
    if (right < 0) return;
    auto it = ranks_.find(pair_key(s[size_t(left)].text, s[size_t(right)].text));
    if (it != ranks_.end()) {
      heap.push({it->second, left, s[size_t(right)].text.size(), s[size_t(left)].text.size()});
    }
  };
  for (int i = 0; i + 1 < int(s.size()); ++i) consider(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    Symbol& l = s[size_t(c.left)];
    if (!l.alive || l.next < 0 || l.text.size() != c.left_len) continue;
    Symbol& r = s[size_t(l.next)];
    if (r.text.size() != c.right_len) continue;  // it merged with its own right since
    l.text += r.text;
    r.alive = false;
    l.next = r.next;
    if (r.next >= 0) s[size_t(r.next)].prev = c.left;
    if (l.prev >= 0) consider(l.prev);
    consider(c.left);
  }
  for (int i = 0; i >= 0; i = s[size_t(i)].next) {
    const std::string& t = s[size_t(i)].text;
    if (vocab_.count(t)) {
      out.push_back(t);
      continue;
    }
    bool bytes_known = byte_fallback_;
    std::vector<std::string> bytes;
    for (unsigned char b : t) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      bytes.emplace_back(name);
      bytes_known = bytes_known && vocab_.count(bytes.back());
    }
    if (bytes_known) {
      out.insert(out.end(), bytes.begin(), bytes.end());
    } else {
      out.push_back(unk_);
    }
  }
}

}  // namespace wl::text
