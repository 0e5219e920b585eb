// safetensors: round trips of every dtype and of strided views, the exact bytes the writer
// produces, files made by hand the way other writers make them, and every way a file can lie
// (truncated at each byte, header lengths, offsets, JSON), plus failing writes: a missing
// directory, a full disk (/dev/full), a file-size limit hit mid-write.
#include "weightlift/core/safetensors.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "support/paths.h"

namespace wl {
namespace {

namespace fs = std::filesystem;

constexpr DType kAllDtypes[] = {DType::kF32,    DType::kBF16, DType::kF16, DType::kF8E4M3,
                                DType::kF8E5M2, DType::kI64,  DType::kI32, DType::kU8};

// A tensor whose bytes are a pattern that differs per tensor, so a swapped or shifted tensor
// cannot compare equal.
Tensor patterned(DType dtype, Shape shape, int seed) {
  Tensor t = Tensor::empty(dtype, std::move(shape));
  auto* p = reinterpret_cast<uint8_t*>(t.raw());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = uint8_t(i * 37 + size_t(seed) * 11 + 1);
  return t;
}

std::string bytes_of(const Tensor& t) {
  Tensor c = t.is_contiguous() ? t : t.clone();
  return std::string(reinterpret_cast<const char*>(c.raw()), c.nbytes());
}

std::string file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

void write_file(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

// 8-byte little-endian length, then the header text as given, then the data: a file laid out
// by hand, independent of write_safetensors.
std::string raw_file(std::string_view header, std::string_view data, uint64_t n = UINT64_MAX) {
  if (n == UINT64_MAX) n = header.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((n >> (8 * i)) & 0xff);
  out += header;
  out += data;
  return out;
}

// A temporary of the atomic writer ("<name>.tmp.XXXXXX") left in `dir`.
bool has_temporary(const std::string& dir) {
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().find(".tmp") != std::string::npos) return true;
  return false;
}

Result<SafetensorsFile> parse(std::string bytes) {
  return SafetensorsFile::parse(std::make_shared<const std::string>(std::move(bytes)),
                                "t.safetensors");
}

// The status must be `code` and its message must name the file and contain `fragment`.
void expect_error(const Result<SafetensorsFile>& r, StatusCode code, std::string_view fragment) {
  ASSERT_FALSE(r.ok()) << "expected an error containing: " << fragment;
  EXPECT_EQ(r.status().code(), code) << r.status().to_string();
  EXPECT_NE(r.status().message().find("t.safetensors"), std::string::npos)
      << r.status().to_string();
  EXPECT_NE(r.status().message().find(fragment), std::string::npos)
      << "wanted '" << fragment << "' in: " << r.status().to_string();
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "wl_safetensors_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(std::string_view name) const { return (fs::path(dir_) / name).string(); }

  std::string dir_;
};

// ---- round trips ----------------------------------------------------------------------------

TEST_F(SafetensorsTest, RoundTripsEveryDtypeWithEmptyScalarAndStridedTensors) {
  for (DType dtype : kAllDtypes) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    Tensor base3 = patterned(dtype, {3, 4, 5}, 7);
    std::vector<std::pair<std::string, Tensor>> ts = {
        {"scalar", patterned(dtype, {}, 1)},
        {"empty", patterned(dtype, {0}, 2)},
        {"empty_inner", patterned(dtype, {3, 0, 2}, 3)},
        {"vec", patterned(dtype, {5}, 4)},
        {"mat", patterned(dtype, {3, 7}, 5)},
        {"columns", patterned(dtype, {7, 6}, 6).slice(1, 1, 4)},  // [7, 3], row stride 6
        {"row_of_3d", base3[1]},                                  // contiguous, offset view
        {"last_dim_slice", base3.slice(2, 1, 3)},                 // [3, 4, 2], strided
        {"middle_dim_slice", base3.slice(1, 1, 3)},               // [3, 2, 5], strided
        {"empty_slice", base3.slice(1, 2, 2)},                    // [3, 0, 5]
    };
    ASSERT_FALSE(ts[5].second.is_contiguous());
    ASSERT_FALSE(ts[7].second.is_contiguous());
    std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "12"}};
    const std::string p = path("all.safetensors");
    ASSERT_TRUE(write_safetensors(p, ts, meta).ok());
    EXPECT_FALSE(has_temporary(dir_));

