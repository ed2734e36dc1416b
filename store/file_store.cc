#include "store/file_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status.h"
#include "store/internal/store_util.h"

namespace ferry {

using internal::av;

// Record layout: op (1 byte), key length (u32), value length (u32), key, value; host
// byte order, since every process sharing the file runs on this host.
enum class FileStore::Op : uint8_t { kSet = 1, kDelete = 2, kClose = 3 };

namespace {
constexpr size_t kHeaderBytes = 1 + 4 + 4;
// Every store file starts with this, so a path naming some other file fails at once
// instead of being read as records.
constexpr char kMagic[] = "FERRYFS1";
constexpr size_t kMagicBytes = sizeof(kMagic) - 1;
constexpr auto kFirstPoll = std::chrono::milliseconds(1);
constexpr auto kMaxPoll = std::chrono::milliseconds(50);
}  // namespace

// flock(2) held for one operation; unlocks when destroyed.
class FileStore::FileLock {
 public:
  FileLock(int fd, bool exclusive) : fd_(fd) {
    int rc;
    do {
      rc = ::flock(fd_, exclusive ? LOCK_EX : LOCK_SH);
    } while (rc != 0 && errno == EINTR);
    error_ = rc == 0 ? 0 : errno;
  }
  ~FileLock() {
    if (error_ == 0) ::flock(fd_, LOCK_UN);
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  int error() const { return error_; }

 private:
  int fd_;
  int error_ = 0;
};

absl::StatusOr<std::unique_ptr<FileStore>> FileStore::create(std::string path, FileStoreOptions options) {
  if (path.empty()) return absl::InvalidArgumentError("FileStore: path is empty");
  if (options.world_size && *options.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("FileStore ", path, ": world_size must be at least 1, got ", *options.world_size));
  }
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    int err = errno;
    return absl::UnavailableError(absl::StrCat("FileStore: cannot open ", path, ": ", std::strerror(err)));
  }
  std::unique_ptr<FileStore> store(new FileStore(std::move(path), fd, options));
  FERRY_RETURN_IF_ERROR(store->init_file());
  return store;
}

absl::Status FileStore::init_file() {
  absl::MutexLock lock(&mu_);
  FileLock flock(fd_, true);
  if (flock.error()) return io_error("lock", flock.error());
  char head[kMagicBytes] = {};
  ssize_t n;
  do {
    n = ::pread(fd_, head, kMagicBytes, 0);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return io_error("read", errno);
  if (static_cast<size_t>(n) == kMagicBytes && std::memcmp(head, kMagic, kMagicBytes) == 0) {
    offset_ = kMagicBytes;
    return absl::OkStatus();
  }
  // An empty file, or the start of a header whose writer died: (re)write it.
  if (std::memcmp(head, kMagic, static_cast<size_t>(n)) == 0) {
    if (::pwrite(fd_, kMagic, kMagicBytes, 0) != static_cast<ssize_t>(kMagicBytes)) return io_error("write", errno);
    offset_ = kMagicBytes;
    return absl::OkStatus();
  }
  return absl::DataLossError(absl::StrCat("FileStore ", path_, ": not a ferry store file (expected it to start with \"",
                                          kMagic, "\"); refusing to overwrite it"));
}

FileStore::FileStore(std::string path, int fd, FileStoreOptions options)
    : Store(options.timeout), path_(std::move(path)), fd_(fd), options_(options) {}

FileStore::~FileStore() {
  if (options_.world_size) {
    absl::MutexLock lock(&mu_);
    FileLock flock(fd_, /*exclusive=*/true);
    absl::Status s = flock.error() ? io_error("lock", flock.error()) : refresh();
    if (s.ok()) s = append(Op::kClose, "", {});
    if (!s.ok()) {
      FERRY_LOG(WARNING) << "FileStore " << path_ << ": cannot record close: " << s.message();
    } else if (closed_ >= *options_.world_size) {
      // Every rank is done: the next job may reuse the path from scratch.
      ::unlink(path_.c_str());
    }
  }
  ::close(fd_);
}

absl::Status FileStore::io_error(std::string_view what, int err) const {
  return absl::UnavailableError(absl::StrCat("FileStore ", path_, ": ", av(what), " failed: ", std::strerror(err)));
}

absl::Status FileStore::refresh() {
  Bytes buf;
  while (true) {
    uint8_t chunk[1 << 16];
    ssize_t n = ::pread(fd_, chunk, sizeof(chunk), static_cast<off_t>(offset_ + buf.size()));
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error("read", errno);
    }
    if (n == 0) break;
    buf.insert(buf.end(), chunk, chunk + n);
  }
  size_t pos = 0;
  while (buf.size() - pos >= kHeaderBytes) {
    uint8_t op = buf[pos];
    uint32_t klen, vlen;
    std::memcpy(&klen, &buf[pos + 1], 4);
    std::memcpy(&vlen, &buf[pos + 5], 4);
    size_t total = kHeaderBytes + size_t{klen} + size_t{vlen};
    // A record cut short was being written by a process that died mid-write; the next
    // writer truncates it away (append), readers stop before it.
    if (buf.size() - pos < total) break;
    std::string key(reinterpret_cast<const char*>(&buf[pos + kHeaderBytes]), klen);
    const uint8_t* value = &buf[pos + kHeaderBytes + klen];
    switch (static_cast<Op>(op)) {
      case Op::kSet:
        map_.insert_or_assign(std::move(key), Bytes(value, value + vlen));
        break;
      case Op::kDelete:
        map_.erase(key);
        break;
      case Op::kClose:
        ++closed_;
        break;
      default:
        return absl::DataLossError(absl::StrCat("FileStore ", path_, ": corrupt record at offset ", offset_ + pos,
                                                " (unknown op ", op, "); is this file a ferry store?"));
    }
    pos += total;
  }
  offset_ += pos;
  return absl::OkStatus();
}

