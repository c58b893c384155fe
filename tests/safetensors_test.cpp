// safetensors writer and reader (src/checkpoint/safetensors_*.cpp), CRC32C and
// base64: round trips for every dtype and shape kind, the layout rules (header
// padding, alignment), every way the reader must reject a file, and the plain
// Python reader in tests/checkpoint/read_safetensors.py.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "checkpoint/base64.hpp"
#include "checkpoint/ckpt_test_util.hpp"
#include "checkpoint/crc32c.hpp"
#include "checkpoint/safetensors.hpp"
#include "cohort/checkpoint.hpp"
#include "test_deps.hpp"

using namespace cohort;
using namespace cohort::testing;

namespace cohort {
void PrintTo(DType t, std::ostream* os) { *os << dtype_name(t); }
}  // namespace cohort

namespace {

// ---- CRC32C and base64 ----------------------------------------------------

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  // RFC 3720 (iSCSI) appendix B.4.
  std::vector<uint8_t> zeros(32, 0), ones(32, 0xff), ascending(32);
  for (int i = 0; i < 32; ++i) ascending[i] = static_cast<uint8_t>(i);
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(crc32c(ascending.data(), 32), 0x46DD794Eu);
}

TEST(Crc32c, PortableAndHardwareAgreeAndContinue) {
  std::mt19937 rng(7);
  std::vector<uint8_t> data(5000);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  for (size_t start : {0, 1, 3, 7})
    for (size_t len : {0, 1, 7, 8, 9, 63, 64, 65, 4000}) {
      const uint8_t* p = data.data() + start;
      uint32_t portable = ckpt::crc32c_portable(p, len, 0);
      if (ckpt::crc32c_hardware_available()) {
        EXPECT_EQ(ckpt::crc32c_hardware(p, len, 0), portable) << start << "+" << len;
      }
      EXPECT_EQ(crc32c(p, len), portable);
      size_t cut = len / 3;
      EXPECT_EQ(crc32c(p + cut, len - cut, crc32c(p, cut)), portable) << "continuation at " << cut;
    }
}

TEST(Base64, Rfc4648VectorsAndBinary) {
  const std::pair<std::string, std::string> cases[] = {{"", ""},         {"f", "Zg=="},     {"fo", "Zm8="},
                                                       {"foo", "Zm9v"},  {"foob", "Zm9vYg=="}, {"fooba", "Zm9vYmE="},
                                                       {"foobar", "Zm9vYmFy"}};
  for (const auto& [plain, coded] : cases) {
    EXPECT_EQ(ckpt::base64_encode(plain), coded);
    EXPECT_EQ(ckpt::base64_decode(coded), plain);
  }
  std::string all;
  for (int i = 0; i < 256; ++i) all += static_cast<char>(i);
  EXPECT_EQ(ckpt::base64_decode(ckpt::base64_encode(all)), all);
  for (const char* bad : {"Zg=", "Z===", "Zm9v!A==", "=Zm9", "Zg==Zg=="}) EXPECT_FALSE(ckpt::base64_decode(bad)) << bad;
}

// ---- round trips ----------------------------------------------------------

const std::vector<std::vector<int64_t>> kShapes = {{}, {0}, {1}, {5}, {2, 3}, {2, 0, 4}, {3, 1, 2, 2}};

class SafetensorsRoundTrip : public ::testing::TestWithParam<DType> {};

TEST_P(SafetensorsRoundTrip, EveryShapeKindInMemoryAndOnDisk) {
  std::vector<NamedTensor> tensors;
  for (size_t i = 0; i < kShapes.size(); ++i)
    tensors.push_back(pattern_tensor(fmt::format("t{}", i), GetParam(), kShapes[i], static_cast<int>(i)));
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "ünïcode ok"}};
  std::vector<uint8_t> bytes = encode_safetensors(tensors, metadata);
  SafetensorsFile back = decode_safetensors(bytes);
  EXPECT_TRUE(same_tensors(tensors, back.tensors));
  EXPECT_EQ(back.metadata.at("note"), "ünïcode ok");

  TempDir dir;
  write_safetensors(dir / "x.safetensors", tensors, {.metadata = metadata});
  EXPECT_EQ(read_bytes(dir / "x.safetensors"), bytes) << "file and in-memory encodings differ";
  EXPECT_TRUE(same_tensors(tensors, read_safetensors(dir / "x.safetensors").tensors));
  EXPECT_FALSE(std::filesystem::exists(dir / fmt::format("x.safetensors.tmp-{}", ::getpid())));
}

