// Fashion-MNIST (Xiao et al. 2017): 28x28 grey images of clothing in 10 classes,
// 60000 for training and 10000 for testing, as four IDX files. Debian's
// dataset-fashion-mnist installs them gzip'd in /usr/share/datasets/fashion-mnist.
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cohort/data.hpp"
#include "cohort/error.hpp"

namespace cohort::data {
namespace {

constexpr int kClasses = 10;

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// <dir>/<prefix>-<kind>-ubyte.gz, or the same without .gz.
std::string find_file(const std::string& dir, const std::string& stem) {
  for (const char* suffix : {".gz", ""}) {
    std::string path = fmt::format("{}/{}{}", dir, stem, suffix);
    if (exists(path)) return path;
  }
  if (!exists(dir))
    throw IoError(fmt::format("Fashion-MNIST: directory {} does not exist; install Debian's dataset-fashion-mnist "
                              "package (apt install dataset-fashion-mnist) or set FashionMnistOptions::dir to the "
                              "directory that holds the four IDX files",
                              dir));
  throw IoError(fmt::format("Fashion-MNIST: neither {0}/{1}.gz nor {0}/{1} exists; the directory must hold "
                            "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
                            "t10k-labels-idx1-ubyte (each may be gzip'd)",
                            dir, stem));
}

std::string file_stem(bool train, const char* kind) { return fmt::format("{}-{}-ubyte", train ? "train" : "t10k", kind); }

}  // namespace

FashionMnist::FashionMnist(const FashionMnistOptions& o) {
  if (!(o.stddev > 0))
    throw InvalidArgument(fmt::format("FashionMnist: stddev is {}; it must be positive (x = (pixel / 255 - mean) / "
                                      "stddev)",
                                      o.stddev));
  const std::string images_path = find_file(o.dir, file_stem(o.train, "images-idx3"));
  const std::string labels_path = find_file(o.dir, file_stem(o.train, "labels-idx1"));
  IdxArray images = read_idx(images_path);
  IdxArray labels = read_idx(labels_path);

  if (images.dims.size() != 3)
    throw IoError(fmt::format("{}: expected images with 3 dimensions (count x rows x cols), found {} ({}); is it "
                              "a labels file?",
                              images_path, images.dims.size(), fmt::join(images.dims, "x")));
  if (labels.dims.size() != 1)
    throw IoError(fmt::format("{}: expected labels with 1 dimension (count), found {} ({}); is it an images file?",
                              labels_path, labels.dims.size(), fmt::join(labels.dims, "x")));
  if (images.dims[0] != labels.dims[0])
    throw IoError(fmt::format("Fashion-MNIST: {} holds {} images but {} holds {} labels; the files are from "
                              "different splits or one is damaged: reinstall them",
                              images_path, images.dims[0], labels_path, labels.dims[0]));
  rows_ = images.dims[1];
  cols_ = images.dims[2];

  for (int p = 0; p < 256; ++p) normalised_[p] = (static_cast<float>(p) / 255.0f - o.mean) / o.stddev;
  pixels_ = std::move(images.data);

  labels_.resize(labels.data.size());
  for (size_t i = 0; i < labels.data.size(); ++i) {
    if (labels.data[i] >= kClasses)
      throw IoError(fmt::format("{}: label {} of sample {} is not a class 0..{}; the file is damaged: reinstall it",
                                labels_path, labels.data[i], i, kClasses - 1));
    labels_[i] = labels.data[i];
  }
}

void FashionMnist::get(int64_t index, float* x_out, int64_t* y_out) const {
  if (index < 0 || index >= size())
    throw InvalidArgument(fmt::format("FashionMnist::get: index {} is out of range for {} samples", index, size()));
  const int64_t pixels = rows_ * cols_;
  const uint8_t* from = pixels_.data() + index * pixels;
  for (int64_t i = 0; i < pixels; ++i) x_out[i] = normalised_[from[i]];
  *y_out = labels_[static_cast<size_t>(index)];
}

bool FashionMnist::available(const std::string& dir) {
  for (bool train : {true, false})
    for (const char* kind : {"images-idx3", "labels-idx1"}) {
      const std::string stem = fmt::format("{}/{}", dir, file_stem(train, kind));
      if (!exists(stem + ".gz") && !exists(stem)) return false;
    }
  return true;
}

}  // namespace cohort::data