    auto f = SafetensorsFile::open(p);
    ASSERT_TRUE(f.ok()) << f.status().to_string();
    EXPECT_EQ(f->metadata(), meta);
    ASSERT_EQ(f->tensors().size(), ts.size());
    for (size_t i = 1; i < f->tensors().size(); ++i) {
      EXPECT_LE(f->tensors()[i - 1].end, f->tensors()[i].begin);  // offset order
    }
    for (const auto& [name, t] : ts) {
      SCOPED_TRACE(name);
      auto got = f->get(name, dtype, t.shape());
      ASSERT_TRUE(got.ok()) << got.status().to_string();
      EXPECT_EQ(got->dtype(), dtype);
      EXPECT_EQ(got->shape(), t.shape());
      EXPECT_TRUE(got->is_contiguous());
      EXPECT_EQ(bytes_of(*got), bytes_of(t));
    }
  }
}

TEST_F(SafetensorsTest, MixedDtypesKeepGivenOrderAndMisalignedTensorsAreCopiedAligned) {
  // BF16 [1] puts the F32 at data offset 2, which is not 4-aligned.
  Tensor odd = patterned(DType::kBF16, {1}, 1);
  Tensor f32 = Tensor::empty(DType::kF32, {3});
  for (int i = 0; i < 3; ++i) f32.data<float>()[i] = 1.5f * float(i) - 1.0f;
  Tensor i64 = patterned(DType::kI64, {2}, 3);
  const std::string p = path("mixed.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{"z_first", odd}, {"a_second", f32}, {"m_third", i64}}).ok());
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  ASSERT_EQ(f->tensors().size(), 3u);
  EXPECT_EQ(f->tensors()[0].name, "z_first");
  EXPECT_EQ(f->tensors()[1].name, "a_second");
  EXPECT_EQ(f->tensors()[1].begin, 2u);
  EXPECT_EQ(f->tensors()[2].begin, 14u);
  auto a = f->get("a_second");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a->raw()) % 4, 0u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(a->data<float>()[i], 1.5f * float(i) - 1.0f);
  auto m = f->get("m_third");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(m->raw()) % 8, 0u);
  EXPECT_EQ(bytes_of(*m), bytes_of(i64));
}

TEST_F(SafetensorsTest, WriterProducesExactlyTheSpecifiedBytes) {
  Tensor t = Tensor::empty(DType::kF32, {2});
  t.data<float>()[0] = 1.0f;
  t.data<float>()[1] = -2.0f;
  const std::string p = path("golden.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{"a", t}}, {{"format", "pt"}}).ok());

  std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  header.append((8 - header.size() % 8) % 8, ' ');                // spaces to a multiple of 8
  const std::string data("\x00\x00\x80\x3f\x00\x00\x00\xc0", 8);  // 1.0f, -2.0f little-endian
  const std::string got = file_text(p);
  EXPECT_EQ(got, raw_file(header, data));
  EXPECT_EQ((got.size() - data.size()) % 8, 0u);
}

TEST_F(SafetensorsTest, EmptyFileListIsAValidFile) {
  const std::string p = path("none.safetensors");
  ASSERT_TRUE(write_safetensors(p, {}).ok());
  EXPECT_EQ(file_text(p), raw_file("{}      ", ""));
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_TRUE(f->tensors().empty());
}

TEST_F(SafetensorsTest, NamesAndMetadataWithEscapesRoundTrip) {
  const std::string name = "we\"ird \\ name\n\xc3\xa9";  // quote, backslash, newline, e-acute
  std::map<std::string, std::string> meta = {{"k\"ey", "va\tl\xe2\x82\xac"}, {"", ""}};
  const std::string p = path("names.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{name, patterned(DType::kU8, {3}, 1)}}, meta).ok());
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->metadata(), meta);
  EXPECT_NE(f->find(name), nullptr);
}

TEST_F(SafetensorsTest, ReadsAFileLaidOutByHandAsOtherWritersDo) {
  // Keys out of offset order, whitespace, no padding, scalar first in the data section.
  const std::string header =
      "{ \"w\" : {\"shape\": [2, 2], \"dtype\": \"BF16\", \"data_offsets\": [4, 12]},\n"
      "  \"s\": {\"dtype\": \"I32\", \"shape\": [], \"data_offsets\": [0, 4]},"
      "  \"e\": {\"dtype\": \"F16\", \"shape\": [0, 3], \"data_offsets\": [12, 12]} }";
  std::string data;
  data += std::string("\x2a\x00\x00\x00", 4);                  // I32 42
  data += std::string("\x80\x3f\x00\x40\x40\x40\x80\xbf", 8);  // BF16 1, 2, 3, -1
  auto f = parse(raw_file(header, data));
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  auto s = f->get("s", DType::kI32, {});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->data<int32_t>()[0], 42);
  auto w = f->get("w", DType::kBF16, {2, 2});
  ASSERT_TRUE(w.ok());
  const float expect[] = {1.0f, 2.0f, 3.0f, -1.0f};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(bf16_to_f32(w->data<uint16_t>()[i]), expect[i]);
  EXPECT_TRUE(f->get("e", DType::kF16, {0, 3}).ok());
  EXPECT_EQ(f->tensors()[0].name, "s");  // offset order, not header order
}

