// Pipeline parallelism: the schedules as lists of actions, and the runner
// that executes one list per rank (cohort/torch_pipeline.hpp,
// docs/parallelism.md).
#include "cohort/torch_pipeline.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "cohort/timeline.hpp"
#include "device.hpp"

namespace cohort::torch::pp {

using ::torch::Tensor;

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::GPipe: return "gpipe";
    case Schedule::OneFOneB: return "1f1b";
    case Schedule::Interleaved: return "interleaved";
  }
  return "?";
}

Schedule parse_schedule(const std::string& name) {
  for (Schedule s : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved})
    if (name == schedule_name(s)) return s;
  throw InvalidArgument(fmt::format("unknown pipeline schedule \"{}\"; use gpipe, 1f1b or interleaved", name));
}

namespace {

void check_counts(Schedule s, int stage, int stages, int micro, int chunks) {
  if (stages < 1 || stage < 0 || stage >= stages)
    throw InvalidArgument(fmt::format("pipeline: stage {} of {} is out of range", stage, stages));
  if (micro < 1) throw InvalidArgument(fmt::format("pipeline: {} micro-batches; a step needs at least 1", micro));
  if (s != Schedule::Interleaved && chunks != 1)
    throw InvalidArgument(fmt::format("pipeline: {} chunks per rank need the interleaved schedule ({} runs 1)", chunks,
                                      schedule_name(s)));
  if (s == Schedule::Interleaved) {
    if (chunks < 2)
      throw InvalidArgument(fmt::format("pipeline: the interleaved schedule needs at least 2 chunks per rank, got {}; "
                                        "with one, use 1f1b",
                                        chunks));
    if (stages < 2) throw InvalidArgument("pipeline: the interleaved schedule needs at least 2 stages");
    if (micro % stages != 0)
      throw InvalidArgument(fmt::format("pipeline: the interleaved schedule runs micro-batches in groups of the stage "
                                        "count: {} micro-batches do not divide by {} stages",
                                        micro, stages));
  }
}

// The k-th forward (backward) of the interleaved schedule on any rank: groups
// of p micro-batches go through chunk 0, then the same group through chunk 1,
// ...; backwards walk the chunks in reverse.
Action interleaved_action(Action::Kind kind, int k, int stages, int chunks) {
  const int group = k / stages;
  int chunk = group % chunks;
  if (kind == Action::Backward) chunk = chunks - 1 - chunk;
  return {kind, (group / chunks) * stages + k % stages, chunk};
}

}  // namespace

std::vector<Action> schedule_actions(Schedule s, int stage, int stages, int micro, int chunks) {
  check_counts(s, stage, stages, micro, chunks);
  std::vector<Action> out;
  if (s == Schedule::GPipe) {
    for (int m = 0; m < micro; ++m) out.push_back({Action::Forward, m, 0});
    for (int m = 0; m < micro; ++m) out.push_back({Action::Backward, m, 0});
    return out;
  }
  // 1F1B over `total` (micro, chunk) pairs: warm-up forwards, then one
  // forward and one backward in turn, then the remaining backwards.
  const int total = micro * chunks;
  int warmup = s == Schedule::OneFOneB ? stages - stage - 1 : (stages - stage - 1) * 2 + (chunks - 1) * stages;
  warmup = std::min(warmup, total);
  auto fwd = [&](int k) {
    return s == Schedule::OneFOneB ? Action{Action::Forward, k, 0} : interleaved_action(Action::Forward, k, stages, chunks);
  };
  auto bwd = [&](int k) {
    return s == Schedule::OneFOneB ? Action{Action::Backward, k, 0}
                                   : interleaved_action(Action::Backward, k, stages, chunks);
  };
  for (int k = 0; k < warmup; ++k) out.push_back(fwd(k));
  for (int k = 0; k < total - warmup; ++k) {
    out.push_back(fwd(warmup + k));
    out.push_back(bwd(k));
  }
  for (int k = total - warmup; k < total; ++k) out.push_back(bwd(k));
  return out;
}

