// PyTorch's CPU random generator (CPUGeneratorImpl), far enough to reproduce
// torch.randperm bit for bit.
//
// torch.Generator().manual_seed(s) builds its engine, at::mt19937, from the seed
// truncated to 32 bits: state[0] = s & 0xffffffff, state[j] =
// 1812433253 * (state[j-1] ^ (state[j-1] >> 30)) + j (mod 2^32), and draws are
// the reference MT19937 with the usual tempering. That is precisely what the C++
// standard specifies for std::mt19937 seeded with a 32-bit value (the standard
// pins the algorithm, the seeding and the 10000th output), so std::mt19937 is an
// exact stand-in; tests/data_sampler_test.cpp checks it against Python's output.
//
// Only random() (one 32-bit draw, CPUGeneratorImpl::random) is here: it is the
// only draw torch 1.13's randperm makes, whatever n.
#pragma once

#include <cstdint>
#include <random>

namespace cohort::data {

class TorchCpuGenerator {
 public:
  explicit TorchCpuGenerator(uint64_t seed) : engine_(static_cast<uint32_t>(seed & 0xffffffffu)) {}

  uint32_t random() { return static_cast<uint32_t>(engine_()); }

 private:
  std::mt19937 engine_;
};

}  // namespace cohort::data
