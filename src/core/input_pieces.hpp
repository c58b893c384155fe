// Gathering allreduce_gathered's InputPieces (include/cohort/types.hpp) into
// their buffer: the group does it before a collective that needs the whole
// buffer, and DDP's comm hooks when a hook asks for the bucket's bytes.
#pragma once

#include <span>

#include "cohort/types.hpp"

namespace cohort::core {

// Copies every piece to its offset in buf, except pieces already there.
// The pieces must lie inside buf without overlap (group::check_pieces).
void copy_pieces(Buffer buf, std::span<const InputPiece> pieces);

}  // namespace cohort::core
