// process_group_bench: all_reduce, all_gather and broadcast between N processes on this
// host (loopback, 127.0.0.1), from 1 KiB to 64 MiB, through ferry and on raw Gloo.
//
//   process_group_bench [--world-size 2] [--min-bytes 1024] [--max-bytes 67108864]
//                       [--repeat 5] [--ops all_reduce,all_gather,broadcast]
//                       [--side both|ferry|gloo]
//
// It forks the ranks itself; they rendezvous through a FileStore in a temporary
// directory. Sizes follow nccl-tests: "bytes" is the whole result (the all_reduce and
// broadcast tensor; the all_gather output, world_size x each rank's input).
//
// The baseline is raw Gloo: its own context over the same store and interface, the same
// Gloo call (same algorithm, element type, sizes and buffers, reused across calls), no
// ferry layer. Each size runs --repeat blocks; a block runs `iterations` operations of
// each side, alternating one ferry op and one Gloo op (which goes first alternates from
// block to block), so a burst of load elsewhere hits both alike. A block's time for a
// side is the slowest rank's mean per op; its ratio is ferry / Gloo. The table gives the
// median over the blocks of each side's time, and the median and min–max of the ratio.
// busbw (from the median times) scales algbw by what each rank must move: 2(n-1)/n for
// all_reduce, (n-1)/n for all_gather, 1 for broadcast.
//
// --side ferry (or gloo) runs only that side (for perf record / perf stat); the ratio
// columns are then left out. With PG_BENCH_BLOCKS set, rank 0 also prints every block's
// times on stderr.
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
#include <sstream>
#include <string>
#include <vector>

#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/broadcast.h"
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
  int repeat = 5;
  std::vector<std::string> ops = {"all_reduce", "all_gather", "broadcast"};
  std::string side = "both";
};

