// diloco-keys: makes the CURVE key pairs of a run with authenticated parameters
// (core/zmq/curve.h, [security] in docs/configuration.md): DIR/NAME.key (the public key, to
// hand out) and DIR/NAME.key_secret (both keys, mode 0600, to keep) for each NAME.
#include <CLI/CLI.hpp>

#include <filesystem>
#include <iostream>

#include "core/errors.h"
#include "core/zmq/curve.h"

using namespace diloco;

int main(int argc, char** argv) {
  CLI::App app{
      "Makes ZeroMQ CURVE key pairs for authenticated parameters: DIR/NAME.key (public) and DIR/NAME.key_secret "
      "(secret, mode 0600) for each NAME. A run needs one pair for its mergers (security.merger_secret_key, "
      "security.merger_public_key) and one per learner (security.learner_key); the mergers admit the learners whose "
      ".key files are in security.allowed_learners.\n\nExample: diloco-keys --dir keys merger && "
      "diloco-keys --dir keys/learners eu-0 us-0"};
  std::string dir;
  std::vector<std::string> names;
  bool force = false;
  app.add_option("--dir", dir, "the folder to write into (created if missing)")->required();
  app.add_option("names", names, "a name for each key pair (letters, digits, '-', '_', '.')")->required();
  app.add_flag("--force", force, "replace key files that exist (the old keys stop working)");
  CLI11_PARSE(app, argc, argv);
  try {
    for (const auto& name : names) {
      const auto secret = std::filesystem::path(dir) / (name + ".key_secret");
      if (!force && (std::filesystem::exists(secret) || std::filesystem::exists(std::filesystem::path(dir) / (name + ".key")))) {
        std::cerr << "diloco-keys: error: " << secret.string()
                  << " (or its .key) exists: keep it, or pass --force to make a new pair\n";
        return 1;
      }
      write_curve_keys(dir, name, generate_curve_keys());
      std::cout << "wrote " << (std::filesystem::path(dir) / (name + ".key")).string() << " and " << secret.string()
                << "\n";
    }
    return 0;
  } catch (const Error& e) {
    std::cerr << "diloco-keys: error: " << e.what() << "\n";
    return 1;
  }
}
