/// @file mpi.hpp
/// The MPI engine of the communicator concept (dist/comm.hpp): nonblocking point-to-point (MPI_Isend / MPI_Irecv,
/// completed by MPI_Waitall) and MPI_Allreduce. It wraps a communicator the program owns; it never initialises or
/// finalises MPI. Include it explicitly (the umbrella header does not pull in mpi.h).
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <mpi.h>

#include "../core/status.hpp"

namespace fusedattn {
namespace dist {

/// A communicator over an MPI communicator (MPI_COMM_WORLD by default). Copyable; owns nothing.
class mpi_comm {
 public:
  /// Transfers of one exchange in flight (a large one is cut into messages below INT_MAX bytes).
  struct request {
    std::vector<MPI_Request> pending;
  };

  /// Wraps `comm`; MPI must be initialised.
  explicit mpi_comm(MPI_Comm comm = MPI_COMM_WORLD) : comm_(comm) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm native() const { return comm_; }

  /// Posts the receive, then the send (the order keeps unexpected-message buffering out of the way).
  status start_exchange(const void* send, int to, void* recv, int from, std::size_t bytes, request& r,
                        void* /*stream*/) {
    r.pending.clear();
    const auto* s = static_cast<const unsigned char*>(send);
    auto* d = static_cast<unsigned char*>(recv);
    const std::size_t pieces = bytes == 0 ? 1 : (bytes + max_message - 1) / max_message;
    for (std::size_t piece = 0; piece < pieces; ++piece) {
      const std::size_t off = piece * max_message;
      const int n = static_cast<int>(bytes - off < max_message ? bytes - off : max_message);
      const int tag = static_cast<int>(piece % tag_modulus);
      MPI_Request rr, rs;
      if (int e = MPI_Irecv(d + off, n, MPI_BYTE, from, tag, comm_, &rr); e != MPI_SUCCESS) return fail(e, "MPI_Irecv");
      r.pending.push_back(rr);
      if (int e = MPI_Isend(s + off, n, MPI_BYTE, to, tag, comm_, &rs); e != MPI_SUCCESS) return fail(e, "MPI_Isend");
      r.pending.push_back(rs);
    }
    return {};
  }

  /// Blocks until every transfer of `r` is complete.
  status wait(request& r, void* /*stream*/) {
    if (r.pending.empty()) return {};
    const int e = MPI_Waitall(static_cast<int>(r.pending.size()), r.pending.data(), MPI_STATUSES_IGNORE);
    r.pending.clear();
    return e == MPI_SUCCESS ? status{} : fail(e, "MPI_Waitall");
  }

  status all_reduce_min(std::int64_t* values, int count) {
    const int e = MPI_Allreduce(MPI_IN_PLACE, values, count, MPI_INT64_T, MPI_MIN, comm_);
    return e == MPI_SUCCESS ? status{} : fail(e, "MPI_Allreduce");
  }

 private:
  static constexpr std::size_t max_message = std::size_t(1) << 30;
  static constexpr std::size_t tag_modulus = 32767;  // MPI guarantees tags up to 32767

  static status fail(int code, const char* what) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(code, text, &len);
    return {errc::backend_error, std::string(what) + " failed: " + std::string(text, static_cast<std::size_t>(len))};
  }

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace dist
}  // namespace fusedattn
