// Loader: one epoch's batches, assembled on a background thread.
//
// Why a thread: copying samples into a batch (and any per-sample transform)
// is work the training thread would otherwise do between steps, while the
// accelerator or the allreduce waits. One worker per Loader walks the index
// list in batch_size slices, in order, and pushes finished batches into a
// queue of at most `prefetch` batches; next() pops them. The worker waits for
// room before it starts a batch, so memory stays at prefetch + 1 batches (the
// queue and the one the caller holds).
//
// Failure: an exception in the worker (the dataset's get(), a transform, a
// malformed batch) ends the worker; next() hands out the batches finished
// before it, then rethrows it, unchanged. Every wait has a deadline
// (LoaderOptions::timeout / COHORT_LOADER_TIMEOUT). The destructor asks the
// worker to stop and joins it: the worker checks between batches, so a
// destructor waits at most for the batch being assembled.
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cohort/data.hpp"
#include "cohort/error.hpp"
#include "core/env.hpp"

namespace cohort::data {
namespace {

const core::Knob kPrefetch{"COHORT_PREFETCH_BATCHES", "2",
                           "batches a data Loader assembles ahead of the training loop on its background thread",
                           core::KnobKind::Int};
const core::Knob kLoaderTimeout{"COHORT_LOADER_TIMEOUT", "300s",
                                "how long a data Loader's next() waits for its worker to finish a batch",
                                core::KnobKind::Seconds};

size_t prefetch_depth(const LoaderOptions& o) {
  if (o.prefetch < 0)
    throw InvalidArgument(fmt::format("Loader: prefetch is {}; use 1 or more, or 0 for COHORT_PREFETCH_BATCHES", o.prefetch));
  if (o.prefetch > 0) return static_cast<size_t>(o.prefetch);
  const int64_t k = kPrefetch.integer();
  if (k < 1) throw InvalidArgument(fmt::format("COHORT_PREFETCH_BATCHES={} must be at least 1 (default 2)", k));
  return static_cast<size_t>(k);
}

std::chrono::milliseconds next_timeout(const LoaderOptions& o) {
  if (o.timeout.count() < 0)
    throw InvalidArgument(fmt::format("Loader: timeout is {} ms; use a positive value, or 0 for COHORT_LOADER_TIMEOUT",
                                      o.timeout.count()));
  if (o.timeout.count() > 0) return std::min(o.timeout, core::kLongestWait);  // milliseconds::max(): "forever"
  const std::chrono::milliseconds t = kLoaderTimeout.millis();
  if (t.count() == 0)
    throw InvalidArgument(fmt::format("COHORT_LOADER_TIMEOUT={} would time out every batch; use a positive duration "
                                      "such as 300s (the default), or a very large one to wait as long as it takes",
                                      kLoaderTimeout.str()));
  return t;
}

// A malformed batch from a user's BatchFn would surface far away (a wrong
// tensor shape in the model); say so at the source instead.
void check_batch(const Batch& b, int64_t expected_rows) {
  auto bad = [&](const char* what, const std::vector<int64_t>& shape, size_t size) {
    return InvalidArgument(fmt::format("Loader: batch {} has {} shape [{}] but {} {} values (expected shape[0] = {} "
                                       "rows and size = product of the shape); fix the BatchFn",
                                       b.number, what, fmt::join(shape, ", "), size, what, expected_rows));
  };
  if (b.x_shape.empty() || b.x_shape[0] != expected_rows || numel(b.x_shape) != static_cast<int64_t>(b.x.size()))
    throw bad("x", b.x_shape, b.x.size());
  if (b.y_shape.empty() || b.y_shape[0] != expected_rows || numel(b.y_shape) != static_cast<int64_t>(b.y.size()))
    throw bad("y", b.y_shape, b.y.size());
}

BatchFn dataset_batch_fn(const Dataset& dataset, SampleTransform transform) {
  std::vector<int64_t> sample_shape = dataset.sample_shape(), label_shape = dataset.label_shape();
  return [&dataset, transform = std::move(transform), sample_shape, label_shape](std::span<const int64_t> indices,
                                                                                  Batch& out) {
    const int64_t rows = static_cast<int64_t>(indices.size());
    const int64_t x_numel = numel(sample_shape), y_numel = numel(label_shape);
    out.x.resize(static_cast<size_t>(rows * x_numel));
    out.y.resize(static_cast<size_t>(rows * y_numel));
    out.x_shape = {rows};
    out.x_shape.insert(out.x_shape.end(), sample_shape.begin(), sample_shape.end());
    out.y_shape = {rows};
    out.y_shape.insert(out.y_shape.end(), label_shape.begin(), label_shape.end());
    for (int64_t i = 0; i < rows; ++i) {
      float* x = out.x.data() + i * x_numel;
      int64_t* y = out.y.data() + i * y_numel;
      dataset.get(indices[i], x, y);
      if (transform) transform(indices[i], x, y);
    }
  };
}

}  // namespace

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

struct Loader::State {
  BatchFn make_batch;
  std::vector<int64_t> indices;
  int64_t batch_size = 1;
  int64_t num_batches = 0;
  size_t capacity = 2;
  std::chrono::milliseconds timeout{0};