int peak_in_flight(const std::vector<Action>& actions) {
  int now = 0, peak = 0;
  for (const Action& a : actions) {
    now += a.kind == Action::Forward ? 1 : -1;
    peak = std::max(peak, now);
  }
  return peak;
}

std::vector<std::pair<int64_t, int64_t>> stage_ranges(int64_t layers, int64_t stages,
                                                      const std::vector<int64_t>& balance) {
  if (stages < 1) throw InvalidArgument(fmt::format("pipeline: {} stages; a pipeline needs at least 1", stages));
  std::vector<int64_t> counts = balance;
  if (counts.empty()) {
    for (int64_t s = 0; s < stages; ++s) counts.push_back(layers / stages + (s < layers % stages ? 1 : 0));
  } else {
    if (static_cast<int64_t>(counts.size()) != stages)
      throw InvalidArgument(fmt::format("pipeline: the balance gives {} stages' layer counts for {} stages",
                                        counts.size(), stages));
    int64_t sum = 0;
    for (int64_t c : counts) sum += c;
    if (sum != layers)
      throw InvalidArgument(fmt::format("pipeline: the balance [{}] adds up to {} layers, but the model has {}",
                                        fmt::join(counts, ", "), sum, layers));
  }
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t at = 0;
  for (int64_t s = 0; s < stages; ++s) {
    if (counts[s] < 1)
      throw InvalidArgument(fmt::format("pipeline: {} layers over {} stages leave stage {} without a layer; use fewer "
                                        "stages (or chunks), more layers, or a balance that gives every stage one",
                                        layers, stages, s));
    out.emplace_back(at, at + counts[s]);
    at += counts[s];
  }
  return out;
}

std::vector<::torch::nn::Sequential> split_sequential(const ::torch::nn::Sequential& model, int stage, int stages,
                                                      int chunks, const std::vector<int64_t>& balance) {
  if (stage < 0 || stage >= stages || chunks < 1)
    throw InvalidArgument(fmt::format("split_sequential: stage {} of {} with {} chunks is out of range", stage, stages, chunks));
  const auto children = model->named_children();
  const auto ranges = stage_ranges(static_cast<int64_t>(children.size()), int64_t{stages} * chunks, balance);
  std::vector<::torch::nn::Sequential> out;
  for (int c = 0; c < chunks; ++c) {
    ::torch::nn::Sequential chunk;
    const auto [first, last] = ranges[static_cast<size_t>(c) * stages + stage];
    // AnyModule copies share the module: the chunk holds the model's own layers.
    for (int64_t i = first; i < last; ++i) chunk->push_back(children[i].key(), *(model->begin() + i));
    out.push_back(chunk);
  }
  return out;
}

double PipelineStats::bubble() const {
  if (step_s <= 0) return 0;
  double busy = 0;
  for (const auto& t : actions) busy += t.end_s - t.start_s;
  return std::max(0.0, 1.0 - busy / step_s);
}

