// Where the calling thread's OpenMP team runs: one CPU set per team thread (Linux). A worker that
// borrows another role's idle cores widens its team onto them for a step and narrows it after
// (engine/worker/core_lease.py); each widening places every thread again, so the pool threads OpenMP
// reuses never run where a previous placement left them.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <sched.h>

#include <cerrno>
#include <cstring>

#include <vector>

namespace {

// Sets the calling thread's team to one thread per entry of `cpu_sets` and binds team thread i to
// cpu_sets[i] (thread 0 is the caller). Later parallel regions started by the caller use that team.
void place_team(const std::vector<std::vector<int64_t>>& cpu_sets) {
  const int64_t threads = static_cast<int64_t>(cpu_sets.size());
  TORCH_CHECK(threads >= 1, "place_team: at least one CPU set");
  for (const auto& cpus : cpu_sets) {
    TORCH_CHECK(!cpus.empty(), "place_team: an empty CPU set");
    for (const int64_t cpu : cpus) TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "place_team: CPU ", cpu, " out of range");
  }
  at::set_num_threads(static_cast<int>(threads));
  std::vector<int> errors(threads, 0);
  auto bind = [&](int64_t slot) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (const int64_t cpu : cpu_sets[slot]) CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) errors[slot] = errno;
  };
  if (threads == 1) {
    bind(0);
  } else {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      TORCH_CHECK(end - begin == 1 && at::get_thread_num() == begin, "place_team: the team did not start ", threads,
                  " threads");
      bind(begin);
    });
  }
  for (int64_t slot = 0; slot < threads; ++slot)
    TORCH_CHECK(errors[slot] == 0, "place_team: sched_setaffinity for team thread ", slot, " failed: ",
                std::strerror(errors[slot]));
}

}  // namespace

void register_threads(pybind11::module_& m) {
  m.def("place_team", &place_team,
        "size the calling thread's OpenMP team to len(cpu_sets) and bind team thread i to cpu_sets[i]",
        py::arg("cpu_sets"));
}
