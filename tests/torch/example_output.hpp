// Reading the Fashion-MNIST example's output in tests that run it.
#pragma once

#include <map>
#include <regex>
#include <string>

namespace cohort::testing {

// Step -> loss, from the LOSS lines rank 0 prints with --log-losses.
inline std::map<int, double> example_losses(const std::string& out) {
  std::map<int, double> m;
  const std::regex re(R"(LOSS step=(\d+) value=([-0-9.e]+))");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it)
    m[std::stoi((*it)[1])] = std::stod((*it)[2]);
  return m;
}

}  // namespace cohort::testing
