// Sets (or, with nullptr, unsets) an environment variable for one scope and
// puts back what was there. Only while no other thread reads the environment.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace cohort::testing {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    value ? (void)::setenv(name, value, 1) : (void)::unsetenv(name);
  }
  ~ScopedEnv() { old_ ? (void)::setenv(name_, old_->c_str(), 1) : (void)::unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace cohort::testing
