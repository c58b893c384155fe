// Base64 (RFC 4648, standard alphabet, '=' padding) for the opaque RNG states in
// manifest.json. Pure functions.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace cohort::ckpt {

std::string base64_encode(std::string_view bytes);
// std::nullopt for a length that is not a multiple of 4, a character outside the
// alphabet, or misplaced padding.
std::optional<std::string> base64_decode(std::string_view text);

}  // namespace cohort::ckpt
