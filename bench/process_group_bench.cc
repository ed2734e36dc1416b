// process_group_bench: all_reduce and all_gather bandwidth of ProcessGroup between N
// processes on this host (loopback, 127.0.0.1), from 1 KiB to 64 MiB.
//
//   process_group_bench --world-size 4 [--min-bytes 1024] [--max-bytes 67108864]
//
// It forks the ranks itself; they rendezvous through a FileStore in a temporary
// directory. Sizes follow nccl-tests: "bytes" is the whole result (the all_reduce
// tensor; the all_gather output, world_size x each rank's input). time is the slowest
// rank's mean per operation; algbw = bytes / time; busbw scales algbw by what each
// rank must move: 2(n-1)/n for all_reduce, (n-1)/n for all_gather.
//
// Each size is also run on raw Gloo (its own context over the same store and
// interface, the same algorithms, no ferry layer), interleaved with ferry's runs so
// that load on the machine hits both alike: the gap is ferry's overhead (the
// cross-rank argument check, the hop to the group's worker thread).
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

#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/rendezvous/context.h"
#include "gloo/transport/tcp/device.h"
#include "process_group/process_group.h"
#include "store/file_store.h"
#include "process_group/internal/gloo_store.h"
#include "store/prefix_store.h"

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

void sum_floats(void* out, const void* a, const void* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    static_cast<float*>(out)[i] = static_cast<const float*>(a)[i] + static_cast<const float*>(b)[i];
  }
}

int run_rank(const Options& options, const std::string& dir, int rank) {
  absl::StatusOr<std::unique_ptr<ferry::FileStore>> opened = ferry::FileStore::create(dir + "/store");
  check(opened.status());
  std::shared_ptr<ferry::Store> store(*std::move(opened));
  ferry::ProcessGroupOptions pg_options;
  pg_options.address = "127.0.0.1";
  absl::StatusOr<std::unique_ptr<ferry::ProcessGroup>> created =
      ferry::ProcessGroup::create(store, rank, options.world_size, std::chrono::seconds(120), pg_options);
  check(created.status());
  ferry::ProcessGroup& group = **created;
  const int n = options.world_size;

  // The baseline: a bare Gloo context on the same interface.
  std::shared_ptr<gloo::rendezvous::Context> raw;
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    auto device = gloo::transport::tcp::CreateDevice(attr);
    raw = std::make_shared<gloo::rendezvous::Context>(rank, n);
    raw->setTimeout(std::chrono::seconds(120));
    ferry::internal::GlooStore gloo_store(std::make_shared<ferry::PrefixStore>("bench/raw_gloo", store));
    raw->connectFullMesh(gloo_store, device);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "process_group_bench: raw Gloo setup failed: %s\n", e.what());
    return 3;
  }
  uint32_t raw_tag = 0;

  if (rank == 0) {
    std::printf("# ferry process_group_bench: %d processes on loopback (Gloo TCP), float32\n", n);
    std::printf("| op | bytes | ferry time (us) | Gloo time (us) | ferry busbw (GB/s) | Gloo busbw (GB/s) |\n"
                "|---|---:|---:|---:|---:|---:|\n");
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
      auto ferry_op = [&] {
        if (reduce) {
          check(group.all_reduce(input));
        } else {
          check(group.all_gather_into_tensor(output, input));
        }
      };
      auto run_gloo = [&] {
        if (reduce) {
          gloo::AllreduceOptions opts(raw);
          opts.setOutput(input.data_ptr<float>(), static_cast<size_t>(in_elems));
          opts.setReduceFunction(&sum_floats);
          opts.setTag(raw_tag++);
          gloo::allreduce(opts);
        } else {
          gloo::AllgatherOptions opts(raw);
          opts.setInput(input.data_ptr<float>(), static_cast<size_t>(in_elems));
          opts.setOutput(output.data_ptr<float>(), static_cast<size_t>(in_elems * n));
          opts.setTag(raw_tag++);
          gloo::allgather(opts);
        }
      };
      auto gloo_op = [&] {
        try {
          run_gloo();
        } catch (const std::exception& e) {
          std::fprintf(stderr, "process_group_bench: Gloo: %s\n", e.what());
          std::exit(3);
        }
      };
      // Interleaved halves, so a burst of load elsewhere hits both alike.
      const int half = std::max(1, iterations / 2);
      double ferry_s = 0, gloo_s = 0;
      for (int round = 0; round < 2; ++round) {
        ferry_s += time_op(group, half, ferry_op) / 2;
        gloo_s += time_op(group, half, gloo_op) / 2;
      }
      const double moved = static_cast<double>(reduce ? in_elems * 4 : in_elems * 4 * n);
      const double factor = reduce ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
      if (rank == 0) {
        std::printf("| %s | %s | %.1f | %.1f | %.3f | %.3f |\n", op_name, human(static_cast<int64_t>(moved)).c_str(),
                    ferry_s * 1e6, gloo_s * 1e6, moved / ferry_s / 1e9 * factor, moved / gloo_s / 1e9 * factor);
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