TEST_F(SafetensorsTest, ViewsKeepTheMappingAliveAfterTheFileObjectAndTheFileAreGone) {
  const std::string p = path("alive.safetensors");
  Tensor t = patterned(DType::kF32, {64, 64}, 9);
  ASSERT_TRUE(write_safetensors(p, {{"t", t}}).ok());
  Tensor view;
  {
    auto f = SafetensorsFile::open(p);
    ASSERT_TRUE(f.ok());
    auto v = f->get("t");
    ASSERT_TRUE(v.ok());
    view = *v;
  }
  fs::remove(p);
  EXPECT_EQ(bytes_of(view), bytes_of(t));
}

// ---- corrupt and truncated files -----------------------------------------------------------

std::string small_valid_file() {
  std::vector<std::pair<std::string, Tensor>> ts = {
      {"embed.weight", patterned(DType::kBF16, {4, 3}, 1)},
      {"empty", patterned(DType::kF32, {0, 2}, 2)},
      {"norm.weight", patterned(DType::kF32, {3}, 3)},
      {"q", patterned(DType::kF8E4M3, {5}, 4)},
  };
  std::string p = (fs::temp_directory_path() / ("wl_small_" + std::to_string(::getpid()))).string();
  Status st = write_safetensors(p, ts, {{"format", "pt"}});
  WL_CHECK(st.ok()) << st.to_string();
  std::string bytes = file_text(p);
  fs::remove(p);
  return bytes;
}

TEST_F(SafetensorsTest, TruncationAtEveryByteIsDataLossInMemoryAndOnDisk) {
  const std::string full = small_valid_file();
  ASSERT_TRUE(parse(full).ok());
  const std::string p = path("cut.safetensors");
  for (size_t k = 0; k < full.size(); ++k) {
    SCOPED_TRACE("truncated to " + std::to_string(k) + " of " + std::to_string(full.size()));
    auto r = parse(full.substr(0, k));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().to_string();
    write_file(p, full.substr(0, k));
    auto d = SafetensorsFile::open(p);
    ASSERT_FALSE(d.ok());
    EXPECT_EQ(d.status().code(), StatusCode::kDataLoss) << d.status().to_string();
    EXPECT_NE(d.status().message().find(p), std::string::npos) << d.status().to_string();
  }
}

TEST_F(SafetensorsTest, EveryByteChangedNeverCrashes) {
  // Outcomes vary (a changed data byte is still a valid file); what must hold is that each
  // is a Status, and that an accepted file's tensors all lie inside it.
  const std::string full = small_valid_file();
  for (size_t k = 0; k < full.size(); ++k) {
    for (uint8_t v : {uint8_t(0x00), uint8_t(0xff), uint8_t(full[k] ^ 0x01), uint8_t('"')}) {
      std::string b = full;
      b[k] = char(v);
      auto r = parse(b);
      if (!r.ok()) continue;
      for (const TensorInfo& t : r->tensors()) {
        auto got = r->get(t.name);
        ASSERT_TRUE(got.ok());
        EXPECT_EQ(got->nbytes(), t.end - t.begin);
        EXPECT_LE(t.end, b.size());
      }
    }
  }
}

