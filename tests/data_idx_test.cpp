// IDX reader on files the test writes (plain, gzip'd, damaged in every way the
// reader checks) and on the real Fashion-MNIST when it is installed.
#include <gtest/gtest.h>
#include <zlib.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "cohort/data.hpp"
#include "cohort/error.hpp"
#include "data/file_bytes.hpp"
#include "test_deps.hpp"

namespace cohort::data {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

Bytes idx_bytes(uint8_t type, const std::vector<uint32_t>& dims, const Bytes& data) {
  Bytes b = {0, 0, type, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims)
    for (int shift : {24, 16, 8, 0}) b.push_back(static_cast<uint8_t>(d >> shift));
  b.insert(b.end(), data.begin(), data.end());
  return b;
}

Bytes iota_bytes(size_t n) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(i * 7);
  return b;
}

Bytes gzip_bytes(const Bytes& raw, const fs::path& scratch) {
  gzFile f = gzopen(scratch.c_str(), "wb");
  EXPECT_NE(f, nullptr);
  EXPECT_EQ(gzwrite(f, raw.data(), static_cast<unsigned>(raw.size())), static_cast<int>(raw.size()));
  gzclose(f);
  std::ifstream in(scratch, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

class IdxFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("cohort_idx_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const Bytes& bytes) {
    fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return p.string();
  }
  Bytes gz(const Bytes& raw) { return gzip_bytes(raw, dir_ / "scratch.gz"); }

  // The IoError's message when reading `path` (fails the test if it does not throw one).
  static std::string error_of(const std::string& path) {
    try {
      read_idx(path);
    } catch (const IoError& e) {
      return e.what();
    }
    ADD_FAILURE() << "no IoError for " << path;
    return "";
  }

  fs::path dir_;
};

#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

TEST_F(IdxFiles, ReadsPlainAndGzippedU8) {
  const Bytes data = iota_bytes(3 * 4 * 5);
  const Bytes raw = idx_bytes(0x08, {3, 4, 5}, data);
  for (const std::string& path : {write("a-idx3-ubyte", raw), write("a-idx3-ubyte.gz", gz(raw)),
                                  write("gzip-without-suffix", gz(raw))}) {
    IdxArray a = read_idx(path);
    EXPECT_EQ(a.dims, (std::vector<int64_t>{3, 4, 5})) << path;
    EXPECT_EQ(a.data, data) << path;
  }
  IdxArray labels = read_idx(write("labels.gz", gz(idx_bytes(0x08, {4}, {9, 0, 3, 3}))));
  EXPECT_EQ(labels.dims, std::vector<int64_t>{4});
  EXPECT_EQ(labels.data, (Bytes{9, 0, 3, 3}));
  // Empty arrays are fine; parse_idx works on memory.
  EXPECT_TRUE(parse_idx(idx_bytes(0x08, {0, 28, 28}, {}), "mem").data.empty());
}

TEST_F(IdxFiles, ReadsConcatenatedGzipMembers) {
  const Bytes data = iota_bytes(1000);
  const Bytes raw = idx_bytes(0x08, {10, 100}, data);
  Bytes two = gz(Bytes(raw.begin(), raw.begin() + 300));
  Bytes second = gz(Bytes(raw.begin() + 300, raw.end()));
  two.insert(two.end(), second.begin(), second.end());
  two.insert(two.end(), 16, 0);  // zero padding after the last member is ignored
  EXPECT_EQ(read_idx(write("cat.gz", two)).data, data);
}

TEST_F(IdxFiles, MissingFileOrDirectory) {
  std::string missing = (dir_ / "nope-idx1-ubyte").string();
  std::string e = error_of(missing);
  EXPECT_HAS(e, "cannot open " + missing);
  EXPECT_HAS(e, "No such file or directory");
  EXPECT_HAS(error_of(dir_.string()), "it is a directory");
}

TEST_F(IdxFiles, TruncatedOrTooLongData) {
  const Bytes raw = idx_bytes(0x08, {2, 4, 6}, iota_bytes(48));
  std::string path = write("short", Bytes(raw.begin(), raw.begin() + 16 + 20));
  std::string e = error_of(path);
  EXPECT_HAS(e, path + ": expected 48 bytes of data after the 16-byte header (2x4x6 u8 elements), found 20");
  EXPECT_HAS(e, "truncated");

  Bytes longer = raw;
  longer.insert(longer.end(), {1, 2, 3});
  EXPECT_HAS(error_of(write("long", longer)), "found 51 (3 bytes too many)");

  // The same through gzip: the message says the size after decompression.
  std::string gz_path = write("short.gz", gz(Bytes(raw.begin(), raw.begin() + 30)));
  EXPECT_HAS(error_of(gz_path), gz_path + " (after gunzip): expected 48 bytes of data after the 16-byte header");

  // A header whose dims overflow 64 bits.
  EXPECT_HAS(error_of(write("huge", idx_bytes(0x08, {0xffffffff, 0xffffffff, 0xffffffff}, {}))),
             "expected more than 2^64 bytes");
}

TEST_F(IdxFiles, WrongFormat) {
  std::string png = write("image.png", {0x89, 'P', 'N', 'G', 0x0d, 0x0a, 0x1a, 0x0a});
  EXPECT_HAS(error_of(png), png + ": not an IDX file: it starts with 89 50 4e 47, expected 00 00 <type> <ndims>");
  EXPECT_HAS(error_of(write("tiny", {0, 0})), "it has 2 bytes, fewer than the 4-byte magic number");
  EXPECT_HAS(error_of(write("empty", {})), "it has 0 bytes");
  EXPECT_HAS(error_of(write("f32", idx_bytes(0x0d, {2}, Bytes(8)))),
             "IDX element type 0x0d (f32) is not supported; cohort reads u8 (0x08) IDX files only");
  EXPECT_HAS(error_of(write("weird", idx_bytes(0x42, {2}, Bytes(2)))), "element type byte is 0x42");
  EXPECT_HAS(error_of(write("nodims", idx_bytes(0x08, {}, {}))), "declares 0 dimensions");
  Bytes header_cut = idx_bytes(0x08, {60000, 28, 28}, {});
  header_cut.resize(10);
  EXPECT_HAS(error_of(write("header", header_cut)),
             "truncated IDX header: 3 dimensions need a 16-byte header, the file has 10 bytes");
  // gzip bytes handed to parse_idx (which does not gunzip) get a hint.
  try {
    parse_idx(gz(idx_bytes(0x08, {1}, {1})), "mem.gz");
    ADD_FAILURE();
  } catch (const IoError& e) {
    EXPECT_HAS(std::string(e.what()), "these bytes are gzip data: read the file with read_idx");
  }
}

TEST_F(IdxFiles, DamagedGzip) {
  const Bytes raw = idx_bytes(0x08, {50, 20}, iota_bytes(1000));
  const Bytes good = gz(raw);

  std::string cut = write("cut.gz", Bytes(good.begin(), good.begin() + good.size() / 2));
  std::string e = error_of(cut);
  EXPECT_HAS(e, cut + ": the gzip stream ends early");
  EXPECT_HAS(e, "the file is truncated or damaged");

  Bytes bad_crc = good;
  bad_crc[bad_crc.size() - 6] ^= 0xff;  // inside the CRC-32 trailer
  std::string crc = write("crc.gz", bad_crc);
  EXPECT_HAS(error_of(crc), crc + ": gzip data is corrupt (incorrect data check)");

  Bytes trailing = good;
  trailing.insert(trailing.end(), {'j', 'u', 'n', 'k'});
  EXPECT_HAS(error_of(write("trailing.gz", trailing)),
             "4 bytes that are not gzip data follow the gzip stream");
}

TEST_F(IdxFiles, GzipThatExpandsPastItsHeaderStopsThere) {
  // 3x2x2 declared, then 64 MiB of zeros: about 64 KiB compressed. The reader
  // stops one byte past the declared 28 bytes instead of inflating it all.
  Bytes raw = idx_bytes(0x08, {3, 2, 2}, iota_bytes(12));
  raw.resize(raw.size() + (size_t{64} << 20));
  const std::string path = write("bomb.gz", gz(raw));
  EXPECT_HAS(error_of(path), path + " (after gunzip): the data goes on past the 28 bytes its header declares "
                                    "(16-byte header + 3x2x2 u8 elements)");

  bool cut = false;
  const Bytes head = gunzip(gz(raw), "mem.gz", 100, &cut);
  EXPECT_EQ(head.size(), 100u);
  EXPECT_TRUE(cut);
  EXPECT_EQ(Bytes(head.begin(), head.begin() + 28), Bytes(raw.begin(), raw.begin() + 28));
  const Bytes whole = gunzip(gz(Bytes(raw.begin(), raw.begin() + 28)), "mem.gz", 29, &cut);
  EXPECT_EQ(whole.size(), 28u);
  EXPECT_FALSE(cut);
}

TEST_F(IdxFiles, GzipInsideGzipIsNamed) {
  const std::string path = write("twice.gz", gz(gz(idx_bytes(0x08, {4}, iota_bytes(4)))));
  EXPECT_HAS(error_of(path), "these bytes are gzip data again: the file was compressed twice");
}

TEST_F(IdxFiles, ReadKeepsNoSpareCapacity) {
  // The file is sized by fstat and end of file found by a small probe read: the
  // buffer (moved into IdxArray::data for plain files) is not twice the file.
  const Bytes raw = idx_bytes(0x08, {1000, 10}, iota_bytes(10000));
  const Bytes bytes = read_file_bytes(write("plain", raw));
  EXPECT_EQ(bytes, raw);
  EXPECT_EQ(bytes.capacity(), bytes.size());
}

// ---------------------------------------------------------------- Fashion-MNIST

class FashionMnistFiles : public IdxFiles {
 protected:
  void write_split(const std::string& prefix, uint32_t images, uint32_t labels, const Bytes& pixels,
                   const Bytes& label_values) {
    write(prefix + "-images-idx3-ubyte.gz", gz(idx_bytes(0x08, {images, 2, 3}, pixels)));
    write(prefix + "-labels-idx1-ubyte", idx_bytes(0x08, {labels}, label_values));  // plain works too
  }
};

TEST_F(FashionMnistFiles, LoadsAndNormalises) {
  Bytes pixels = {0, 255, 51, 102, 0, 0, /* second image */ 255, 255, 255, 0, 0, 0};
  write_split("t10k", 2, 2, pixels, {7, 2});
  FashionMnist ds({.dir = dir_.string(), .train = false, .mean = 0.5f, .stddev = 0.25f});
  ASSERT_EQ(ds.size(), 2);
  EXPECT_EQ(ds.sample_shape(), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(ds.labels(), (std::vector<int64_t>{7, 2}));
  float x[6];
  int64_t y = -1;
  ds.get(0, x, &y);
  EXPECT_EQ(y, 7);
  for (int i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(x[i], (pixels[i] / 255.0f - 0.5f) / 0.25f) << i;
  EXPECT_THROW(ds.get(2, x, &y), InvalidArgument);
  EXPECT_FALSE(FashionMnist::available(dir_.string()));  // no train split here
}

TEST_F(FashionMnistFiles, CountsMustMatch) {
  write_split("train", 2, 3, Bytes(12), {1, 2, 3});
  try {
    FashionMnist ds({.dir = dir_.string()});
    ADD_FAILURE();
  } catch (const IoError& e) {
    EXPECT_HAS(std::string(e.what()), "holds 2 images but");
    EXPECT_HAS(std::string(e.what()), "train-labels-idx1-ubyte holds 3 labels");
  }
  write_split("t10k", 1, 1, Bytes(6), {10});
  try {
    FashionMnist ds({.dir = dir_.string(), .train = false});
    ADD_FAILURE();
  } catch (const IoError& e) {
    EXPECT_HAS(std::string(e.what()), "label 10 of sample 0 is not a class 0..9");
  }
}

TEST_F(FashionMnistFiles, MissingFilesSayHowToGetThem) {
  try {
    FashionMnist ds({.dir = (dir_ / "absent").string()});
    ADD_FAILURE();
  } catch (const IoError& e) {
    EXPECT_HAS(std::string(e.what()), "does not exist; install Debian's dataset-fashion-mnist package");
  }
  try {
    FashionMnist ds({.dir = dir_.string()});
    ADD_FAILURE();
  } catch (const IoError& e) {
    EXPECT_HAS(std::string(e.what()), "train-images-idx3-ubyte.gz nor");
  }
  EXPECT_THROW(FashionMnist({.dir = dir_.string(), .stddev = 0}), InvalidArgument);
}

TEST(RealFashionMnist, SplitsHaveTheirKnownShapes) {
  const std::string dir = FashionMnistOptions{}.dir;
  if (!FashionMnist::available(dir)) COHORT_MISSING_DEP(dir << " is missing: apt install dataset-fashion-mnist");
  IdxArray images = read_idx(dir + "/train-images-idx3-ubyte.gz");
  EXPECT_EQ(images.dims, (std::vector<int64_t>{60000, 28, 28}));
  EXPECT_EQ(images.data.size(), 47040000u);
  EXPECT_EQ(read_idx(dir + "/t10k-images-idx3-ubyte.gz").dims, (std::vector<int64_t>{10000, 28, 28}));

  for (bool train : {true, false}) {
    FashionMnist ds({.train = train});
    const int64_t n = train ? 60000 : 10000;
    ASSERT_EQ(ds.size(), n);
    EXPECT_EQ(ds.sample_shape(), (std::vector<int64_t>{1, 28, 28}));
    std::vector<int64_t> per_class(10);
    for (int64_t y : ds.labels()) ++per_class.at(static_cast<size_t>(y));
    for (int64_t c : per_class) EXPECT_EQ(c, n / 10);  // Fashion-MNIST is balanced
    if (train) {  // the default mean / stddev are the train split's: it normalises to about 0 / 1
      double sum = 0, sq = 0;
      for (uint8_t p : ds.pixels()) sum += ds.normalised(p), sq += double(ds.normalised(p)) * ds.normalised(p);
      const double mean = sum / ds.pixels().size(), var = sq / ds.pixels().size() - mean * mean;
      EXPECT_NEAR(mean, 0.0, 0.01);
      EXPECT_NEAR(std::sqrt(var), 1.0, 0.01);
    }
  }
}

}  // namespace
}  // namespace cohort::data