INSTANTIATE_TEST_SUITE_P(EveryDType, SafetensorsRoundTrip, ::testing::ValuesIn(kEveryDType),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(Safetensors, MakeTensorFromTypedValues) {
  NamedTensor t = make_tensor<double>("x", {2, 2}, {1.5, -2.0, 0.25, 8.0});
  EXPECT_EQ(t.dtype, DType::F64);
  EXPECT_EQ(t.numel(), 4u);
  SafetensorsFile back = decode_safetensors(encode_safetensors({t, make_tensor<int32_t>("n", {}, {7})}));
  ASSERT_EQ(back.tensors.size(), 2u);
  double v[4];
  std::memcpy(v, back.tensors[0].bytes.data(), sizeof v);
  EXPECT_EQ(v[3], 8.0);
  EXPECT_EQ(back.tensors[1].name, "n");
  EXPECT_THROW(encode_safetensors({make_tensor<float>("short", {3}, {1.0f})}), InvalidArgument);
}

TEST(Safetensors, NoTensorsAndNoMetadata) {
  std::vector<uint8_t> bytes = encode_safetensors({}, {});
  EXPECT_EQ(bytes.size(), 16u);  // 8-byte length + "{}" padded to 8
  SafetensorsFile back = decode_safetensors(bytes);
  EXPECT_TRUE(back.tensors.empty());
  EXPECT_TRUE(back.metadata.empty());
}

TEST(Safetensors, HeaderPaddedWithSpacesAndTensorsAligned) {
  std::vector<NamedTensor> tensors;
  for (DType t : kEveryDType) tensors.push_back(pattern_tensor(fmt::format("w_{}", dtype_name(t)), t, {3}));
  tensors.push_back(pattern_tensor("odd", DType::U8, {5}));
  for (int extra = 0; extra < 8; ++extra) {  // vary the JSON length through every residue mod 8
    std::vector<uint8_t> bytes = encode_safetensors(tensors, {{"pad", std::string(extra, 'x')}});
    uint64_t n;
    std::memcpy(&n, bytes.data(), 8);
    ASSERT_EQ(n % 8, 0u);
    std::string header(bytes.begin() + 8, bytes.begin() + 8 + n);
    EXPECT_EQ(header.front(), '{');
    size_t close = header.find_last_of('}');
    EXPECT_EQ(header.find_first_not_of(' ', close + 1), std::string::npos) << "padding must be spaces";
    EXPECT_LT(header.size() - close - 1, 8u);
    // Each tensor's absolute file offset is a multiple of its element size.
    auto j = nlohmann::json::parse(header);
    for (const NamedTensor& t : tensors) {
      uint64_t begin = j[t.name]["data_offsets"][0];
      EXPECT_EQ((8 + n + begin) % dtype_size(t.dtype), 0u) << t.name;
    }
    EXPECT_TRUE(same_tensors(tensors, decode_safetensors(bytes).tensors));
  }
}

TEST(Safetensors, WriterRejectsBadTensors) {
  auto ok = pattern_tensor("a", DType::F32, {2});
  auto short_bytes = ok;
  short_bytes.bytes.pop_back();
  auto negative = ok;
  negative.shape = {-2};
  auto unnamed = ok;
  unnamed.name = "";
  auto reserved = ok;
  reserved.name = "__metadata__";
  const std::pair<std::vector<NamedTensor>, std::string> cases[] = {
      {{ok, ok}, "two tensors are named \"a\""},  {{short_bytes}, "needs 8 bytes but has 7"},
      {{negative}, "dimensions must be >= 0"},    {{unnamed}, "empty name"},
      {{reserved}, "reserved"}};
  TempDir dir;
  for (const auto& [tensors, want] : cases) {
    try {
      write_safetensors(dir / "bad.safetensors", tensors);
      ADD_FAILURE() << "no error for " << want;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "a rejected write left a file";
  }
}

// ---- the reader rejects every malformed file ------------------------------

struct BadFile {
  const char* what;
  std::vector<uint8_t> bytes;
  const char* expect;  // a piece of the error message
};

std::vector<BadFile> bad_files() {
  const std::string f32x2 = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string data8(8, '\0');
  auto one = [&](const std::string& entry, const std::string& data) { return raw_safetensors("{\"a\":" + entry + "}", data); };
  return {
      {"empty file", {}, "fewer than the 8-byte header length"},
      {"7 bytes", std::vector<uint8_t>(7, 0), "fewer than the 8-byte header length"},
      {"length past the end", raw_safetensors("{}", "", 100), "only 2 bytes follow"},
      {"huge length", raw_safetensors("{}", "", UINT64_MAX), "100 MiB limit"},
      {"1 TiB length", raw_safetensors("{}", "", uint64_t{1} << 40), "100 MiB limit"},
      {"not JSON", raw_safetensors("{\"a\": nope}", ""), "not valid JSON"},
      {"truncated JSON", raw_safetensors("{\"a\": {\"dtype\"", ""), "not valid JSON"},
      {"not an object", raw_safetensors("[1, 2]", ""), "does not start with '{'"},
      {"entry not object", raw_safetensors("{\"a\": 5}", ""), "must be an object"},
      {"no dtype", one(R"({"shape":[2],"data_offsets":[0,8]})", data8), "has no \"dtype\""},
      {"no shape", one(R"({"dtype":"F32","data_offsets":[0,8]})", data8), "has no \"shape\""},
      {"no offsets", one(R"({"dtype":"F32","shape":[2]})", data8), "has no \"data_offsets\""},
      {"unknown dtype", one(R"({"dtype":"BOOL","shape":[8],"data_offsets":[0,8]})", data8), "\"BOOL\", which cohort does not read"},
      {"dtype not string", one(R"({"dtype":4,"shape":[2],"data_offsets":[0,8]})", data8), "does not read"},
      {"negative dim", one(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})", data8), "non-negative integer"},
      {"float dim", one(R"({"dtype":"F32","shape":[2.0],"data_offsets":[0,8]})", data8), "non-negative integer"},
      {"3 offsets", one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8,8]})", data8), "must be [begin, end]"},
      {"end before begin", one(R"({"dtype":"F32","shape":[2],"data_offsets":[8,0]})", data8), "end before they begin"},
      {"size mismatch", one(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})", data8), "hold 8 bytes but shape [3] of F32 needs 12"},
      {"shape overflow", one(R"({"dtype":"F64","shape":[4611686018427387904,4],"data_offsets":[0,8]})", data8), "overflows 64 bits"},
      {"past the end", one(f32x2, std::string(4, '\0')), "run past the end of the data (4 bytes): the file is truncated"},
      {"overlap", raw_safetensors("{\"a\":" + f32x2 + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                  std::string(12, '\0')), "overlap"},
      {"hole", raw_safetensors(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                               std::string(12, '\0')), "the format allows no holes"},
      {"leading hole", one(R"({"dtype":"F32","shape":[1],"data_offsets":[4,8]})", data8), "the format allows no holes"},
      {"trailing bytes", one(f32x2, std::string(12, '\0')), "last 4 bytes of the file belong to no tensor"},
      {"duplicate tensor", raw_safetensors("{\"a\":" + f32x2 + ",\"a\":" + f32x2 + "}", data8), "the key \"a\" twice"},
      {"duplicate field", one(R"({"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]})", data8), "the key \"dtype\" twice"},
      {"metadata not object", raw_safetensors(R"({"__metadata__": [1]})", ""), "must be an object of strings"},
      {"metadata value", raw_safetensors(R"({"__metadata__": {"k": 1}})", ""), "must be a string"},
      {"deep nesting", raw_safetensors("{\"__metadata__\":" + std::string(40, '[') + std::string(40, ']') + "}", ""), "nests deeper"},
  };
}