TEST_F(SafetensorsTest, HeaderLengthsThatLie) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data = "ABCDEFGH";
  ASSERT_TRUE(parse(raw_file(header, data)).ok());
  const uint64_t avail = header.size() + data.size();
  expect_error(parse(""), StatusCode::kDataLoss, "shorter than the 8-byte header length");
  expect_error(parse("1234567"), StatusCode::kDataLoss, "7 bytes");
  expect_error(parse(raw_file(header, data, 0)), StatusCode::kDataLoss, "begin with '{'");
  expect_error(parse(raw_file(header, data, avail + 1)), StatusCode::kDataLoss,
               "runs past the end");
  expect_error(parse(raw_file(header, data, UINT64_MAX - 1)), StatusCode::kDataLoss,
               "exceeds the 100000000-byte limit");
  expect_error(parse(raw_file(header, data, 100'000'001)), StatusCode::kDataLoss, "exceeds");
  // Shorter: the JSON is cut. Longer: data bytes follow the JSON inside the header.
  expect_error(parse(raw_file(header, data, header.size() - 1)), StatusCode::kDataLoss,
               "not valid JSON");
  expect_error(parse(raw_file(header, data, header.size() + 3)), StatusCode::kDataLoss,
               "not valid JSON");
}

struct BadHeader {
  const char* what;
  std::string header;
  size_t data_bytes;
  StatusCode code;
  const char* fragment;
};

