// Errors: one exception type per kind of failure, each saying whose fault it is.
//   InvalidInput  - the caller's input (a message, a config, an argument) is wrong
//   Unavailable   - a service we depend on (broker, endpoint) cannot be reached; retrying may help
//   IoError       - the operating system refused (file, socket)
//   InternalError - a bug in this project
// DILOCO_ENFORCE* put both values in the message so a failure explains itself.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace diloco {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct InvalidInput : Error {
  using Error::Error;
};
struct Unavailable : Error {
  using Error::Error;
};
struct IoError : Error {
  using Error::Error;
};
struct InternalError : Error {
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace detail

}  // namespace diloco

#define DILOCO_ENFORCE(cond, ...)                                                              \
  do {                                                                                         \
    if (!(cond))                                                                               \
      throw ::diloco::InternalError(::diloco::detail::concat(__FILE__, ":", __LINE__,          \
                                                             ": check failed: " #cond ". ",    \
                                                             ##__VA_ARGS__));                  \
  } while (0)

#define DILOCO_ENFORCE_EQ(a, b, ...)                                                           \
  do {                                                                                         \
    const auto& diloco_a_ = (a);                                                               \
    const auto& diloco_b_ = (b);                                                               \
    if (!(diloco_a_ == diloco_b_))                                                             \
      throw ::diloco::InternalError(::diloco::detail::concat(                                  \
          __FILE__, ":", __LINE__, ": " #a " == " #b " failed (", diloco_a_, " vs ", diloco_b_, \
          "). ", ##__VA_ARGS__));                                                              \
  } while (0)
