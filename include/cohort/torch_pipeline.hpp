// cohort/torch_pipeline.hpp: pipeline parallelism for LibTorch (GPipe:
// Huang et al. 2019; 1F1B: Narayanan et al., PipeDream-Flush, 2021;
// interleaved 1F1B: Narayanan et al., "Efficient Large-Scale Language Model
// Training on GPU Clusters Using Megatron-LM", SC 2021).
//
// The model is cut into p stages, one per rank of a pipeline group
// (Mesh::pp()); a step's batch into m micro-batches. Stage s runs a
// micro-batch's forward when stage s-1 sends it the activation, and its
// backward when stage s+1 sends back the activation's gradient. The schedule
// orders those actions on each stage:
//
//   GPipe        every forward, then every backward: stage 0 keeps the
//                activations of all m micro-batches.
//   1F1B         p-s-1 forwards of warm-up, then one forward and one backward
//                in turn: stage s keeps at most p-s micro-batches in flight.
//   interleaved  each rank holds v chunks (virtual stages s, s+p, s+2p, ...):
//                1F1B over p*v virtual stages, whose bubble is v times
//                smaller at the cost of v times the messages (m % p == 0).
//
// The bubble of GPipe and 1F1B, the idle share of a step, is
// (p-1)/(m+p-1); interleaving divides its idle time by v.
//
//   cohort::Mesh mesh(world, {.dp = 1, .tp = 1, .pp = 2});
//   cohort::torch::pp::Pipeline pipe(mesh.group_ptr(cohort::MeshDim::pp),
//       {[&](const torch::Tensor& x, int micro) { return stage->forward(x); }},
//       {.schedule = pp::Schedule::OneFOneB, .micro_batches = 4, .activation = {8, 64, 128}});
//   double loss = pipe.step(
//       [&](int micro) { return ids_of(micro); },                           // first stage: the inputs
//       [&](const torch::Tensor& out, int micro) { return loss_of(out, micro); });  // last stage: the loss
//
// step() runs the whole schedule: gradients of all micro-batches accumulate
// in .grad (each micro-batch's loss is divided by m, so .grad is that of the
// mean loss over the batch), and returns that mean loss on every stage.
// Activations and their gradients move by send/recv on groups of their own,
// one per link and direction, so no order of a valid schedule can deadlock.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cohort/export.hpp"
#include "cohort/process_group.hpp"
#include "cohort/torch.hpp"
#include "cohort/torch_train.hpp"

namespace cohort::torch::pp {

enum class Schedule { GPipe, OneFOneB, Interleaved };
COHORT_API const char* schedule_name(Schedule s);
// "gpipe", "1f1b", "interleaved"; InvalidArgument names the choices.
COHORT_API Schedule parse_schedule(const std::string& name);

// One step of a stage's schedule: the forward or backward of micro-batch
// `micro` through this rank's chunk `chunk` (virtual stage chunk * p + stage).
struct Action {
  enum Kind { Forward, Backward } kind;
  int micro;
  int chunk;
  bool operator==(const Action&) const = default;
};

// The actions of `stage` (of `stages`) for `micro` micro-batches and `chunks`
// chunks per rank, in order. InvalidArgument for counts the schedule cannot
// run (interleaved: chunks >= 2 and micro % stages == 0; the others: chunks == 1).
COHORT_API std::vector<Action> schedule_actions(Schedule s, int stage, int stages, int micro, int chunks = 1);

// The most micro-batches (chunk-micro-batch pairs) whose activations `actions`
// keeps at once: forwards done minus backwards done, at its peak.
COHORT_API int peak_in_flight(const std::vector<Action>& actions);

// How `layers` layers split into `stages` virtual stages: [first, last) for
// each. `balance` gives each virtual stage's layer count (GPipe's "balance";
// it must sum to `layers`); empty splits as evenly as possible, the earlier
// stages taking one more. InvalidArgument for a split that leaves a stage
// without a layer (naming it) or a balance that does not add up.
COHORT_API std::vector<std::pair<int64_t, int64_t>> stage_ranges(int64_t layers, int64_t stages,
                                                                 const std::vector<int64_t>& balance = {});

// This rank's chunks of a sequential model: chunk c is virtual stage
// c * stages + stage of stages * chunks (the interleaved placement; chunks 1:
// one run of consecutive layers per stage), as a Sequential holding the same
// module objects under their names in `model` ("3", "4", ...), so the chunks'
// state names are the whole model's. Split as stage_ranges does.
COHORT_API std::vector<::torch::nn::Sequential> split_sequential(const ::torch::nn::Sequential& model, int stage,
                                                                 int stages, int chunks = 1,
                                                                 const std::vector<int64_t>& balance = {});

struct PipelineOptions {
  Schedule schedule = Schedule::OneFOneB;
  int micro_batches = 1;
  int chunks = 1;  // per rank; more than one only with Schedule::Interleaved
  // The shape and dtype of the activation every stage sends to the next (the
  // receiver allocates it before the data arrives). A stage whose output has
  // another shape throws InvalidArgument naming both when it runs (in the
  // first step); the stages waiting for its message then fail with the
  // group's TimeoutError.
  std::vector<int64_t> activation;
  ::torch::ScalarType dtype = ::torch::kFloat;
  // One DistributedDataParallel per chunk (or empty): every backward of a
  // chunk but its last micro-batch's runs under no_sync(), so the dp
  // allreduce runs once per step and overlaps the rest of the pipeline.
  std::vector<DistributedDataParallel*> ddp;
  // Mixed precision: the last stage back-propagates scaler->scale(loss), so
  // every stage's gradients carry the scale; then call
  // scaler->step(optimizer, &mesh.world()) on every rank, which unscales,
  // checks for inf/NaN on every stage and steps (or skips) everywhere alike.
  // step() still returns the unscaled loss.
  GradScaler* scaler = nullptr;
};

// Where the time of a step went on this rank.
struct COHORT_API PipelineStats {
  struct Timed {
    Action action;
    double start_s, end_s;  // from the start of step()
  };
  std::vector<Timed> actions;
  double step_s = 0;
  // When step() began, in seconds of std::chrono::steady_clock (one clock for
  // every process of a host: the stages' timelines line up).
  double origin_s = 0;
  int peak_in_flight = 0;  // the most activations kept at once in this step
  // The share of the step this rank computed nothing: 1 - busy / step.
  double bubble() const;
};

class COHORT_API Pipeline {
 public:
  using ChunkForward = std::function<::torch::Tensor(const ::torch::Tensor& input, int micro)>;
  using Inputs = std::function<::torch::Tensor(int micro)>;
  using Loss = std::function<::torch::Tensor(const ::torch::Tensor& output, int micro)>;

