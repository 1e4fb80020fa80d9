// Catch2's main for the MPI tests: every rank runs the same test cases in the same order (their collectives line up);
// the exit code is the worst over the ranks, so mpirun fails when any rank failed.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <mpi.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const int rc = Catch::Session().run(argc, argv);
  int worst = rc;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
