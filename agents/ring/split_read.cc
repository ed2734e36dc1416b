#include "agents/ring/split_read.h"

#include <sys/uio.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/future.h"
#include "base/thread_name.h"

namespace ferry::internal::ring {

namespace {

// Copies with process_vm_readv until all `bytes` arrived (it may return short): 0, or
// the errno of the call that failed (EFAULT also for a call that read nothing).
int copy_from(pid_t pid, uint8_t* dst, uint64_t address, uint64_t bytes) {
  uint64_t done = 0;
  while (done < bytes) {
    iovec local{dst + done, bytes - done};
    iovec remote{reinterpret_cast<void*>(address + done), bytes - done};
    ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0) return errno;
    if (n == 0) return EFAULT;
    done += static_cast<uint64_t>(n);
  }
  return 0;
}

}  // namespace

SplitReader::~SplitReader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_one();
  if (helper_.joinable()) helper_.join();
}

absl::Status SplitReader::read(pid_t pid, uint8_t* dst, uint64_t address, uint64_t bytes) {
  auto failed = [&](int err) {
    return absl::UnavailableError(
        absl::StrCat("cannot read a ", bytes, "-byte tensor in place from process ", pid, ": ", std::strerror(err)));
  };
  if (bytes < split_bytes_ || host_crowded()) {
    int err = copy_from(pid, dst, address, bytes);
    return err == 0 ? absl::OkStatus() : failed(err);
  }
  // The halves meet on a page boundary of the destination.
  const uint64_t first = (bytes / 2 + 4095) & ~uint64_t{4095};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!helper_.joinable()) helper_ = std::thread([this] { serve(); });
    pid_ = pid;
    dst_ = dst + first;
    address_ = address + first;
    bytes_ = bytes - first;
    has_job_ = true;
    ++split_reads_;
  }
  wake_.notify_one();
  int err = copy_from(pid, dst, address, first);
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [this] { return !has_job_; });
  if (err == 0) err = result_;
  return err == 0 ? absl::OkStatus() : failed(err);
}

uint64_t SplitReader::split_reads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return split_reads_;
}

void SplitReader::serve() {
  name_this_thread("ferry-ring-copy");
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [this] { return stopping_ || has_job_; });
    if (has_job_) {
      pid_t pid = pid_;
      uint8_t* dst = dst_;
      uint64_t address = address_, bytes = bytes_;
      lock.unlock();
      int err = copy_from(pid, dst, address, bytes);
      lock.lock();
      result_ = err;
      has_job_ = false;
      done_.notify_one();
      continue;
    }
    if (stopping_) return;
  }
}

}  // namespace ferry::internal::ring