TEST_F(SafetensorsTest, HeadersThatLie) {
  const std::string u64max = std::to_string(std::numeric_limits<uint64_t>::max());
  const std::string e = R"("dtype":"F32","shape":[2],"data_offsets":)";  // F32 [2] needs 8 bytes
  const BadHeader cases[] = {
      {"overlap", R"({"a":{)" + e + R"([0,8]},"b":{)" + e + "[4,12]}}", 12, StatusCode::kDataLoss,
       "overlap tensor 'a'"},
      {"same range twice", R"({"a":{)" + e + R"([0,8]},"b":{)" + e + "[0,8]}}", 8,
       StatusCode::kDataLoss, "overlap"},
      {"gap", R"({"a":{)" + e + R"([0,8]},"b":{)" + e + "[12,20]}}", 20, StatusCode::kDataLoss,
       "bytes [8, 12) of the data section unused"},
      {"gap at start", R"({"a":{)" + e + "[4,12]}}", 12, StatusCode::kDataLoss, "unused"},
      {"trailing bytes", R"({"a":{)" + e + "[0,8]}}", 12, StatusCode::kDataLoss,
       "data section is 12 bytes but its tensors cover only 8"},
      {"beyond the end", R"({"a":{)" + e + "[0,8]}}", 4, StatusCode::kDataLoss,
       "tensor 'a': data_offsets [0, 8] end beyond the data section of 4 bytes"},
      {"wrong size", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8,
       StatusCode::kDataLoss, "data_offsets [0, 8] hold 8 bytes but F32 [3] needs 12"},
      {"begin after end", R"({"a":{)" + e + "[8,0]}}", 8, StatusCode::kDataLoss, "begin after end"},
      {"huge end", R"({"a":{)" + e + "[8," + u64max + "]}}", 8, StatusCode::kDataLoss, "needs 8"},
      {"huge both", R"({"a":{)" + e + "[" + u64max + "," + u64max + "]}}", 8, StatusCode::kDataLoss,
       "needs 8"},
      {"numel overflows",
       R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,2],)"
       R"("data_offsets":[0,0]}})",
       0, StatusCode::kDataLoss, "more elements or bytes than 64 bits"},
      {"bytes overflow",
       R"({"a":{"dtype":"F32","shape":[4611686018427387904],)"
       R"("data_offsets":[0,0]}})",
       0, StatusCode::kDataLoss, "more elements or bytes than 64 bits"},
      {"empty but strides overflow",
       R"({"a":{"dtype":"F32","shape":[0,4294967296,)"
       R"(4294967296],"data_offsets":[0,0]}})",
       0, StatusCode::kDataLoss, "more elements or bytes than 64 bits"},
      {"dim beyond int64",
       R"({"a":{"dtype":"U8","shape":[9223372036854775808],)"
       R"("data_offsets":[0,0]}})",
       0, StatusCode::kDataLoss, "shape[0] is 9223372036854775808"},
      {"negative dim", R"({"a":{"dtype":"F32","shape":[2,-1],"data_offsets":[0,0]}})", 0,
       StatusCode::kDataLoss, "shape[1] is -1"},
      {"float dim", R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8,
       StatusCode::kDataLoss, "shape[0] is 2.0, not an integer"},
      {"string dim", R"({"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", 8,
       StatusCode::kDataLoss, "shape[0]"},
      {"shape not a list", R"({"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", 8,
       StatusCode::kDataLoss, "shape is 2, not a list"},
      {"nested shape", R"({"a":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})", 8,
       StatusCode::kDataLoss, "nests deeper than 3 levels"},
      {"one offset", R"({"a":{)" + e + "[8]}}", 8, StatusCode::kDataLoss,
       "data_offsets is an array of 1, not a list of two"},
      {"three offsets", R"({"a":{)" + e + "[0,8,8]}}", 8, StatusCode::kDataLoss,
       "data_offsets is an array of 3"},
      {"negative offset", R"({"a":{)" + e + "[-8,0]}}", 8, StatusCode::kDataLoss, "data_offsets"},
      {"float offset", R"({"a":{)" + e + "[0,8.0]}}", 8, StatusCode::kDataLoss, "data_offsets"},
      {"offsets not a list", R"({"a":{)" + e + "8}}", 8, StatusCode::kDataLoss,
       "data_offsets is 8"},
      {"unknown dtype", R"({"a":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}})", 8,
       StatusCode::kDataLoss, "unknown dtype \"F31\""},
      {"dtype not a string", R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", 8,
       StatusCode::kDataLoss, "dtype is 4, not a string"},
      {"valid but unsupported dtype", R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})",
       8, StatusCode::kInvalidArgument, "dtype F64 is valid safetensors but weightlift reads"},
      {"missing dtype", R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8, StatusCode::kDataLoss,
       "tensor 'a': missing field 'dtype'"},
      {"missing shape", R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", 8, StatusCode::kDataLoss,
       "missing field 'shape'"},
      {"missing offsets", R"({"a":{"dtype":"F32","shape":[2]}})", 8, StatusCode::kDataLoss,
       "missing field 'data_offsets'"},
      {"unknown field", R"({"a":{)" + e + R"([0,8],"order":"big"}})", 8, StatusCode::kDataLoss,
       "unknown field 'order'"},
      {"entry not an object", R"({"a":[1,2]})", 0, StatusCode::kDataLoss,
       "tensor 'a': entry is an array of 2, not an object"},
      {"duplicate tensor", R"({"a":{)" + e + R"([0,8]},"a":{)" + e + "[8,16]}}", 16,
       StatusCode::kDataLoss, "key 'a' appears twice"},
      {"duplicate field", R"({"a":{)" + e + R"([0,8],"dtype":"U8"}})", 8, StatusCode::kDataLoss,
       "key 'dtype' appears twice"},
      {"metadata not a map", R"({"__metadata__":3})", 0, StatusCode::kDataLoss,
       "__metadata__ is 3, not a string->string map"},
      {"metadata value not a string", R"({"__metadata__":{"k":1}})", 0, StatusCode::kDataLoss,
       "__metadata__['k'] is 1, not a string"},
      {"metadata nested", R"({"__metadata__":{"k":{}}})", 0, StatusCode::kDataLoss,
       "__metadata__['k'] is an object"},
      {"not JSON", R"({"a":)", 0, StatusCode::kDataLoss, "not valid JSON"},
      {"number beyond double", R"({"a":{"dtype":"F32","shape":[1e400],"data_offsets":[0,4]}})", 4,
       StatusCode::kDataLoss, "not valid JSON"},
      {"trailing garbage", R"({} x)", 0, StatusCode::kDataLoss, "not valid JSON"},
      {"array header", R"([1])", 0, StatusCode::kDataLoss, "begin with '{'"},
      {"leading space", R"( {})", 0, StatusCode::kDataLoss, "begin with '{'"},
      {"invalid UTF-8", "{\"\xff\":{}}", 0, StatusCode::kDataLoss, "not valid JSON"},
  };
  for (const BadHeader& c : cases) {
    SCOPED_TRACE(c.what);
    expect_error(parse(raw_file(c.header, std::string(c.data_bytes, 'x'))), c.code, c.fragment);
  }
}

