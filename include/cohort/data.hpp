// cohort/data.hpp: feeding a distributed training loop (docs/data.md).
//
//   DistributedSampler  which dataset indices this rank visits in an epoch, exactly
//                       as torch.utils.data.DistributedSampler (PyTorch 1.13) yields them
//
// Torch-free: batches are plain vectors with shapes; the LibTorch adapter wraps them.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace cohort::data {

// ---------------------------------------------------------------- sampler

struct SamplerOptions {
  int num_replicas = 1;    // world size: how many ranks share the dataset
  int rank = 0;            // this rank, 0 <= rank < num_replicas
  bool shuffle = true;     // permute with torch.randperm seeded with seed + epoch
  uint64_t seed = 0;       // must be the same on every rank; Python's negative seeds: static_cast<uint64_t>(s)
  bool drop_last = false;  // false: pad by repeating indices so all ranks get as many; true: drop the tail
};

// The permutation `g = torch.Generator(); g.manual_seed(seed); torch.randperm(n, generator=g)`
// yields in PyTorch 1.13 on the CPU (n >= 0; InvalidArgument otherwise).
std::vector<int64_t> torch_randperm(int64_t n, uint64_t seed);

// How many indices each rank gets: PyTorch's len(sampler) (its num_samples).
int64_t sampler_num_samples(int64_t dataset_size, const SamplerOptions& o);

// The indices rank o.rank visits in `epoch`: a pure function, the whole of
// DistributedSampler's logic. InvalidArgument for a negative dataset size,
// num_replicas < 1 or a rank outside [0, num_replicas).
std::vector<int64_t> sampler_indices(int64_t dataset_size, const SamplerOptions& o, int64_t epoch);

// Same contract as PyTorch's: call set_epoch(e) at the start of every epoch,
// with the same e on every rank, or every epoch sees the same order.
class DistributedSampler {
 public:
  DistributedSampler(int64_t dataset_size, SamplerOptions options);  // validates (InvalidArgument)

  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }
  std::vector<int64_t> indices() const;  // this rank's indices for the current epoch
  int64_t size() const;                  // indices().size(), without computing them
  int64_t dataset_size() const { return dataset_size_; }
  const SamplerOptions& options() const { return options_; }

 private:
  int64_t dataset_size_;
  SamplerOptions options_;
  int64_t epoch_ = 0;
};

}  // namespace cohort::data