TEST(SafetensorsReader, RejectsEveryMalformedFileNamingFileAndProblem) {
  TempDir dir;
  for (const BadFile& bad : bad_files()) {
    SCOPED_TRACE(bad.what);
    std::string path = dir / "bad.safetensors";
    write_bytes(path, bad.bytes);
    for (int via_disk = 0; via_disk < 2; ++via_disk) {
      try {
        if (via_disk)
          read_safetensors(path);
        else
          decode_safetensors(bad.bytes, path);
        ADD_FAILURE() << "accepted";
      } catch (const FormatError& e) {
        std::string msg = e.what();
        EXPECT_NE(msg.find(path), std::string::npos) << msg;
        EXPECT_NE(msg.find(bad.expect), std::string::npos) << msg;
      }
    }
  }
}

TEST(SafetensorsReader, RejectsEveryTruncation) {
  std::vector<NamedTensor> tensors = {pattern_tensor("w", DType::F32, {2, 3}), pattern_tensor("b", DType::BF16, {3}),
                                      pattern_tensor("e", DType::I64, {0})};
  std::vector<uint8_t> bytes = encode_safetensors(tensors);
  for (size_t len = 0; len < bytes.size(); ++len)
    EXPECT_THROW(decode_safetensors(std::span(bytes.data(), len)), FormatError) << "truncated to " << len;
}

