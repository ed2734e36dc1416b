// process_group_bench: all_reduce and all_gather bandwidth of ProcessGroup between N
// processes on this host (loopback), from 1 KiB to 64 MiB.
//
//   process_group_bench --world-size 4 [--min-bytes 1024] [--max-bytes 67108864]
//
// It forks the ranks itself; they rendezvous through a FileStore in a temporary
// directory. Sizes follow nccl-tests: "bytes" is the whole result (the all_reduce
// tensor; the all_gather output, world_size x each rank's input). time is the slowest
// rank's mean per operation; algbw = bytes / time; busbw scales algbw by what each
// rank must move: 2(n-1)/n for all_reduce, (n-1)/n for all_gather.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "process_group/process_group.h"
#include "store/file_store.h"

namespace {

struct Options {
  int world_size = 2;
  int64_t min_bytes = int64_t{1} << 10;
  int64_t max_bytes = int64_t{64} << 20;
};

std::string human(int64_t bytes) {
  if (bytes >= (int64_t{1} << 20)) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= (int64_t{1} << 10)) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

// Times `iterations` runs of `op` on every rank; returns the slowest rank's mean in
// seconds (all ranks learn it through an all_reduce(max)).
template <typename Op>
double time_op(ferry::ProcessGroup& group, int iterations, Op&& op) {
  for (int i = 0; i < 2; ++i) op();  // warm up: connections, page faults
  if (!group.barrier().ok()) std::exit(3);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) op();
  const double mean = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iterations;
  ferry::Tensor t = ferry::Tensor::from_vector(std::vector<double>{mean});
  if (!group.all_reduce(t, ferry::ReduceOp::kMax).ok()) std::exit(3);
  return *t.at<double>({0});
}

void check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "process_group_bench: %s\n", s.ToString().c_str());
    std::exit(3);
  }
}

int run_rank(const Options& options, const std::string& dir, int rank) {
  if (std::getenv("FERRY_SOCKET_IFNAME") == nullptr) setenv("FERRY_SOCKET_IFNAME", "lo", 1);
  absl::StatusOr<std::unique_ptr<ferry::FileStore>> store = ferry::FileStore::create(dir + "/store");
  check(store.status());
  absl::StatusOr<std::unique_ptr<ferry::ProcessGroup>> created =
      ferry::ProcessGroup::create(std::shared_ptr<ferry::Store>(*std::move(store)), rank, options.world_size,
                                  std::chrono::seconds(120));
  check(created.status());
  ferry::ProcessGroup& group = **created;
  const int n = options.world_size;
  if (rank == 0) {
    std::printf("# ferry process_group_bench: %d processes on loopback (Gloo TCP), float32\n", n);
    std::printf("| op | bytes | time (us) | algbw (GB/s) | busbw (GB/s) |\n|---|---:|---:|---:|---:|\n");
  }
  for (const char* op_name : {"all_reduce", "all_gather"}) {
    const bool reduce = std::strcmp(op_name, "all_reduce") == 0;
    for (int64_t bytes = options.min_bytes; bytes <= options.max_bytes; bytes *= 4) {
      const int64_t out_elems = bytes / 4;
      const int64_t in_elems = reduce ? out_elems : out_elems / n;
      if (in_elems == 0) continue;
      const int iterations = static_cast<int>(std::clamp<int64_t>((int64_t{512} << 20) / bytes, 5, 200));
      ferry::Tensor input = *ferry::Tensor::zeros({in_elems}, ferry::DType::kFloat32);
      ferry::Tensor output = *ferry::Tensor::zeros({in_elems * n}, ferry::DType::kFloat32);
      double seconds = reduce ? time_op(group, iterations, [&] { check(group.all_reduce(input)); })
                              : time_op(group, iterations, [&] { check(group.all_gather_into_tensor(output, input)); });
      const double moved = static_cast<double>(reduce ? in_elems * 4 : in_elems * 4 * n);
      const double algbw = moved / seconds / 1e9;
      const double factor = reduce ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
      if (rank == 0) {
        std::printf("| %s | %s | %.1f | %.3f | %.3f |\n", op_name, human(static_cast<int64_t>(moved)).c_str(),
                    seconds * 1e6, algbw, algbw * factor);
        std::fflush(stdout);
      }
    }
  }
  check(group.barrier());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "process_group_bench: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--world-size" || arg == "-n") {
      options.world_size = std::atoi(value().c_str());
    } else if (arg == "--min-bytes") {
      options.min_bytes = std::atoll(value().c_str());
    } else if (arg == "--max-bytes") {
      options.max_bytes = std::atoll(value().c_str());
    } else {
      std::fprintf(stderr, "usage: process_group_bench [--world-size N] [--min-bytes B] [--max-bytes B]\n");
      return 2;
    }
  }
  if (options.world_size < 2 || options.min_bytes < 4 || options.max_bytes < options.min_bytes) {
    std::fprintf(stderr, "process_group_bench: need --world-size >= 2 and 4 <= --min-bytes <= --max-bytes\n");
    return 2;
  }
  std::string dir = (std::filesystem::temp_directory_path() / "ferry-pg-bench-XXXXXX").string();
  if (mkdtemp(dir.data()) == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < options.world_size; ++rank) {
    pid_t pid = fork();
    if (pid == 0) _exit(run_rank(options, dir, rank));
    pids.push_back(pid);
  }
  int failures = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failures;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return failures == 0 ? 0 : 1;
}
