// Versioned JSON records (core/json_record.h): a malformed record is "where: field: what",
// with the path of the value at fault, whether nlohmann or our own field readers refuse it.
#include "weightlift/core/json_record.h"

#include <gtest/gtest.h>

namespace wl {
namespace {

using nlohmann::json;

constexpr RecordFormat kFormat{
    .name = "test-record", .version = 3, .what = "test record", .remedy = "write it again"};

Result<int> read(std::string_view text) {
  return read_record<int>(text, "r.json", kFormat, [](const json& j) -> Result<int> {
    int sum = 0;
    for (const json& item : j.at("items")) sum += item.at("n").get<int>();
    (void)u64_field(j.at("big"));
    return sum;
  });
}

TEST(JsonRecord, ErrorsNameTheFileAndTheField) {
  const std::string head = R"({"format": "test-record", "format_version": 3, )";
  EXPECT_EQ(*read(head + R"("items": [{"n": 1}, {"n": 2}], "big": "7"})"), 3);
  const std::pair<std::string, std::string> cases[] = {
      {R"("items": [{"n": 1}, {"n": "2"}], "big": "7"})",
       "r.json: items[1].n: type must be number, but is string"},
      {R"("items": [{"n": 1}, {"m": 2}], "big": "7"})", "r.json: items[1]: key 'n' not found"},
      {R"("items": [], "big": "-7"})", "r.json: big: '-7' is not an unsigned 64-bit decimal"},
      {R"("items": []})", "r.json: key 'big' not found"},
  };
  for (const auto& [body, message] : cases) {
    Result<int> r = read(head + body);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
    EXPECT_EQ(r.status().message(), message);
  }
  Result<int> not_json = read("{\"format\": ");
  EXPECT_EQ(not_json.status().message().rfind("r.json: not a test record: parse error", 0), 0u)
      << not_json.status().message();
  Result<int> other = read(R"({"format": "test-record", "format_version": 2})");
  EXPECT_EQ(other.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(other.status().message().find("version 2, this build reads version 3; write it again"),
            std::string::npos);
}

TEST(JsonRecord, AnyExceptionBecomesAMessage) {
  EXPECT_EQ(json_error_message(std::runtime_error("plain")), "plain");
  try {
    (void)json::parse(R"({"a": {"b": [0, "x"]}})")["a"]["b"][1].get<int>();
    FAIL();
  } catch (const std::exception& e) {
    EXPECT_EQ(json_error_message(e), "a.b[1]: type must be number, but is string");
  }
}

// The one checked-integer reader behind int_field, int_field_in and model/config.cc: exactly
// the JSON integers of int64_t pass; a float, a string, 2^63 do not; bounds are inclusive.
TEST(JsonRecord, IntegersAreCheckedOnce) {
  EXPECT_EQ(*int_value(json::parse("-9223372036854775808")), INT64_MIN);
  EXPECT_EQ(*int_value(json::parse("9223372036854775807")), INT64_MAX);
  const std::pair<const char*, const char*> bad[] = {
      {"1.5", "expected an integer"},
      {"1e300", "expected an integer"},
      {"\"3\"", "expected an integer"},
      {"true", "expected an integer"},
      {"9223372036854775808", "beyond the 64-bit signed range"}};
  for (const auto& [text, what] : bad) {
    Result<int64_t> v = int_value(json::parse(text));
    ASSERT_FALSE(v.ok()) << text;
    EXPECT_EQ(v.status().message(), what) << text;
  }
  const json doc = json::parse(R"({"a": 1.5, "b": 4})");
  try {
    (void)int_field(doc.at("a"));
    FAIL();
  } catch (const std::exception& e) {
    EXPECT_EQ(json_error_message(e), "a: 1.5: expected an integer");
  }
  EXPECT_EQ(int_field_in(doc.at("b"), 4, 4), 4);
  for (const auto& [lo, hi] : {std::pair<int64_t, int64_t>{0, 3}, {5, 9}}) {
    try {
      (void)int_field_in(doc.at("b"), lo, hi);
      FAIL() << lo << ", " << hi;
    } catch (const std::exception& e) {
      EXPECT_EQ(json_error_message(e), "b: 4 is not an integer in [" + std::to_string(lo) + ", " +
                                           std::to_string(hi) + "]");
    }
  }
}

}  // namespace
}  // namespace wl
