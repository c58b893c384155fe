// DistributedSampler: torch.utils.data.DistributedSampler (PyTorch 1.13), index for index.
//
// For a dataset of n samples shared by R replicas:
//
//   1. order: with shuffle, the permutation torch.randperm(n) draws from a CPU
//      generator seeded with seed + epoch; without, 0, 1, ..., n-1.
//   2. num_samples (per rank) = ceil(n / R), or floor(n / R) with drop_last
//      (PyTorch writes ceil((n - R) / R) for that case; for n % R != 0 it is the
//      same number). total = num_samples * R.
//   3. Without drop_last, order is padded to total by repeating it from the
//      start, as often as needed (padding can exceed n when n < R); with
//      drop_last it is cut to total.
//   4. Rank r takes positions r, r + R, r + 2R, ... of the padded order.
//
// Steps 3 and 4 together: rank r's j-th index is order[(r + j R) mod n].
//
// torch.randperm on the CPU (aten/src/ATen/native/TensorFactories.cpp,
// randperm_cpu, 1.13) is a forward Fisher-Yates shuffle with one 32-bit draw
// per step and a modulo reduction (slightly biased, and what Python yields):
//
//   perm = 0, 1, ..., n-1
//   for i in 0 .. n-2:  z = random() mod (n - i);  swap(perm[i], perm[i + z])
//
// 1.13 has no separate branch for large n: the same 32-bit draw is used for
// every n (so for n > 2^32 it could not reach every position; irrelevant at
// sizes that fit in memory as a permutation, and reproduced as is).
#include <numeric>

#include <fmt/format.h>

#include "cohort/data.hpp"
#include "cohort/error.hpp"
#include "data/torch_generator.hpp"

namespace cohort::data {
namespace {

void validate(int64_t dataset_size, const SamplerOptions& o) {
  if (o.num_replicas < 1)
    throw InvalidArgument(fmt::format(
        "DistributedSampler: num_replicas is {}; it must be at least 1 (the number of ranks that share the "
        "dataset, usually the group's size)",
        o.num_replicas));
  if (o.rank < 0 || o.rank >= o.num_replicas)
    throw InvalidArgument(fmt::format(
        "DistributedSampler: rank {} is out of range for num_replicas {}; set it to this process's rank in the "
        "group, 0 to {}",
        o.rank, o.num_replicas, o.num_replicas - 1));
  if (dataset_size < 0)
    throw InvalidArgument(fmt::format("DistributedSampler: dataset size is {}; it must be 0 or more", dataset_size));
}

}  // namespace

std::vector<int64_t> torch_randperm(int64_t n, uint64_t seed) {
  if (n < 0) throw InvalidArgument(fmt::format("torch_randperm: n is {}; it must be 0 or more", n));
  std::vector<int64_t> perm(static_cast<size_t>(n));
  std::iota(perm.begin(), perm.end(), int64_t{0});
  TorchCpuGenerator gen(seed);
  for (int64_t i = 0; i + 1 < n; ++i) {
    int64_t z = static_cast<int64_t>(gen.random()) % (n - i);
    std::swap(perm[i], perm[i + z]);
  }
  return perm;
}

int64_t sampler_num_samples(int64_t dataset_size, const SamplerOptions& o) {
  validate(dataset_size, o);
  const int64_t replicas = o.num_replicas;
  return o.drop_last ? dataset_size / replicas : (dataset_size + replicas - 1) / replicas;
}

std::vector<int64_t> sampler_indices(int64_t dataset_size, const SamplerOptions& o, int64_t epoch) {
  const int64_t num_samples = sampler_num_samples(dataset_size, o);
  std::vector<int64_t> out(static_cast<size_t>(num_samples));
  if (num_samples == 0) return out;  // also covers n == 0 (no modulo by zero below)

  const int64_t n = dataset_size, replicas = o.num_replicas;
  std::vector<int64_t> order;
  if (o.shuffle) order = torch_randperm(n, o.seed + static_cast<uint64_t>(epoch));  // wraps like torch's uint64 seed
  for (int64_t j = 0; j < num_samples; ++j) {
    const int64_t position = (o.rank + j * replicas) % n;
    out[j] = o.shuffle ? order[position] : position;
  }
  return out;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, SamplerOptions options)
    : dataset_size_(dataset_size), options_(options) {
  validate(dataset_size_, options_);
}

std::vector<int64_t> DistributedSampler::indices() const { return sampler_indices(dataset_size_, options_, epoch_); }

int64_t DistributedSampler::size() const { return sampler_num_samples(dataset_size_, options_); }

}  // namespace cohort::data
