// Files that hold a secret (a CURVE secret key, a TLS private key, a password) are refused when
// others than their owner may read them.
#pragma once

#include <sys/stat.h>

#include <filesystem>
#include <string>

#include "core/errors.h"

namespace diloco {

// Throws InvalidInput naming `file` and the fix when its mode lets group or others read it;
// `holds` says what it holds ("a private key"). A file that cannot be stat'ed is left to its reader.
inline void require_owner_only(const std::filesystem::path& file, const std::string& holds) {
  struct stat st {};
  if (::stat(file.c_str(), &st) == 0 && (st.st_mode & 077) != 0)
    throw InvalidInput(file.string() + " holds " + holds + " and is readable by others than its owner: chmod 600 " +
                       file.string());
}

}  // namespace diloco