std::string human(int64_t bytes) {
  if (bytes >= (int64_t{1} << 20)) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= (int64_t{1} << 10)) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 == 1 ? v[m] : (v[m - 1] + v[m]) / 2;
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

  const bool run_ferry = options.side != "gloo";
  const bool run_raw = options.side != "ferry";
  const bool both = run_ferry && run_raw;
  if (rank == 0) {
    std::printf("# ferry process_group_bench: %d processes on loopback (Gloo TCP), float32, %d blocks per size\n", n,
                options.repeat);
    std::printf("| op | bytes | ferry time (us) | Gloo time (us) | ratio (median) | ratio (min-max) "
                "| ferry busbw (GB/s) | Gloo busbw (GB/s) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n");
  }
  for (const std::string& op_name : options.ops) {
    const bool reduce = op_name == "all_reduce";
    const bool gather = op_name == "all_gather";
    for (int64_t bytes = options.min_bytes; bytes <= options.max_bytes; bytes *= 4) {
      const int64_t out_elems = bytes / 4;
      const int64_t in_elems = gather ? out_elems / n : out_elems;
      if (in_elems == 0) continue;
      const int iterations = static_cast<int>(std::clamp<int64_t>((int64_t{256} << 20) / bytes, 3, 100));
      ferry::Tensor input = *ferry::Tensor::zeros({in_elems}, ferry::DType::kFloat32);
      ferry::Tensor output = *ferry::Tensor::zeros({in_elems * n}, ferry::DType::kFloat32);
      auto ferry_op = [&] {
        if (reduce) {
          check(group.all_reduce(input));
        } else if (gather) {
          check(group.all_gather_into_tensor(output, input));
        } else {
          check(group.broadcast(input, 0));
        }
      };
      auto run_gloo = [&] {
        if (reduce) {
          gloo::AllreduceOptions opts(raw);
          opts.setOutput(input.data_ptr<float>(), static_cast<size_t>(in_elems));
          opts.setReduceFunction(&sum_floats);
          opts.setTag(raw_tag++);
          gloo::allreduce(opts);
        } else if (gather) {
          // ferry moves tensors as bytes: so does the baseline.
          gloo::AllgatherOptions opts(raw);
          opts.setInput<uint8_t>(static_cast<uint8_t*>(input.data()), static_cast<size_t>(input.nbytes()));
          opts.setOutput<uint8_t>(static_cast<uint8_t*>(output.data()), static_cast<size_t>(output.nbytes()));
          opts.setTag(raw_tag++);
          gloo::allgather(opts);
        } else {
          gloo::BroadcastOptions opts(raw);
          opts.setRoot(0);
          opts.setOutput<uint8_t>(static_cast<uint8_t*>(input.data()), static_cast<size_t>(input.nbytes()));
          opts.setTag(raw_tag++);
          gloo::broadcast(opts);
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
      // Warm up: connections, page faults.
      for (int i = 0; i < 2; ++i) {
        if (run_ferry) ferry_op();
        if (run_raw) gloo_op();
      }
      std::vector<double> ferry_s, gloo_s, ratio;
      for (int block = 0; block < options.repeat; ++block) {
        check(group.barrier());
        double sums[2] = {0, 0};  // ferry, Gloo
        for (int i = 0; i < iterations; ++i) {
          for (int k = 0; k < 2; ++k) {
            const bool ferry_turn = (k == 0) == (block % 2 == 0);
            if (ferry_turn ? !run_ferry : !run_raw) continue;
            const auto start = std::chrono::steady_clock::now();
            if (ferry_turn) {
              ferry_op();
            } else {
              gloo_op();
            }
            sums[ferry_turn ? 0 : 1] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          }
        }
        ferry::Tensor t = ferry::Tensor::from_vector(std::vector<double>{sums[0] / iterations, sums[1] / iterations});
        check(group.all_reduce(t, ferry::ReduceOp::kMax));
        ferry_s.push_back(*t.at<double>({0}));
        gloo_s.push_back(*t.at<double>({1}));
        if (both) ratio.push_back(ferry_s.back() / gloo_s.back());
        if (rank == 0 && std::getenv("PG_BENCH_BLOCKS") != nullptr) {
          std::fprintf(stderr, "  block %d: ferry %.1f us, Gloo %.1f us\n", block, ferry_s.back() * 1e6,
                       gloo_s.back() * 1e6);
        }
      }
      const double moved = static_cast<double>(gather ? in_elems * 4 * n : in_elems * 4);
      const double factor = reduce ? 2.0 * (n - 1) / n : gather ? static_cast<double>(n - 1) / n : 1.0;
      if (rank == 0) {
        const double f = median(ferry_s);
        const double g = median(gloo_s);
        std::string ratio_median = "-", ratio_range = "-";
        if (both) {
          char buf[64];
          std::snprintf(buf, sizeof(buf), "%.2f", median(ratio));
          ratio_median = buf;
          std::snprintf(buf, sizeof(buf), "%.2f–%.2f", *std::min_element(ratio.begin(), ratio.end()),
                        *std::max_element(ratio.begin(), ratio.end()));
          ratio_range = buf;
        }
        std::printf("| %s | %s | %.1f | %.1f | %s | %s | %.3f | %.3f |\n", op_name.c_str(),
                    human(static_cast<int64_t>(moved)).c_str(), run_ferry ? f * 1e6 : 0.0, run_raw ? g * 1e6 : 0.0,
                    ratio_median.c_str(), ratio_range.c_str(), run_ferry ? moved / f / 1e9 * factor : 0.0,
                    run_raw ? moved / g / 1e9 * factor : 0.0);
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
    } else if (arg == "--repeat") {
      options.repeat = std::atoi(value().c_str());
    } else if (arg == "--ops") {
      options.ops.clear();
      std::stringstream list(value());
      for (std::string op; std::getline(list, op, ',');) {
        if (op != "all_reduce" && op != "all_gather" && op != "broadcast") {
          std::fprintf(stderr, "process_group_bench: unknown op '%s' (expected all_reduce, all_gather, broadcast)\n",
                       op.c_str());
          return 2;
        }
        options.ops.push_back(op);
      }
    } else if (arg == "--side") {
      options.side = value();
      if (options.side != "both" && options.side != "ferry" && options.side != "gloo") {
        std::fprintf(stderr, "process_group_bench: --side is both, ferry or gloo, not '%s'\n", options.side.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "usage: process_group_bench [--world-size N] [--min-bytes B] [--max-bytes B] [--repeat N]\n"
                   "                           [--ops all_reduce,all_gather,broadcast] [--side both|ferry|gloo]\n");
      return 2;
    }
  }
  if (options.world_size < 2 || options.min_bytes < 4 || options.max_bytes < options.min_bytes ||
      options.repeat < 1 || options.ops.empty()) {
    std::fprintf(stderr,
                 "process_group_bench: need --world-size >= 2, 4 <= --min-bytes <= --max-bytes, --repeat >= 1 and "
                 "at least one op\n");
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