TEST_F(SafetensorsTest, EdgeHeadersThatAreValid) {
  const std::string e = R"("dtype":"F32","shape":[2],"data_offsets":)";
  struct Ok {
    const char* what;
    std::string header;
    size_t data_bytes;
  };
  const Ok cases[] = {
      {"empty object", "{}", 0},
      {"padded with spaces", "{}      ", 0},
      {"null metadata", R"({"__metadata__":null})", 0},
      {"empty tensors share offsets",
       R"({"z":{"dtype":"U8","shape":[0],"data_offsets":[8,8]},)"
       R"("a":{)" +
           e +
           R"([0,8]},)"
           R"("y":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})",
       8},
      {"zero dim beside large dims",
       R"({"a":{"dtype":"F32","shape":[0,2147483648,)"
       R"(2147483648],"data_offsets":[0,0]}})",
       0},
      {"empty name", R"({"":{)" + e + "[0,8]}}", 8},
  };
  for (const Ok& c : cases) {
    SCOPED_TRACE(c.what);
    auto r = parse(raw_file(c.header, std::string(c.data_bytes, 'x')));
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    for (const TensorInfo& t : r->tensors()) EXPECT_TRUE(r->get(t.name).ok());
  }
}

TEST_F(SafetensorsTest, GetChecksNameDtypeAndShape) {
  auto f = parse(
      raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(8, 'x')));
  ASSERT_TRUE(f.ok());
  EXPECT_TRUE(f->get("a", DType::kF32, {2}).ok());
  auto wrong_dtype = f->get("a", DType::kBF16, {2});
  ASSERT_FALSE(wrong_dtype.ok());
  EXPECT_EQ(wrong_dtype.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(wrong_dtype.status().message(),
            "t.safetensors: tensor 'a' is F32 [2], expected BF16 [2]");
  auto wrong_shape = f->get("a", DType::kF32, {1, 2});
  ASSERT_FALSE(wrong_shape.ok());
  EXPECT_EQ(wrong_shape.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrong_shape.status().message().find("expected F32 [1, 2]"), std::string::npos);
  for (auto r : {f->get("b"), f->get("b", DType::kF32, {2})}) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
    EXPECT_NE(r.status().message().find("t.safetensors: no tensor 'b'"), std::string::npos);
  }
  EXPECT_EQ(f->find("b"), nullptr);
}

TEST_F(SafetensorsTest, OpenFailuresNameThePath) {
  auto missing = SafetensorsFile::open(path("nope.safetensors"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(path("nope.safetensors")), std::string::npos);

  auto directory = SafetensorsFile::open(dir_);
  ASSERT_FALSE(directory.ok());
  EXPECT_EQ(directory.status().code(), StatusCode::kInvalidArgument);

  write_file(path("empty.safetensors"), "");
  auto empty = SafetensorsFile::open(path("empty.safetensors"));
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), StatusCode::kDataLoss);
}

// ---- failing writes -------------------------------------------------------------------------

