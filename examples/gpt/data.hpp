// The text the GPT example learns: the English fortunes of Debian's
// `fortunes` package (/usr/share/games/fortunes), read as bytes (the
// vocabulary is the 256 byte values), the first 90% for training and the last
// 10% for validation.
//
// Batches are windows of context + 1 bytes at offsets drawn from a generator
// seeded by (seed, step): every rank draws the same global batch and takes its
// data-parallel slice, so a job at any layout sees the tokens one process
// would see.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace gpt {

struct Corpus {
  torch::Tensor train, val;  // uint8 bytes
  std::vector<std::string> files;
};

// Every regular file in `dir` without a dot in its name (the .dat indexes and
// .u8 links are skipped), in name order, joined.
inline Corpus load_corpus(const std::string& dir, double val_fraction = 0.1) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw std::runtime_error("gpt: no text at " + dir + "; install it with: apt-get install fortunes (or pass --data DIR)");
  Corpus c;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (e.is_regular_file() && name.find('.') == std::string::npos) c.files.push_back(e.path().string());
  }
  std::sort(c.files.begin(), c.files.end());
  std::string text;
  for (const auto& f : c.files) {
    std::ifstream in(f, std::ios::binary);
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  if (text.size() < 10000)
    throw std::runtime_error("gpt: " + dir + " holds only " + std::to_string(text.size()) +
                             " bytes of text; install the fortunes package or point --data at a larger text");
  auto all = torch::from_blob(text.data(), {static_cast<int64_t>(text.size())}, torch::kUInt8).clone();
  const int64_t n_val = static_cast<int64_t>(static_cast<double>(all.size(0)) * val_fraction);
  c.train = all.narrow(0, 0, all.size(0) - n_val);
  c.val = all.narrow(0, all.size(0) - n_val, n_val);
  return c;
}

// Inputs and targets [count, context] for sequences [first, first + count) of
// the global batch of `step`.
inline std::pair<torch::Tensor, torch::Tensor> batch(const torch::Tensor& text, int64_t context, int64_t global,
                                                     uint64_t seed, int64_t step, int64_t first, int64_t count) {
  auto gen = at::detail::createCPUGenerator(seed * 7919ULL + static_cast<uint64_t>(step));
  const torch::Tensor starts = torch::randint(text.size(0) - context - 1, {global}, gen, torch::kLong);
  std::vector<torch::Tensor> rows;
  for (int64_t i = first; i < first + count; ++i) rows.push_back(text.narrow(0, starts[i].item<int64_t>(), context + 1));
  const torch::Tensor w = torch::stack(rows).to(torch::kLong);
  return {w.narrow(1, 0, context), w.narrow(1, 1, context)};
}

// The validation windows: `count` evenly spaced over the split, the same for
// every run; [first, first + n) of them.
inline std::pair<torch::Tensor, torch::Tensor> val_batch(const torch::Tensor& text, int64_t context, int64_t count,
                                                         int64_t first, int64_t n) {
  std::vector<torch::Tensor> rows;
  const int64_t stride = (text.size(0) - context - 1) / count;
  for (int64_t i = first; i < first + n; ++i) rows.push_back(text.narrow(0, i * stride, context + 1));
  const torch::Tensor w = torch::stack(rows).to(torch::kLong);
  return {w.narrow(1, 0, context), w.narrow(1, 1, context)};
}

}  // namespace gpt
