// documents.h.
#include "weightlift/train/documents.h"

#include <nlohmann/json.hpp>
#include <sstream>

#include "weightlift/core/file_io.h"
#include "weightlift/train/jsonl.h"

namespace wl::train {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kMaxTextBytes = 4ull << 30;

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The documents of a JSONL file, or of a text file split at blank lines.
Result<std::vector<std::string>> documents_of(const std::string& path, const std::string& text) {
  std::vector<std::string> docs;
  std::istringstream in(text);
  std::string line;
  if (ends_with(path, ".jsonl")) {
    WL_RETURN_IF_ERROR(for_each_json_line(path, text, [&](const JsonLine& l) {
      const nlohmann::json& j = l.value;
      if (!j.is_object() || !j.contains("text") || !j["text"].is_string()) {
        return invalid_argument(l.at + ": expected an object with a string \"text\"");
      }
      docs.push_back(j["text"].get<std::string>());
      return ok_status();
    }));
    return docs;
  }
  std::string doc;
  auto flush = [&] {
    if (!doc.empty()) docs.push_back(std::move(doc));
    doc.clear();
  };
  while (std::getline(in, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) {
      flush();
      continue;
    }
    doc += (doc.empty() ? "" : "\n") + line;
  }
  flush();
  return docs;
}

}  // namespace

Result<DocumentStreams> load_documents(const std::string& path, const Codec& codec) {
  WL_ASSIGN_OR_RETURN(const std::string text, read_file(path, kMaxTextBytes, "a text file"));
  WL_ASSIGN_OR_RETURN(const std::vector<std::string> docs, documents_of(path, text));
  DocumentStreams s;
  for (const std::string& d : docs) {
    const bool validation = in_held_out_split(d);
    std::vector<int64_t>& stream = validation ? s.validation : s.train;
    const std::vector<int64_t> ids = codec.encode_prompt(d);
    stream.insert(stream.end(), ids.begin(), ids.end());
    stream.push_back(codec.eos());
    ++s.documents;
    s.held_out += validation;
  }
  if (s.documents == 0) return invalid_argument(path + ": no documents");
  return s;
}

}  // namespace wl::train
