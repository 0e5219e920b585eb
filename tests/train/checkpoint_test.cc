// A checkpoint's state.json (train/checkpoint_state.h): it round-trips, catches any changed
// byte, and range-checks its fields with errors naming the field. The tensors' side, and
// RunGuard, are tests/parallel/trust_test.cc.
#include <gtest/gtest.h>

#include "weightlift/core/checksum.h"
#include "weightlift/model/config.h"
#include "weightlift/train/checkpoint_state.h"

namespace wl::train {
namespace {

StateFile sample_state() {
  StateFile f;
  f.state = {.step = 4,
             .data_rng = {1, 2, 3, 18446744073709551615ull},
             .loss_scale = 32768,
             .loss_scale_clean_steps = 7,
             .run = {{"steps", "6"}, {"lr", "0.003"}}};
  f.adamw_steps = 3;
  f.config_json = model::config_to_json(*model::preset("tiny"));
  f.layout = {{"dp", 2}, {"pp", 1}, {"dp_mode", "fsdp"}, {"micro_batches", 1}};
  f.tensors = {{"norm.weight",
                {{"shape", {64}},
                 {"pieces",
                  {{{"file", "rank-00000-of-00002.safetensors"}, {"rows", {0, 32}}},
                   {{"file", "rank-00001-of-00002.safetensors"}, {"rows", {32, 64}}}}}}}};
  f.files["rank-00000-of-00002.safetensors"] = 0x0123456789abcdefull;
  f.files["rank-00001-of-00002.safetensors"] = 42;
  return f;
}

// `text` with state_checksum recomputed, as a careful forger (or this test) would.
std::string reseal(std::string text) { return seal_state_text(std::move(text)); }

std::string replaced(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return at == std::string::npos ? text : text.replace(at, from.size(), to);
}

TEST(CheckpointState, RoundTripsExactly) {
  const StateFile f = sample_state();
  const std::string text = state_to_json(f);
  Result<StateFile> back = state_from_json(text, "state.json");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->state.step, 4);
  EXPECT_EQ(back->state.data_rng, f.state.data_rng);
  EXPECT_EQ(back->state.loss_scale, 32768);
  EXPECT_EQ(back->state.loss_scale_clean_steps, 7);
  EXPECT_EQ(back->state.run, f.state.run);
  EXPECT_EQ(back->adamw_steps, 3);
  EXPECT_EQ(back->config_json, f.config_json);
  EXPECT_EQ(back->layout, f.layout);
  EXPECT_EQ(back->tensors, f.tensors);
  EXPECT_EQ(back->files, f.files);
  EXPECT_EQ(state_to_json(*back), text);
}

TEST(CheckpointState, AnyChangedByteIsCaught) {
  const std::string text = state_to_json(sample_state());
  for (size_t i = 0; i < text.size(); i += 7) {
    std::string t = text;
    t[i] = t[i] == '1' ? '2' : '1';
    Result<StateFile> r = state_from_json(t, "state.json");
    ASSERT_FALSE(r.ok()) << "byte " << i << " changed unnoticed";
  }
}

TEST(CheckpointState, FieldsOutOfRangeAreNamed) {
  const std::string text = state_to_json(sample_state());
  const std::pair<std::string, std::string> cases[][2] = {
      {{"\"adamw_steps\": 3", "\"adamw_steps\": 5"}, {"adamw_steps", "[0, 4]"}},
      {{"\"step\": 4", "\"step\": -1"}, {"step", "not an integer"}},
      {{"\"loss_scale\": 32768.0", "\"loss_scale\": 0.5"}, {"loss_scale", "[1, 2^100]"}},
      {{"\"1\",", "\"0\","}, {"", ""}},  // data_rng left non-zero: still valid
      {{"\"18446744073709551615\"", "\"-1\""}, {"data_rng[3]", "unsigned 64-bit"}},
      {{"\"0123456789abcdef\"", "\"0123\""}, {"files.rank-00000-of-00002.safetensors", "hex"}},
      {{"\"lr\": \"0.003\"", "\"lr\": 0.003"}, {"run.lr", "string"}},
  };
  for (const auto& c : cases) {
    Result<StateFile> r = state_from_json(reseal(replaced(text, c[0].first, c[0].second)), "s");
    if (c[1].first.empty()) {
      EXPECT_TRUE(r.ok()) << r.status().to_string();
      continue;
    }
    ASSERT_FALSE(r.ok()) << c[0].second;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
    EXPECT_EQ(r.status().message().rfind("s: " + c[1].first + ": ", 0), 0u) << r.status().message();
    EXPECT_NE(r.status().message().find(c[1].second), std::string::npos) << r.status().message();
  }
  std::string zero_rng = text;
  for (const char* w : {"\"1\"", "\"2\"", "\"3\"", "\"18446744073709551615\""})
    zero_rng = replaced(zero_rng, w, "\"0\"");
  EXPECT_NE(state_from_json(reseal(zero_rng), "s").status().message().find("all zero"),
            std::string::npos);
}

TEST(CheckpointState, OtherVersionsAreNamed) {
  std::string text = state_to_json(sample_state());
  Result<StateFile> r =
      state_from_json(replaced(text, "\"format_version\": 4", "\"version\": 1"), "s");
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("format version 1, this build reads version 4"),
            std::string::npos)
      << r.status().message();
  // Version 3 is version 4 without column bands: read as it is. Version 5 is not.
  Result<StateFile> v3 = state_from_json(
      seal_state_text(replaced(text, "\"format_version\": 4", "\"format_version\": 3")), "s");
  EXPECT_TRUE(v3.ok()) << v3.status().to_string();
  Result<StateFile> v5 = state_from_json(
      seal_state_text(replaced(text, "\"format_version\": 4", "\"format_version\": 5")), "s");
  EXPECT_EQ(v5.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(state_from_json("[1, 2]", "s").status().code(), StatusCode::kDataLoss);
}

}  // namespace
}  // namespace wl::train