TEST(SafetensorsReader, RandomDamageIsRejectedOrHarmless) {
  // Flip, overwrite, insert and cut bytes of a valid file at random (fixed seed):
  // the reader must either return tensors that are consistent or throw
  // FormatError; never anything else, never a crash (run under ASan too).
  std::vector<NamedTensor> tensors = {pattern_tensor("w", DType::F32, {3, 4}), pattern_tensor("s", DType::I64, {}),
                                      pattern_tensor("e", DType::F16, {0, 2}), pattern_tensor("b", DType::U8, {7})};
  const std::vector<uint8_t> good = encode_safetensors(tensors);
  std::mt19937 rng(12345);
  const char digits[] = "0123456789,[]{}\" -";
  int rejected = 0;
  for (int iter = 0; iter < 5000; ++iter) {
    std::vector<uint8_t> bad = good;
    for (int edits = 1 + static_cast<int>(rng() % 3); edits > 0; --edits) {
      size_t at = rng() % bad.size();
      switch (rng() % 4) {
        case 0: bad[at] ^= static_cast<uint8_t>(1u << (rng() % 8)); break;
        case 1: bad[at] = static_cast<uint8_t>(digits[rng() % (sizeof digits - 1)]); break;
        case 2: bad.insert(bad.begin() + static_cast<long>(at), static_cast<uint8_t>(digits[rng() % 10])); break;
        case 3: bad.resize(at); break;
      }
      if (bad.empty()) break;
    }
    try {
      SafetensorsFile f = decode_safetensors(bad);
      for (const NamedTensor& t : f.tensors) ASSERT_EQ(t.bytes.size(), t.numel() * dtype_size(t.dtype));
    } catch (const FormatError&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 4000);
}

// ---- the plain-Python reader ----------------------------------------------

std::string run(const std::string& cmd, int* status) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  *status = ::pclose(p);
  return out;
}

std::string reader_script() {
  return (std::filesystem::path(__FILE__).parent_path() / "checkpoint" / "read_safetensors.py").string();
}

TEST(SafetensorsPython, PlainPythonReadsEveryDType) {
  int status = 0;
  run("command -v python3 >/dev/null 2>&1", &status);
  if (status != 0) COHORT_MISSING_DEP("python3 not found");
  std::vector<NamedTensor> tensors;
  std::vector<std::string> expect;
  int seed = 0;
  for (DType t : kEveryDType)
    for (const auto& shape : {std::vector<int64_t>{}, std::vector<int64_t>{0}, std::vector<int64_t>{4, 5}}) {
      tensors.push_back(pattern_tensor(fmt::format("{}_{}d{}", dtype_name(t), shape.size(), seed), t, shape, seed));
      expect.push_back(fmt::format("{} {} [{}] {:.6f}", tensors.back().name, ckpt::safetensors_dtype_name(t),
                                   fmt::join(shape, ", "), pattern_sum(tensors.back(), seed)));
      ++seed;
    }
  std::sort(expect.begin(), expect.end());
  TempDir dir;
  write_safetensors(dir / "all.safetensors", tensors);
  std::string out = run(fmt::format("python3 '{}' '{}'", reader_script(), dir / "all.safetensors"), &status);
  ASSERT_EQ(status, 0) << out;
  EXPECT_EQ(out, fmt::format("{}\n", fmt::join(expect, "\n")));
}

}  // namespace
