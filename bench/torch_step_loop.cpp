// A plain LibTorch training loop (no cohort in it: the example model's
// FsdpUnit wrappers do nothing without an FSDP): the example's CNN on
// random data, batch 64, SGD with momentum, one intra-op thread. It prints
// the time and the page faults per step, so that bench/malloc_tuning.sh can
// show what `cohort run`'s malloc thresholds (COHORT_MALLOC_TUNING, docs/
// launcher.md) do to a program that did not tune glibc's allocator itself.
//
//   torch_step_loop [steps]        (default 300, after 20 untimed)
#include <sys/resource.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "model.hpp"  // examples/fashion_mnist: the CNN

namespace {

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 300;
  if (steps <= 0) {
    std::fprintf(stderr, "torch_step_loop: steps must be a positive number (got '%s')\n", argv[1]);
    return 2;
  }
  torch::set_num_threads(1);
  torch::manual_seed(0);
  Cnn net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  const auto x = torch::rand({64, 1, 28, 28}) * 2.8 - 0.8;  // the range of normalised Fashion-MNIST pixels
  const auto y = torch::randint(0, 10, {64});
  std::chrono::steady_clock::time_point t0;
  long f0 = 0;
  for (int i = 0; i < steps + 20; ++i) {
    if (i == 20) {
      t0 = std::chrono::steady_clock::now();
      f0 = minor_faults();
    }
    opt.zero_grad();
    auto loss = torch::cross_entropy_loss(net->forward(x), y);
    loss.backward();
    opt.step();
    (void)loss.item<double>();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  std::printf("RESULT torch_step_loop steps=%d ms_per_step=%.2f page_faults_per_step=%.0f GLIBC_TUNABLES=%s\n", steps,
              s / steps * 1e3, static_cast<double>(minor_faults() - f0) / steps, tunables ? tunables : "(unset)");
  return 0;
}