absl::Status FileStore::append(Op op, std::string_view key, const Bytes& value) {
  if (key.size() > UINT32_MAX || value.size() > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("FileStore ", path_, ": key ", internal::quote_key(key),
                                                   " or its value is larger than 4 GiB"));
  }
  struct stat st;
  if (::fstat(fd_, &st) != 0) return io_error("stat", errno);
  if (static_cast<uint64_t>(st.st_size) > offset_) {
    FERRY_LOG(WARNING) << "FileStore " << path_ << ": dropping a partial record of "
                       << (static_cast<uint64_t>(st.st_size) - offset_) << " bytes at offset " << offset_
                       << " (a writer died mid-write)";
    if (::ftruncate(fd_, static_cast<off_t>(offset_)) != 0) return io_error("truncate", errno);
  }
  uint32_t klen = static_cast<uint32_t>(key.size());
  uint32_t vlen = static_cast<uint32_t>(value.size());
  Bytes record(kHeaderBytes + key.size() + value.size());
  record[0] = static_cast<uint8_t>(op);
  std::memcpy(&record[1], &klen, 4);
  std::memcpy(&record[5], &vlen, 4);
  std::memcpy(record.data() + kHeaderBytes, key.data(), key.size());
  if (!value.empty()) std::memcpy(record.data() + kHeaderBytes + key.size(), value.data(), value.size());
  size_t done = 0;
  while (done < record.size()) {
    ssize_t n = ::pwrite(fd_, record.data() + done, record.size() - done, static_cast<off_t>(offset_ + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error("write", errno);
    }
    done += static_cast<size_t>(n);
  }
  // Apply by replaying, so this process's view is exactly what others will read.
  return refresh();
}

absl::Status FileStore::set(std::string_view key, const Bytes& value) {
  absl::MutexLock lock(&mu_);
  FileLock flock(fd_, true);
  if (flock.error()) return io_error("lock", flock.error());
  FERRY_RETURN_IF_ERROR(refresh());
  return append(Op::kSet, key, value);
}

absl::StatusOr<std::vector<Bytes>> FileStore::await_keys(std::string_view op, const std::vector<std::string>& keys,
                                                         std::chrono::milliseconds timeout) {
  auto start = std::chrono::steady_clock::now();
  auto deadline = start + timeout;
  auto pause = kFirstPoll;
  while (true) {
    std::vector<std::string> missing;
    {
      absl::MutexLock lock(&mu_);
      FileLock flock(fd_, false);
      if (flock.error()) return io_error("lock", flock.error());
      FERRY_RETURN_IF_ERROR(refresh());
      for (const std::string& k : keys) {
        if (!map_.contains(k)) missing.push_back(k);
      }
      if (missing.empty()) {
        std::vector<Bytes> values;
        values.reserve(keys.size());
        for (const std::string& k : keys) values.push_back(map_.at(k));
        return values;
      }
    }
    auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return internal::wait_timeout_error(op, missing, internal::elapsed_since(start));
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, kMaxPoll);
  }
}

