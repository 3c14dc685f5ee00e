// With no broker running, the integration tests fail fast (within 60 s) with a message that
// says what is wrong and how to fix it, instead of hanging or crashing.
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <string>

namespace {

// A loopback port nobody listens on: bind to port 0, read the port, close.
int closed_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace

TEST_CASE("without a broker the round-trip test fails within 60 s and says how to start one", "[no-broker]") {
  std::string command = "DILOCO_BOOTSTRAP=127.0.0.1:" + std::to_string(closed_port()) + " " DILOCO_BINARY_DIR
                        "/bin/diloco-integration-tests '100 deltas over 3 fragments round-trip through a consumer "
                        "group byte for byte' 2>&1";
  auto start = std::chrono::steady_clock::now();
  FILE* pipe = popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string output;
  std::array<char, 4096> buffer{};
  while (size_t n = fread(buffer.data(), 1, buffer.size(), pipe)) output.append(buffer.data(), n);
  int status = pclose(pipe);
  auto seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO(output);
  // Catch wraps a long message at 80 columns (a newline and an indent): join the lines again.
  std::string joined;
  for (size_t i = 0; i < output.size(); ++i) {
    if (output[i] != '\n') {
      joined += output[i];
      continue;
    }
    while (i + 1 < output.size() && output[i + 1] == ' ') ++i;
    joined += ' ';
  }
  output = joined;
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) != 0);
  CHECK(seconds < 60.0);
  CHECK_THAT(output, Catch::Contains("no Kafka broker answered at 127.0.0.1:"));
  CHECK_THAT(output, Catch::Contains("scripts/broker start"));
}
