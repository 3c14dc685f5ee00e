# Writes OUTPUT: a header defining `inline constexpr std::string_view NAME` with INPUT's text.
# Run as: cmake -DINPUT=... -DOUTPUT=... -DNAME=... -P embed_text.cmake
file(READ "${INPUT}" content)
file(WRITE "${OUTPUT}.tmp" "// Generated from ${INPUT}; do not edit.\n#pragma once\n#include <string_view>\ninline constexpr std::string_view ${NAME} = R\"diloco_embed(${content})diloco_embed\";\n")
file(COPY_FILE "${OUTPUT}.tmp" "${OUTPUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUTPUT}.tmp")