absl::StatusOr<Bytes> FileStore::get(std::string_view key, std::optional<std::chrono::milliseconds> timeout) {
  FERRY_ASSIGN_OR_RETURN(std::vector<Bytes> values, await_keys("get", {std::string(key)}, effective(timeout)));
  return std::move(values[0]);
}

absl::StatusOr<int64_t> FileStore::add(std::string_view key, int64_t delta) {
  absl::MutexLock lock(&mu_);
  FileLock flock(fd_, true);
  if (flock.error()) return io_error("lock", flock.error());
  FERRY_RETURN_IF_ERROR(refresh());
  int64_t value = 0;
  auto it = map_.find(av(key));
  if (it != map_.end()) {
    FERRY_ASSIGN_OR_RETURN(value, internal::parse_counter(key, it->second));
  }
  FERRY_ASSIGN_OR_RETURN(int64_t sum, internal::add_counter(key, value, delta));
  FERRY_RETURN_IF_ERROR(append(Op::kSet, key, internal::format_counter(sum)));
  return sum;
}

absl::StatusOr<Bytes> FileStore::compare_set(std::string_view key, const Bytes& expected, const Bytes& desired) {
  absl::MutexLock lock(&mu_);
  FileLock flock(fd_, true);
  if (flock.error()) return io_error("lock", flock.error());
  FERRY_RETURN_IF_ERROR(refresh());
  auto it = map_.find(av(key));
  bool matches = it == map_.end() ? expected.empty() : it->second == expected;
  if (!matches) return it == map_.end() ? Bytes() : it->second;
  FERRY_RETURN_IF_ERROR(append(Op::kSet, key, desired));
  return desired;
}

absl::StatusOr<bool> FileStore::check(const std::vector<std::string>& keys) {
  absl::MutexLock lock(&mu_);
  FileLock flock(fd_, false);
  if (flock.error()) return io_error("lock", flock.error());
  FERRY_RETURN_IF_ERROR(refresh());
  for (const std::string& k : keys) {
    if (!map_.contains(k)) return false;
  }
  return true;
}

absl::Status FileStore::wait(const std::vector<std::string>& keys, std::optional<std::chrono::milliseconds> timeout) {
  return await_keys("wait", keys, effective(timeout)).status();
}

absl::StatusOr<bool> FileStore::delete_key(std::string_view key) {
  absl::MutexLock lock(&mu_);
  FileLock flock(fd_, true);
  if (flock.error()) return io_error("lock", flock.error());
  FERRY_RETURN_IF_ERROR(refresh());
  if (!map_.contains(av(key))) return false;
  FERRY_RETURN_IF_ERROR(append(Op::kDelete, key, {}));
  return true;
}

absl::StatusOr<int64_t> FileStore::num_keys() {
  absl::MutexLock lock(&mu_);
  FileLock flock(fd_, false);
  if (flock.error()) return io_error("lock", flock.error());
  FERRY_RETURN_IF_ERROR(refresh());
  return static_cast<int64_t>(map_.size());
}

absl::StatusOr<std::vector<Bytes>> FileStore::multi_get(const std::vector<std::string>& keys,
                                                        std::optional<std::chrono::milliseconds> timeout) {
  return await_keys("multi_get", keys, effective(timeout));
}

absl::Status FileStore::multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  if (keys.size() != values.size()) return internal::multi_set_size_error(keys.size(), values.size());
  absl::MutexLock lock(&mu_);
  FileLock flock(fd_, true);
  if (flock.error()) return io_error("lock", flock.error());
  FERRY_RETURN_IF_ERROR(refresh());
  for (size_t i = 0; i < keys.size(); ++i) FERRY_RETURN_IF_ERROR(append(Op::kSet, keys[i], values[i]));
  return absl::OkStatus();
}

}  // namespace ferry
