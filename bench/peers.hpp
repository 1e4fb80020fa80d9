/// @file peers.hpp
/// Peers timed in the same run as fusedattn's kernels, where they are installed: today the naive three-pass
/// pipeline written on OpenBLAS (rows `peer_openblas_naive/...`). PyTorch is timed by bench/peers/torch_peer.py.
#pragma once

#include <string>

#include "rows.hpp"

namespace fusedattn::bench {

/// Registers the peer rows of one row spec (f32 only); registers nothing for f16 or without OpenBLAS.
void register_peer_rows(const row_spec& r);

/// One line naming the peers compiled in and how they are configured (OpenBLAS's core type and build), or saying
/// that there are none. Also recorded in the JSON context as `fusedattn_peers`.
std::string peer_info();

}  // namespace fusedattn::bench
