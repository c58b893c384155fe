// The message of a captured exception, for errors that wrap another one.
#pragma once

#include <exception>
#include <string>

namespace cohort::core {

// what() of the exception e holds; "unknown error" for one that is not a std::exception.
inline std::string exception_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace cohort::core