TEST_F(SafetensorsTest, WriteIntoMissingDirectoryFailsCleanly) {
  const std::string p = path("no/such/dir/w.safetensors");
  Status st = write_safetensors(p, {{"a", patterned(DType::kF32, {4}, 1)}});
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_NE(st.message().find(p), std::string::npos) << st.to_string();
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(SafetensorsTest, FailedWriteLeavesTheOldFileAndNoTemporary) {
  // RLIMIT_FSIZE fails the write part-way (EFBIG), as a full disk would with ENOSPC (whose
  // code errno_status maps to ResourceExhausted, status_test.cc). The limit applies to the
  // whole process, so it runs in a forked child.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string p = path("w.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{"old", patterned(DType::kU8, {3}, 1)}}).ok());
  const std::string before = file_text(p);
  auto child = [&]() {
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim = {4096, 4096};
    if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) return 2;
    Status st = write_safetensors(p, {{"new", patterned(DType::kF32, {4096}, 2)}});
    if (st.ok()) return 3;
    if (st.message().find("write " + p + ".tmp.") == std::string::npos) return 4;
    if (has_temporary(dir_)) return 5;
    return file_text(p) == before ? 0 : 6;
  };
  EXPECT_EXIT(std::_Exit(child()), ::testing::ExitedWithCode(0), "");
}

TEST_F(SafetensorsTest, FileSizeLimitMidWriteFailsAndRemovesTmp) {
  // RLIMIT_FSIZE makes write() fail with EFBIG after a partial write, in the middle of the
  // data section. The limit applies to the whole process, so it runs in a forked child.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string p = path("big.safetensors");
  auto child = [&]() {
    ::signal(SIGXFSZ, SIG_IGN);  // otherwise the signal kills the process instead of EFBIG
    struct rlimit lim = {4096, 4096};
    if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) return 2;
    Status st = write_safetensors(p, {{"a", patterned(DType::kF32, {256, 64}, 1)}});
    if (st.ok()) return 3;
    if (st.message().find("File too large") == std::string::npos) return 4;
    if (fs::exists(p) || has_temporary(dir_)) return 5;
    return 0;
  };
  EXPECT_EXIT(std::_Exit(child()), ::testing::ExitedWithCode(0), "");
}

TEST_F(SafetensorsTest, WriteRefusesInvalidUtf8) {
  const std::string p = path("utf8.safetensors");
  Status st = write_safetensors(p, {{"bad\xff", patterned(DType::kU8, {1}, 1)}});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  st = write_safetensors(p, {}, {{"k", "\xc3"}});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(SafetensorsTest, DuplicateNamesAreABug) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Tensor t = patterned(DType::kU8, {1}, 1);
  EXPECT_DEATH((void)write_safetensors(path("d.safetensors"), {{"a", t}, {"a", t}}), "given twice");
}

// ---- fuzzer findings and seeds -------------------------------------------------------------

// Inputs the fuzzer once crashed on, or that a fuzzer run kept: each must give a Status, and
// an accepted file's tensors must all be readable.
TEST(SafetensorsRegressions, ReplayWithoutCrashing) {
  const fs::path here = fs::path(wl::testing::beside_binary(WL_SOURCE_DIR)) / "tests" / "core";
  const fs::path seeds =
      fs::path(wl::testing::beside_binary(WL_SOURCE_DIR)) / "fuzz" / "corpus" / "safetensors";
  int n_seeds = 0;
  for (const auto& e : fs::directory_iterator(seeds)) {
    SCOPED_TRACE(e.path().string());
    auto f = SafetensorsFile::open(e.path().string());
    // The seeds written by hand (named *.safetensors) are valid files; what fuzzing runs kept
    // (named by their hash) need only give a Status.
    if (e.path().extension() == ".safetensors") {
      ASSERT_TRUE(f.ok()) << f.status().to_string();
      ++n_seeds;
    }
    if (f.ok()) {
      for (const TensorInfo& t : f->tensors()) EXPECT_TRUE(f->get(t.name).ok()) << t.name;
    }
  }
  EXPECT_GT(n_seeds, 0) << "no seed corpus at " << seeds;
  const fs::path regressions = here / "regressions";
  if (!fs::exists(regressions)) return;
  for (const auto& e : fs::directory_iterator(regressions)) {
    SCOPED_TRACE(e.path().string());
    auto f = parse(file_text(e.path().string()));
    if (!f.ok()) continue;
    for (const TensorInfo& t : f->tensors()) EXPECT_TRUE(f->get(t.name).ok());
  }
}

}  // namespace
}  // namespace wl