  std::mutex mu;
  std::condition_variable batch_ready;  // worker -> next(): a batch, the end, or an error
  std::condition_variable room;         // next() / destructor -> worker: space in the queue, or stop
  std::deque<Batch> queue;              // guarded by mu, as are the three below
  int64_t consumed = 0;
  bool finished = false;                // the worker produced every batch, or failed
  bool stop = false;                    // the destructor asks the worker to quit
  std::exception_ptr error;
  std::thread worker;

  ~State() { stop_worker(); }
  void run();
  void stop_worker();
};

void Loader::State::stop_worker() {
  if (!worker.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
  }
  room.notify_all();
  worker.join();
}

void Loader::State::run() {
  for (int64_t b = 0; b < num_batches; ++b) {
    {
      std::unique_lock<std::mutex> lock(mu);
      room.wait(lock, [&] { return stop || queue.size() < capacity; });
      if (stop) return;
    }
    Batch batch;
    batch.number = b;
    const int64_t begin = b * batch_size;
    const int64_t end = std::min<int64_t>(begin + batch_size, static_cast<int64_t>(indices.size()));
    batch.indices.assign(indices.begin() + begin, indices.begin() + end);
    try {
      make_batch(std::span<const int64_t>(batch.indices), batch);
      check_batch(batch, end - begin);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      error = std::current_exception();
      finished = true;
      batch_ready.notify_all();
      return;
    }
    std::lock_guard<std::mutex> lock(mu);
    queue.push_back(std::move(batch));
    batch_ready.notify_all();
  }
  std::lock_guard<std::mutex> lock(mu);
  finished = true;
  batch_ready.notify_all();
}

Loader::Loader(const Dataset& dataset, std::vector<int64_t> indices, LoaderOptions options) {
  const int64_t n = dataset.size();  // checked here, on the caller's thread, not mid-epoch on the worker
  for (size_t i = 0; i < indices.size(); ++i)
    if (indices[i] < 0 || indices[i] >= n)
      throw InvalidArgument(fmt::format("Loader: index {} (at position {}) is out of range for a dataset of {} "
                                        "samples; were the indices made for another dataset (check the "
                                        "DistributedSampler's dataset_size)?",
                                        indices[i], i, n));
  BatchFn make_batch = dataset_batch_fn(dataset, options.transform);
  start(std::move(make_batch), std::move(indices), options);
}

Loader::Loader(BatchFn make_batch, std::vector<int64_t> indices, LoaderOptions options) {
  start(std::move(make_batch), std::move(indices), options);
}

void Loader::start(BatchFn make_batch, std::vector<int64_t> indices, const LoaderOptions& options) {
  if (options.batch_size < 1)
    throw InvalidArgument(fmt::format("Loader: batch_size is {}; it must be at least 1", options.batch_size));
  if (!make_batch) throw InvalidArgument("Loader: the BatchFn is empty; pass a function that fills a Batch");
  state_ = std::make_unique<State>();
  State& s = *state_;
  s.make_batch = std::move(make_batch);
  s.indices = std::move(indices);
  s.batch_size = options.batch_size;
  const int64_t n = static_cast<int64_t>(s.indices.size());
  s.num_batches = options.drop_last ? n / s.batch_size : (n + s.batch_size - 1) / s.batch_size;
  s.capacity = prefetch_depth(options);
  s.timeout = next_timeout(options);
  s.worker = std::thread([&s] { s.run(); });
}

Loader::~Loader() = default;  // State's destructor stops and joins the worker
Loader::Loader(Loader&&) noexcept = default;
Loader& Loader::operator=(Loader&&) noexcept = default;

std::optional<Batch> Loader::next() {
  if (!state_) throw InvalidArgument("Loader::next: this Loader was moved from; use the one it was moved to");
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  const bool ready = s.batch_ready.wait_for(lock, s.timeout, [&] { return !s.queue.empty() || s.finished; });
  if (!ready)
    throw TimeoutError(fmt::format("Loader::next: batch {} of {} was not ready after {:g} s; the dataset's get() "
                                   "(or the BatchFn) is slow or stuck on the loader's worker thread; make it faster "
                                   "or raise LoaderOptions::timeout / COHORT_LOADER_TIMEOUT",
                                   s.consumed, s.num_batches, s.timeout.count() / 1000.0));
  if (!s.queue.empty()) {
    Batch batch = std::move(s.queue.front());
    s.queue.pop_front();
    ++s.consumed;
    lock.unlock();
    s.room.notify_one();
    return batch;
  }
  if (s.error) std::rethrow_exception(s.error);
  return std::nullopt;
}

int64_t Loader::num_batches() const { return state_ ? state_->num_batches : 0; }

}  // namespace cohort::data
