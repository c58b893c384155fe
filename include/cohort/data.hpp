// cohort/data.hpp: feeding a distributed training loop (docs/data.md).
//
//   DistributedSampler  which dataset indices this rank visits in an epoch, exactly
//                       as torch.utils.data.DistributedSampler (PyTorch 1.13) yields them
//   Loader              assembles batches on a background thread, K batches ahead
//   read_idx            the IDX format of MNIST / Fashion-MNIST, plain or gzip'd
//   FashionMnist        the Fashion-MNIST train or test split as normalised floats
//
// Torch-free: batches are plain vectors with shapes; the LibTorch adapter wraps them.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>
#include "cohort/export.hpp"

namespace cohort::data {

// ---------------------------------------------------------------- sampler

struct COHORT_API SamplerOptions {
  int num_replicas = 1;    // world size: how many ranks share the dataset
  int rank = 0;            // this rank, 0 <= rank < num_replicas
  bool shuffle = true;     // permute with torch.randperm seeded with seed + epoch
  uint64_t seed = 0;       // must be the same on every rank; Python's negative seeds: static_cast<uint64_t>(s)
  bool drop_last = false;  // false: pad by repeating indices so all ranks get as many; true: drop the tail
};

// The permutation `g = torch.Generator(); g.manual_seed(seed); torch.randperm(n, generator=g)`
// yields in PyTorch 1.13 on the CPU (n >= 0; InvalidArgument otherwise).
COHORT_API std::vector<int64_t> torch_randperm(int64_t n, uint64_t seed);

// How many indices each rank gets: PyTorch's len(sampler) (its num_samples).
COHORT_API int64_t sampler_num_samples(int64_t dataset_size, const SamplerOptions& o);

// The indices rank o.rank visits in `epoch`: a pure function, the whole of
// DistributedSampler's logic. InvalidArgument for a negative dataset size,
// num_replicas < 1 or a rank outside [0, num_replicas).
COHORT_API std::vector<int64_t> sampler_indices(int64_t dataset_size, const SamplerOptions& o, int64_t epoch);

// Same contract as PyTorch's: call set_epoch(e) at the start of every epoch,
// with the same e on every rank, or every epoch sees the same order.
class COHORT_API DistributedSampler {
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

// ---------------------------------------------------------------- datasets

// A map-style dataset: random access by index. get() is called from the
// Loader's worker thread (one thread per Loader); a dataset shared by several
// live Loaders must make get() safe to call concurrently.
class COHORT_API Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  virtual std::vector<int64_t> sample_shape() const = 0;  // of one x, e.g. {1, 28, 28}
  virtual std::vector<int64_t> label_shape() const { return {}; }  // of one y; {} is a scalar label
  // Writes sample `index` (0 <= index < size()) to x_out (numel(sample_shape()) floats)
  // and y_out (numel(label_shape()) int64s). May throw; the Loader rethrows from next().
  virtual void get(int64_t index, float* x_out, int64_t* y_out) const = 0;
};

COHORT_API int64_t numel(const std::vector<int64_t>& shape);  // product of the dims (1 for {})

// ---------------------------------------------------------------- loader

// One batch, row-major: x has shape x_shape = {B, sample_shape...}, y has y_shape = {B, label_shape...}.
struct COHORT_API Batch {
  std::vector<float> x;
  std::vector<int64_t> x_shape;
  std::vector<int64_t> y;
  std::vector<int64_t> y_shape;
  std::vector<int64_t> indices;  // the dataset indices of the B samples, in order
  int64_t number = 0;            // 0, 1, 2, ... in the epoch
  int64_t size() const { return static_cast<int64_t>(indices.size()); }
};

// Fills `out` with the samples `indices` (x, y and their shapes; out.indices and
// out.number are set by the Loader). Runs on the Loader's worker thread.
using BatchFn = std::function<void(std::span<const int64_t> indices, Batch& out)>;

// Optional per-sample hook (augmentation): runs on the worker thread after
// Dataset::get, on that sample's x and y.
using SampleTransform = std::function<void(int64_t index, float* x, int64_t* y)>;

struct COHORT_API LoaderOptions {
  int64_t batch_size = 1;
  bool drop_last = false;  // drop a final batch shorter than batch_size (DataLoader's drop_last)
  int prefetch = 0;        // batches assembled ahead of next(); 0: COHORT_PREFETCH_BATCHES (default 2)
  std::chrono::milliseconds timeout{0};  // next()'s deadline; 0: COHORT_LOADER_TIMEOUT (default 300 s)
  SampleTransform transform;             // Dataset constructor only
};

// Assembles one epoch's batches, in the order of `indices` (usually a
// DistributedSampler's), on a background thread, so that the training thread
// only waits when the worker falls behind. At most `prefetch` finished batches
// wait in the queue; the worker blocks when it is full.
//
// Thread contract: next() from one thread at a time. The destructor stops the
// worker (after the batch it is assembling, if any) and drops queued batches.
// For the next epoch, make a new Loader with the sampler's new indices.
class COHORT_API Loader {
 public:
  // `dataset` must outlive the Loader. Indices are checked against dataset.size()
  // here (InvalidArgument), not on the worker.
  Loader(const Dataset& dataset, std::vector<int64_t> indices, LoaderOptions options = {});
  // A generic producer instead of a Dataset (options.transform is not used).
  Loader(BatchFn make_batch, std::vector<int64_t> indices, LoaderOptions options = {});
  ~Loader();
  Loader(Loader&&) noexcept;             // the worker keeps running; the moved-from Loader is empty
  Loader& operator=(Loader&&) noexcept;  // stops this Loader's worker first

