// The tokenizer's parts on inputs small enough to work out by hand (the real tokenizer.json
// files are checked line by line against the JavaScript reference by check_tokenizers.py):
// WHATWG's replacement of ill-formed UTF-8, BPE's merge order, byte fallback, added tokens,
// the JavaScript meaning of \s, and errors that name the key at fault.
#include "weightlift/text/tokenizer.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "weightlift/text/unicode.h"

namespace wl::text {
namespace {

TEST(Utf8, IllFormedBytesAreReplacedAsWhatwgDoes) {
  EXPECT_EQ(decode_utf8_lossy("plain \xC3\xA9"), "plain \xC3\xA9");
  // A lead byte whose sequence is cut short: one U+FFFD, and the next byte read anew.
  EXPECT_EQ(decode_utf8_lossy("a\xC3("), "a\xEF\xBF\xBD(");
  // A truncated 4-byte sequence is one maximal subpart: one U+FFFD, at the end too.
  EXPECT_EQ(decode_utf8_lossy("\xF0\x9F\x98"), "\xEF\xBF\xBD");
  // Overlongs and surrogates: each byte its own U+FFFD (E0 80 is not a valid start).
  EXPECT_EQ(decode_utf8_lossy("\xE0\x80\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(decode_utf8_lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(decode_utf8_lossy("\xFF\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(utf8_to_utf16("\xF0\x9F\x98\x80"), std::u16string(u"\U0001F600"));
  EXPECT_EQ(utf16_to_utf8(std::u16string(1, char16_t(0xD800))), "\xEF\xBF\xBD");
}

TEST(Regex, BackslashSIsJavaScriptsWhiteSpace) {
  Result<Regex> re = Regex::compile("\\s+", "test");
  ASSERT_TRUE(re.ok()) << re.status().to_string();
  // U+000B and U+FEFF are white space to JavaScript (not to ICU's \s); U+0085 is not.
  const std::u16string text = u"a\u000B\uFEFFb\u0085c";
  const auto m = re->matches(text);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0], std::make_pair(1, 3));
  // Set syntax that means something to ICU but not to JavaScript is taken literally.
  Result<Regex> punct = Regex::compile("[$&{}]+", "test");
  ASSERT_TRUE(punct.ok()) << punct.status().to_string();
  EXPECT_EQ(punct->matches(u"x$&{}y").size(), 1u);
}

// A byte-level BPE over "a", "b", "c" with merges (a b) before (b c): "abc" is "ab" + "c".
nlohmann::json tiny_tokenizer() {
  return {
      {"model",
       {{"type", "BPE"},
        {"vocab", {{"a", 0}, {"b", 1}, {"c", 2}, {"ab", 3}, {"bc", 4}, {"abc", 5}, {"<0x7A>", 6}}},
        {"merges", {"a b", "b c"}},
        {"byte_fallback", true}}},
      {"added_tokens",
       {{{"id", 7}, {"content", "<x>"}, {"special", true}},
        {{"id", 8}, {"content", "<xy>"}, {"special", true}}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "<x>"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}}}},
      {"decoder",
       {{"type", "Sequence"}, {"decoders", {{{"type", "ByteFallback"}}, {{"type", "Fuse"}}}}}}};
}

TEST(Tokenizer, MergesByRankAddedTokensLongestAndBytesAsFallback) {
  Result<Tokenizer> t = Tokenizer::parse(tiny_tokenizer().dump(), "", "tiny.json");
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(t->encode("abc"), (std::vector<int64_t>{3, 2}));  // (a b) has the lower rank
  EXPECT_EQ(t->encode("bc"), (std::vector<int64_t>{4}));
  EXPECT_EQ(t->encode("z"), (std::vector<int64_t>{6}));  // not in the vocabulary: its byte
  // The longest added token wins where two start at the same place.
  EXPECT_EQ(t->encode("a<xy>b<x>"), (std::vector<int64_t>{0, 8, 1, 7}));
  EXPECT_EQ(t->encode("ab", true), (std::vector<int64_t>{7, 3}));  // the template's <x>
  Result<std::string> text = t->decode(std::vector<int64_t>{3, 6, 7});
  ASSERT_TRUE(text.ok()) << text.status().to_string();
  EXPECT_EQ(*text, "abz<x>");
  EXPECT_EQ(t->decode(std::vector<int64_t>{99}).status().code(), StatusCode::kOutOfRange);
}

TEST(Tokenizer, WhatIsNotSupportedIsRefusedNamingTheKey) {
  nlohmann::json j = tiny_tokenizer();
  j["model"]["type"] = "Unigram";
  EXPECT_NE(Tokenizer::parse(j.dump(), "", "t.json")
                .status()
                .message()
                .find("model.type 'Unigram' is not supported"),
            std::string::npos);
  j = tiny_tokenizer();
  j["normalizer"] = {{"type", "BertNormalizer"}};
  EXPECT_NE(Tokenizer::parse(j.dump(), "", "t.json")
                .status()
                .message()
                .find("normalizer: normalizer type 'BertNormalizer' is not supported"),
            std::string::npos);
  j = tiny_tokenizer();
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", "("}}}, {"behavior", "Isolated"}}}}};
  const Status bad_regex = Tokenizer::parse(j.dump(), "", "t.json").status();
  EXPECT_NE(bad_regex.message().find("pre_tokenizer.pretokenizers[0].pattern"), std::string::npos)
      << bad_regex.to_string();
  EXPECT_EQ(Tokenizer::parse("{not json", "", "t.json").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_NE(
      Tokenizer::parse(tiny_tokenizer().dump(),
                       R"({"tokenizer_class": "LlamaTokenizerFast", "legacy": false})", "t.json")
          .status()
          .message()
          .find("legacy: false"),
      std::string::npos);
}

}  // namespace
}  // namespace wl::text