  // Collective over `pp`: checks that every stage has the same schedule,
  // micro-batch count, chunk count and activation shape (InvalidArgument on
  // every stage, naming the stage that differs), then creates the link groups.
  // `chunks[c]` runs this rank's chunk c (its part of virtual stage c*p + rank).
  Pipeline(std::shared_ptr<ProcessGroup> pp, std::vector<ChunkForward> chunks, PipelineOptions opts);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // One step: every micro-batch forward and backward in the schedule's order.
  // `inputs` is called on the first virtual stage, `loss` on the last (it
  // returns a scalar). Returns the mean of the micro-batch losses, on every
  // stage. Chunks compute on the CPU (a chunk that returns a CUDA tensor is
  // refused). A step that throws (a peer failed, a timeout, a chunk's error)
  // leaves the pipeline unusable: later calls throw Error.
  double step(const Inputs& inputs, const Loss& loss);

  // The forwards of step() alone, without autograd (validation): returns the
  // mean loss on every stage. Leaves stats() as the last step() left them.
  double evaluate(const Inputs& inputs, const Loss& loss);

  const PipelineStats& stats() const { return stats_; }
  const std::vector<Action>& actions() const { return actions_; }
  const PipelineOptions& options() const { return opts_; }

 private:
  struct Link;
  void forward(const Action& a, const Inputs& inputs, const Loss& loss);
  void backward(const Action& a);
  void finish_sends();
  void check_usable() const;
  int virtual_stage(int chunk) const;
  int virtual_stages() const;
  bool first_virtual(int chunk) const;
  bool last_virtual(int chunk) const;

  std::shared_ptr<ProcessGroup> pp_;
  std::vector<ChunkForward> chunks_;
  PipelineOptions opts_;
  std::vector<Action> actions_;
  std::vector<int> last_backward_;  // per chunk: the micro-batch of its last backward in actions_
  // Send activations to the next rank / receive them from the previous one;
  // send gradients to the previous rank / receive them from the next one.
  std::shared_ptr<ProcessGroup> act_next_, act_prev_, grad_prev_, grad_next_;
  struct InFlight {
    ::torch::Tensor input, output;  // output: the loss on the last virtual stage
  };
  std::vector<std::vector<InFlight>> kept_;  // [chunk][micro]
  std::vector<WorkPtr> sends_;
  std::vector<::torch::Tensor> sent_;  // kept alive until their sends complete
  double loss_sum_ = 0;
  bool broken_ = false;  // a step or evaluate threw
  PipelineStats stats_;
};

}  // namespace cohort::torch::pp