namespace {

// What each stage says about the pipeline it runs.
struct Claim {
  int64_t schedule, micro, chunks, dtype, rank_count;
  int64_t shape[8];
};

std::string claim_text(const Claim& c) {
  std::string shape;
  for (int64_t i = 0; i < std::min<int64_t>(c.rank_count, 8); ++i) shape += (i ? ", " : "") + std::to_string(c.shape[i]);
  return fmt::format("{} schedule, {} micro-batches, {} chunks, activation [{}] of {}",
                     schedule_name(static_cast<Schedule>(c.schedule)), c.micro, c.chunks, shape,
                     c10::toString(static_cast<::torch::ScalarType>(c.dtype)));
}

// Every stage tells every other its options before any of them checks its
// own: options one stage cannot run then fail on every stage (by the
// comparison, or by the same local check everywhere), never leaving the
// others waiting in a collective.
void check_same_everywhere(ProcessGroup& pp, const PipelineOptions& o) {
  Claim mine{static_cast<int64_t>(o.schedule), o.micro_batches, o.chunks, static_cast<int64_t>(o.dtype),
             static_cast<int64_t>(o.activation.size()), {}};
  std::copy_n(o.activation.begin(), std::min<size_t>(o.activation.size(), 8), mine.shape);
  std::vector<Claim> all(pp.size());
  const size_t n = sizeof(Claim) / sizeof(int64_t);
  host_collective(pp, {Buffer{&mine, n, DType::I64}, Buffer{all.data(), n * all.size(), DType::I64}},
                  [&](const std::vector<Buffer>& b) { return pp.allgather(b[0], b[1]); });
  for (int r = 1; r < pp.size(); ++r)
    if (std::memcmp(&all[r], &all[0], sizeof(Claim)) != 0)
      throw InvalidArgument(fmt::format("pipeline: stage 0 runs {} but stage {} runs {}; every stage must run the same "
                                        "schedule, micro-batch count, chunk count and activation shape",
                                        claim_text(all[0]), r, claim_text(all[r])));
  if (o.activation.size() > 8)
    throw InvalidArgument(fmt::format("pipeline: activations of {} dimensions; at most 8", o.activation.size()));
  if (o.activation.empty() && pp.size() > 1)
    throw InvalidArgument("pipeline: PipelineOptions::activation is empty; give the shape of the tensor each stage "
                          "sends to the next (e.g. {micro_batch, tokens, width})");
}

// Seconds on the steady clock (one clock for every process of a host).
double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

Pipeline::Pipeline(std::shared_ptr<ProcessGroup> pp, std::vector<ChunkForward> chunks, PipelineOptions opts)
    : pp_(std::move(pp)), chunks_(std::move(chunks)), opts_(std::move(opts)) {
  if (!pp_) throw InvalidArgument("Pipeline: the group is null (pass Mesh::group_ptr(MeshDim::pp))");
  check_same_everywhere(*pp_, opts_);
  if (static_cast<int>(chunks_.size()) != opts_.chunks)
    throw InvalidArgument(fmt::format("Pipeline: {} chunk functions for PipelineOptions::chunks = {}", chunks_.size(),
                                      opts_.chunks));
  if (!opts_.ddp.empty() && opts_.ddp.size() != chunks_.size())
    throw InvalidArgument(fmt::format("Pipeline: {} DistributedDataParallel for {} chunks; give one per chunk or none",
                                      opts_.ddp.size(), chunks_.size()));
  check_counts(opts_.schedule, pp_->rank(), pp_->size(), opts_.micro_batches, opts_.chunks);
  actions_ = schedule_actions(opts_.schedule, pp_->rank(), pp_->size(), opts_.micro_batches, opts_.chunks);
  last_backward_.assign(opts_.chunks, -1);
  for (const Action& a : actions_)
    if (a.kind == Action::Backward) last_backward_[a.chunk] = a.micro;
  // One group per link and direction, created in the same order on every
  // stage: a send waits only behind earlier sends on its own link.
  const int p = pp_->size(), r = pp_->rank();
  if (p > 1) {
    std::vector<std::shared_ptr<ProcessGroup>> act(p), grad(p);
    for (int s = 0; s < p; ++s) act[s] = pp_->new_group({s, (s + 1) % p});   // s sends activations to s+1
    for (int s = 0; s < p; ++s) grad[s] = pp_->new_group({(s + 1) % p, s});  // s+1 sends gradients to s
    act_next_ = act[r];
    act_prev_ = act[(r + p - 1) % p];
    grad_prev_ = grad[(r + p - 1) % p];
    grad_next_ = grad[r];
  }
  kept_.assign(opts_.chunks, std::vector<InFlight>(opts_.micro_batches));
}

Pipeline::~Pipeline() {
  // After a failed step, sends may still be running on the link groups'
  // threads: their tensors must outlive them (the groups stay alive as long
  // as those threads hold them), so they are left allocated.
  if (!sends_.empty()) (void)new std::vector<Tensor>(std::move(sent_));
}

void Pipeline::check_usable() const {
  if (broken_)
    throw Error("pipeline: an earlier step failed (its error was thrown then); the stages no longer agree on which "
                "messages were sent: build a new Pipeline, or restart the job");
}

int Pipeline::virtual_stage(int chunk) const { return chunk * pp_->size() + pp_->rank(); }
int Pipeline::virtual_stages() const { return opts_.chunks * pp_->size(); }
bool Pipeline::first_virtual(int chunk) const { return pp_->rank() == 0 && chunk == 0; }
bool Pipeline::last_virtual(int chunk) const { return pp_->rank() == pp_->size() - 1 && chunk == opts_.chunks - 1; }

namespace {
// A message's tag names its edge: the micro-batch and the virtual stage that
// sends the activation (the gradient goes back over the same edge).
int edge_tag(int micro, int virtual_stage, int virtual_stages) { return micro * virtual_stages + virtual_stage; }
// The peer's rank in a two-rank link group.
int other(const ProcessGroup& link) { return 1 - link.rank(); }
}  // namespace

void Pipeline::forward(const Action& a, const Inputs& inputs, const Loss& loss) {
  InFlight& k = kept_[a.chunk][a.micro];
  if (first_virtual(a.chunk)) {
    k.input = inputs(a.micro);
  } else {
    k.input = ::torch::empty(opts_.activation, ::torch::TensorOptions().dtype(opts_.dtype));
    wait_keeping(act_prev_->recv(Buffer{k.input.data_ptr(), static_cast<size_t>(k.input.numel()), to_dtype(opts_.dtype)},
                              other(*act_prev_), {.tag = edge_tag(a.micro, virtual_stage(a.chunk) - 1, virtual_stages())}),
              {k.input});
    k.input.requires_grad_(true);
  }
  const double start = now_s();
  {
    cohort::timeline::Span span("pp forward", "pipeline");
    if (!opts_.ddp.empty()) opts_.ddp[a.chunk]->pre_forward();
    Tensor out = chunks_[a.chunk](k.input, a.micro);
    if (!out.device().is_cpu())
      throw InvalidArgument(fmt::format("pipeline: chunk {} of stage {} returned a tensor on {}; the pipeline runner "
                                        "moves CPU tensors only so far (docs/parallelism.md, Limits)",
                                        a.chunk, pp_->rank(), out.device().str()));
    if (last_virtual(a.chunk)) {
      Tensor l = loss(out, a.micro);
      loss_sum_ += l.item<double>();
      k.output = l / opts_.micro_batches;
      if (opts_.scaler) k.output = opts_.scaler->scale(k.output);
    } else {
      if (out.sizes().vec() != opts_.activation || out.scalar_type() != opts_.dtype)
        throw InvalidArgument(fmt::format("pipeline: chunk {} of stage {} returned [{}] of {}, but the pipeline sends "
                                          "[{}] of {} (PipelineOptions::activation, dtype)",
                                          a.chunk, pp_->rank(), fmt::join(out.sizes(), ", "), c10::toString(out.scalar_type()),
                                          fmt::join(opts_.activation, ", "), c10::toString(opts_.dtype)));
      k.output = out;
      Tensor send = out.detach().contiguous();
      sends_.push_back(act_next_->send(Buffer{send.data_ptr(), static_cast<size_t>(send.numel()), to_dtype(opts_.dtype)},
                                       other(*act_next_), {.tag = edge_tag(a.micro, virtual_stage(a.chunk), virtual_stages())}));
      sent_.push_back(send);
    }
  }
  const double end = now_s();
  stats_.actions.push_back({a, start, end});
}

void Pipeline::backward(const Action& a) {
  InFlight& k = kept_[a.chunk][a.micro];
  Tensor grad;
  if (!last_virtual(a.chunk)) {
    grad = ::torch::empty(opts_.activation, ::torch::TensorOptions().dtype(opts_.dtype));
    wait_keeping(grad_next_->recv(Buffer{grad.data_ptr(), static_cast<size_t>(grad.numel()), to_dtype(opts_.dtype)},
                               other(*grad_next_), {.tag = edge_tag(a.micro, virtual_stage(a.chunk), virtual_stages())}),
              {grad});
  }
  const double start = now_s();
  {
    cohort::timeline::Span span("pp backward", "pipeline");
    // DDP over dp: only the chunk's last backward of the step synchronises.
    std::optional<ddp::NoSyncGuard> no_sync;
    if (!opts_.ddp.empty() && a.micro != last_backward_[a.chunk]) no_sync.emplace(opts_.ddp[a.chunk]->reducer());
    if (grad.defined()) ::torch::autograd::backward({k.output}, {grad});
    else ::torch::autograd::backward({k.output});
    if (!first_virtual(a.chunk)) {
      Tensor g = k.input.grad().defined() ? k.input.grad().contiguous() : ::torch::zeros_like(k.input);
      sends_.push_back(grad_prev_->send(Buffer{g.data_ptr(), static_cast<size_t>(g.numel()), to_dtype(opts_.dtype)},
                                        other(*grad_prev_), {.tag = edge_tag(a.micro, virtual_stage(a.chunk) - 1, virtual_stages())}));
      sent_.push_back(g);
    }
  }
  k = InFlight{};
  const double end = now_s();
  stats_.actions.push_back({a, start, end});
}

double Pipeline::evaluate(const Inputs& inputs, const Loss& loss) {
  check_usable();
  broken_ = true;  // until the forwards complete
  ::torch::NoGradGuard no_grad;
  const PipelineStats kept = stats_;
  loss_sum_ = 0;
  // The schedule's forwards keep their relative order on every stage, so the
  // messages still arrive in the order each link's receiver expects.
  for (const Action& a : actions_) {
    if (a.kind != Action::Forward) continue;
    forward(a, inputs, loss);
    kept_[a.chunk][a.micro] = InFlight{};
  }
  finish_sends();
  broken_ = false;
  stats_ = kept;
  const bool last = pp_->rank() == pp_->size() - 1;
  return allreduce_scalar(*pp_, last ? loss_sum_ / opts_.micro_batches : 0.0);
}

void Pipeline::finish_sends() {
  try {
    for (auto& w : sends_) w->wait();
  } catch (...) {
    (void)new std::vector<Tensor>(std::move(sent_));
    sends_.clear();
    throw;
  }
  sends_.clear();
  sent_.clear();
}

double Pipeline::step(const Inputs& inputs, const Loss& loss) {
  check_usable();
  broken_ = true;  // until every action and send completes
  stats_ = PipelineStats{};
  loss_sum_ = 0;
  const auto t0 = std::chrono::steady_clock::now();
  const double base = std::chrono::duration<double>(t0.time_since_epoch()).count();
  stats_.origin_s = base;
  int in_flight = 0;
  for (const Action& a : actions_) {
    if (a.kind == Action::Forward) {
      forward(a, inputs, loss);
      stats_.peak_in_flight = std::max(stats_.peak_in_flight, ++in_flight);
    } else {
      backward(a);
      --in_flight;
    }
  }
  finish_sends();
  broken_ = false;
  for (auto& t : stats_.actions) {
    t.start_s -= base;
    t.end_s -= base;
  }
  stats_.step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const bool last = pp_->rank() == pp_->size() - 1;
  return allreduce_scalar(*pp_, last ? loss_sum_ / opts_.micro_batches : 0.0);
}

}  // namespace cohort::torch::pp