  // The next batch, or nullopt after the last. Blocks until the worker has one;
  // TimeoutError past the deadline; an exception the worker hit (e.g. from
  // Dataset::get) is rethrown here once the batches before it are consumed, and
  // again on later calls.
  std::optional<Batch> next();
  int64_t num_batches() const;

 private:
  struct State;
  void start(BatchFn make_batch, std::vector<int64_t> indices, const LoaderOptions& options);
  std::unique_ptr<State> state_;
};

// ---------------------------------------------------------------- IDX files

// An IDX array (http://yann.lecun.com/exdb/mnist/ format: 00 00 <type> <ndims>,
// ndims big-endian u32 dims, then the elements). cohort reads u8 (type 0x08) only.
struct COHORT_API IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;  // numel(dims) bytes, row-major
};

// Reads an IDX file, gunzipping it first when it starts with 1f 8b. Every
// problem with the file (missing, unreadable, corrupt or truncated gzip, not
// IDX, not u8, shorter or longer than its header says) is an IoError that names
// the file and says what was found and what was expected.
COHORT_API IdxArray read_idx(const std::string& path);
// The same on bytes already in memory; `name` goes into messages.
COHORT_API IdxArray parse_idx(std::span<const uint8_t> bytes, const std::string& name);

// ---------------------------------------------------------------- Fashion-MNIST

struct COHORT_API FashionMnistOptions {
  std::string dir = "/usr/share/datasets/fashion-mnist";  // Debian's dataset-fashion-mnist
  bool train = true;        // train-* (60000 images) or t10k-* (10000)
  float mean = 0.2860f;     // x = (pixel / 255 - mean) / stddev; the train split's statistics
  float stddev = 0.3530f;
};

// Loads images and labels into memory: sample_shape {1, rows, cols}, scalar
// labels 0..9. Looks for <prefix>-images-idx3-ubyte[.gz] and
// <prefix>-labels-idx1-ubyte[.gz] (prefix train or t10k). IoError names the
// files and the fix when they are missing, damaged, or disagree (image and
// label counts, shapes, labels outside 0..9); InvalidArgument for stddev <= 0.
class COHORT_API FashionMnist : public Dataset {
 public:
  explicit FashionMnist(const FashionMnistOptions& options = {});

  int64_t size() const override { return static_cast<int64_t>(labels_.size()); }
  std::vector<int64_t> sample_shape() const override { return {1, rows_, cols_}; }
  void get(int64_t index, float* x_out, int64_t* y_out) const override;

  // The raw pixels, size() * rows * cols: 1 byte each in memory (get()
  // normalises the sample it copies), a quarter of what floats would take on
  // every rank.
  const std::vector<uint8_t>& pixels() const { return pixels_; }
  float normalised(uint8_t pixel) const { return normalised_[pixel]; }
  const std::vector<int64_t>& labels() const { return labels_; }
  static bool available(const std::string& dir = FashionMnistOptions{}.dir);  // all four files present

 private:
  int64_t rows_ = 0, cols_ = 0;
  std::vector<uint8_t> pixels_;
  std::array<float, 256> normalised_{};
  std::vector<int64_t> labels_;
};

}  // namespace cohort::data
