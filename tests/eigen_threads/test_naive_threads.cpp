// policy::cpu_naive{threads} in a program built the usual way: OpenMP on and EIGEN_DONT_PARALLELIZE not defined
// (the flags of an example copied out of the tree), where Eigen opens an OpenMP team of its own inside a GEMM.
// The kernel must still use exactly `threads` threads (at most min(threads, batch x heads)), and its results must
// be bitwise the same for every thread count. Threads are counted as the entries of /proc/self/task of a forked
// child that makes one call (OpenMP keeps a team's threads alive after the call), so Linux only.
#if defined(EIGEN_DONT_PARALLELIZE)
#error "this test must be built without EIGEN_DONT_PARALLELIZE (tests/CMakeLists.txt, test_naive_threads)"
#endif

#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include <omp.h>

#include "support/check.hpp"

using namespace fusedattn;
using namespace fusedattn::testing;

namespace {

/// Threads of this process now.
int task_count() {
  DIR* d = opendir("/proc/self/task");
  if (!d) return -1;
  int n = 0;
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return n;
}

/// Runs `f` in a forked child (a process with one thread and no OpenMP team yet) and returns the number of
/// threads the child had after it, or -1 when the child failed.
template <class F>
int threads_used_by(F&& f) {
  const pid_t pid = fork();
  if (pid == 0) {
    const bool ok = f();
    const int n = task_count();
    _exit(ok && n > 0 && n < 200 ? n : 255);
  }
  int wstatus = 0;
  if (pid < 0 || waitpid(pid, &wstatus, 0) != pid || !WIFEXITED(wstatus) || WEXITSTATUS(wstatus) == 255) return -1;
  return WEXITSTATUS(wstatus);
}

/// One naive call on fixed inputs (deterministic from `seed`), its O and lse.
struct naive_run {
  std::vector<float> o, lse;
  bool ok = false;
};
naive_run run_naive(const problem& p, const any_mask& mask, int threads, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  attention_case<float> c(p, layout::bhsd, rng);
  naive_run r;
  r.lse.assign(static_cast<std::size_t>(p.lse_size()), 0.0f);
  r.ok = attend(policy::cpu_naive{threads}, p, c.q.cview(), c.k.cview(), c.v.cview(), c.o.view, mask, r.lse.data()).ok();
  r.o = c.o.buf;
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("cpu_naive{n} uses n threads when Eigen may parallelise, and gives the same bits for every n",
          "[naive][threads]") {
  // The caller asks OpenMP for 4 threads (as OMP_NUM_THREADS=4 would): what Eigen's GEMM would take.
  omp_set_num_threads(4);
  REQUIRE(Eigen::nbThreads() == 4);
  REQUIRE(task_count() == 1);  // no OpenMP team yet: the children below start from one thread
  const problem one_head{1, 1, 1, 256, 256, 64};
  const problem six_heads{2, 3, 3, 200, 160, 48};
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);

  // Control: a plain Eigen GEMM of this size in this build opens a team (so the count below can fail).
  const int eigen_alone = threads_used_by([] {
    kernels::matrix<float> a = kernels::matrix<float>::Random(256, 64), b = kernels::matrix<float>::Random(64, 256);
    kernels::matrix<float> s = a * b;
    return s.allFinite();
  });
  INFO("threads of a plain Eigen GEMM: " << eigen_alone);
  CHECK(eigen_alone > 1);

  struct call {
    problem p;
    int threads;
    int most;
  };
  for (const call& c : {call{one_head, 1, 1}, call{one_head, 3, 1}, call{six_heads, 1, 1}, call{six_heads, 2, 2},
                        call{six_heads, 3, 3}}) {
    const int used = threads_used_by([&] { return run_naive(c.p, causal{}, c.threads, seed).ok; });
    INFO(describe(c.p) << " threads " << c.threads << ": the process had " << used << " threads");
    CHECK(used >= 1);
    CHECK(used <= c.most);
  }

  // Bitwise the same for every thread count (parent process, after the children).
  for (const problem& p : {one_head, six_heads})
    for (const any_mask& m : {any_mask{dense{}}, any_mask{causal{align::bottom_right}}, any_mask{window{40, 3}}}) {
      INFO(describe(p) << " " << describe(m));
      const naive_run ref = run_naive(p, m, 1, seed);
      REQUIRE(ref.ok);
      for (int threads : {2, 3, 4, 7}) {
        const naive_run r = run_naive(p, m, threads, seed);
        INFO("threads " << threads);
        REQUIRE(r.ok);
        CHECK(same_bits(r.o, ref.o));
        CHECK(same_bits(r.lse, ref.lse));
      }
    }
}
