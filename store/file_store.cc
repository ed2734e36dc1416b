#include "store/file_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <random>
#include <cstdint>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status.h"
#include "store/internal/store_util.h"

namespace ferry {

using internal::av;

// File layout: a header ("FERRYFS2", a run-id length byte, the run id), then records:
// op (1 byte), key length (u32), value length (u32), CRC-32 of the record without its
// CRC field (u32), key, value; host byte order, since every process sharing the file
// runs on this host. A kSetMany record's value is a u32 count, then per item a u32
// key length, a u32 value length, the key and the value.
enum class FileStore::Op : uint8_t { kSet = 1, kDelete = 2, kClose = 3, kJoin = 4, kSetMany = 5 };

namespace {
constexpr size_t kRecordHeaderBytes = 1 + 4 + 4 + 4;
// Every store file starts with this, so a path naming some other file fails at once
// instead of being read as records.
constexpr char kMagic[] = "FERRYFS2";
constexpr size_t kMagicBytes = sizeof(kMagic) - 1;
// The files of earlier formats start with this too.
constexpr size_t kFamilyBytes = 7;
constexpr size_t kMaxRunIdBytes = 255;
constexpr auto kFirstPoll = std::chrono::milliseconds(1);
constexpr auto kMaxPoll = std::chrono::milliseconds(50);
using Clock = std::chrono::steady_clock;

constexpr std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kCrcTable = make_crc_table();

// CRC-32 (IEEE), continued from `crc` (0 to start).
uint32_t crc32(uint32_t crc, const uint8_t* p, size_t n) {
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = kCrcTable[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t record_crc(const uint8_t* record, size_t total) {
  uint32_t crc = crc32(0, record, 9);
  return crc32(crc, record + kRecordHeaderBytes, total - kRecordHeaderBytes);
}

std::string random_run_id() {
  std::random_device rd;
  uint64_t a = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
  return absl::StrCat(absl::Hex(a, absl::kZeroPad16));
}

bool same_file(int fd, const std::string& path) {
  struct stat a, b;
  if (::fstat(fd, &a) != 0 || ::stat(path.c_str(), &b) != 0) return false;
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

}  // namespace

absl::Status FileStore::check_private(int fd) const {
  struct stat st;
  if (::fstat(fd, &st) != 0) return io_error("stat", errno);
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("FileStore ", path_, ": not a regular file"));
  }
  if (st.st_uid != ::geteuid()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "FileStore ", path_, ": the file belongs to uid ", st.st_uid, ", not to this user (uid ", ::geteuid(),
        "); another user's store file could forge the job's keys: use a path of your own"));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%o", static_cast<unsigned>(st.st_mode & 07777));
    return absl::PermissionDeniedError(absl::StrCat(
        "FileStore ", path_, ": the file is writable by ", (st.st_mode & S_IWOTH) != 0 ? "everyone" : "its group",
        " (mode ", mode, "); anyone who can write it can forge the job's keys: chmod go-w it, or remove it"));
  }
  return absl::OkStatus();
}

// flock(2) held for one operation; unlocks (and, when it owns the descriptor, closes
// it) when destroyed.
class FileStore::FileLock {
 public:
  explicit FileLock(int fd) : fd_(fd) {}
  ~FileLock() {
    if (held_) ::flock(fd_, LOCK_UN);
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

  // One non-blocking attempt: 0, EWOULDBLOCK or another errno.
  int try_lock(bool exclusive) {
    int rc;
    do {
      rc = ::flock(fd_, (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB);
    } while (rc != 0 && errno == EINTR);
    held_ = rc == 0;
    return rc == 0 ? 0 : errno;
  }
  // Unlocks the current descriptor and takes over `fd`, locked by the caller.
  void switch_to(int fd) {
    if (held_) ::flock(fd_, LOCK_UN);
    fd_ = fd;
    held_ = true;
  }

 private:
  int fd_;
  bool held_ = false;
};

absl::StatusOr<std::unique_ptr<FileStore>> FileStore::create(std::string path, FileStoreOptions options) {
  if (path.empty()) return absl::InvalidArgumentError("FileStore: path is empty");
  if (options.world_size && *options.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("FileStore ", path, ": world_size must be at least 1, got ", *options.world_size));
  }
  if (options.run_id && (options.run_id->empty() || options.run_id->size() > kMaxRunIdBytes)) {
    return absl::InvalidArgumentError(absl::StrCat("FileStore ", path, ": run_id must be 1 to ", kMaxRunIdBytes,
                                                   " bytes, got ", options.run_id->size()));
  }
  std::unique_ptr<FileStore> store(new FileStore(std::move(path), std::move(options)));
  FERRY_RETURN_IF_ERROR(store->open_file());
  return store;
}

FileStore::FileStore(std::string path, FileStoreOptions options)
    : Store(options.timeout), path_(std::move(path)), options_(std::move(options)) {}

absl::Status FileStore::lock(FileLock& flock, bool exclusive, std::chrono::milliseconds timeout) {
  auto start = Clock::now();
  auto deadline = start + timeout;
  auto pause = kFirstPoll;
  while (true) {
    int err = flock.try_lock(exclusive);
    if (err == 0) return absl::OkStatus();
    if (err != EWOULDBLOCK) return io_error("lock", err);
    auto now = Clock::now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("FileStore ", path_, ": timed out after ",
                                                      internal::elapsed_since(start).count(),
                                                      " ms waiting for the file lock (another process holds it)"));
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, kMaxPoll);
  }
}

absl::Status FileStore::open_file() {
  // The path can be replaced (a new run) or removed (the last close) between open and
  // lock: then open again.
  for (int attempt = 0; attempt < 100; ++attempt) {
    // Never through a symbolic link, and only a file this user owns that nobody else
    // may write: anyone who can write the file can forge every key of the job.
    int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
      int err = errno;
      if (err == ELOOP) {
        return absl::PermissionDeniedError(absl::StrCat(
            "FileStore ", path_, ": is a symbolic link; refusing to follow it (give the real path)"));
      }
      return absl::UnavailableError(absl::StrCat("FileStore: cannot open ", path_, ": ", std::strerror(err)));
    }
    if (absl::Status safe = check_private(fd); !safe.ok()) {
      ::close(fd);
      return safe;
    }
    absl::MutexLock mu_lock(&mu_);
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
    FileLock flock(fd_);
    FERRY_RETURN_IF_ERROR(lock(flock, /*exclusive=*/true, timeout()));
    if (!same_file(fd_, path_)) continue;
    char head[kMagicBytes + 1 + kMaxRunIdBytes] = {};
    ssize_t n;
    do {
      n = ::pread(fd_, head, sizeof(head), 0);
    } while (n < 0 && errno == EINTR);
    if (n < 0) return io_error("read", errno);
    const size_t got = static_cast<size_t>(n);
    bool complete = got >= kMagicBytes + 1 && std::memcmp(head, kMagic, kMagicBytes) == 0 &&
                    got >= kMagicBytes + 1 + static_cast<uint8_t>(head[kMagicBytes]);
    if (!complete) {
      if (std::memcmp(head, kMagic, std::min(got, kMagicBytes)) == 0 && got <= kMagicBytes + 1 + kMaxRunIdBytes) {
        // An empty file, or the start of a header whose writer died: a fresh file.
        FERRY_RETURN_IF_ERROR(start_fresh_file(flock));
      } else if (got >= kFamilyBytes && std::memcmp(head, kMagic, kFamilyBytes) == 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "FileStore ", path_, ": the file was written by another ferry version (format \"",
            std::string(head, std::min(got, kMagicBytes)), "\", this one reads \"", kMagic,
            "\"); remove it or use another path"));
      } else {
        return absl::DataLossError(absl::StrCat("FileStore ", path_,
                                                ": not a ferry store file (expected it to start with \"", kMagic,
                                                "\"); refusing to overwrite it"));
      }
    } else {
      const size_t id_len = static_cast<uint8_t>(head[kMagicBytes]);
      std::string file_run(head + kMagicBytes + 1, id_len);
      offset_ = kMagicBytes + 1 + id_len;
      FERRY_RETURN_IF_ERROR(refresh());
      bool other_run = options_.run_id.has_value() && *options_.run_id != file_run;
      bool full = options_.world_size.has_value() && joined_ >= *options_.world_size;
      if (other_run || full) {
        FERRY_LOG(INFO) << "FileStore " << path_ << ": starting a fresh file; the one there belongs to "
                        << (other_run ? "run " + file_run : absl::StrCat("a run that ", joined_, " stores joined"));
        FERRY_RETURN_IF_ERROR(start_fresh_file(flock));
      } else {
        run_id_ = std::move(file_run);
      }
    }
    if (options_.world_size) FERRY_RETURN_IF_ERROR(append(Op::kJoin, "", {}));
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat("FileStore ", path_, ": the file keeps being replaced or removed"));
}

absl::Status FileStore::start_fresh_file(FileLock& flock) {
  run_id_ = options_.run_id.value_or(random_run_id());
  Bytes header(kMagic, kMagic + kMagicBytes);
  header.push_back(static_cast<uint8_t>(run_id_.size()));
  header.insert(header.end(), run_id_.begin(), run_id_.end());
  // Written aside and renamed into place: a process of the earlier run keeps its own
  // file, and nobody sees a file without a header.
  std::string tmp = absl::StrCat(path_, ".", random_run_id(), ".tmp");
  int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return io_error("create " + tmp, errno);
  auto fail = [&](std::string_view what, int err) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return io_error(what, err);
  };
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) return fail("lock", errno);
  size_t done = 0;
  while (done < header.size()) {
    ssize_t n = ::pwrite(fd, header.data() + done, header.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail("write", errno);
    done += static_cast<size_t>(n);
  }
  if (options_.fsync && ::fsync(fd) != 0) return fail("fsync", errno);
  if (::rename(tmp.c_str(), path_.c_str()) != 0) return fail("rename", errno);
  flock.switch_to(fd);
  ::close(fd_);
  fd_ = fd;
  map_.clear();
  offset_ = header.size();
  joined_ = 0;
  closed_ = 0;
  return absl::OkStatus();
}

FileStore::~FileStore() {
  if (fd_ < 0) return;
  if (options_.world_size) {
    absl::MutexLock mu_lock(&mu_);
    FileLock flock(fd_);
    absl::Status s = lock(flock, /*exclusive=*/true, timeout());
    if (s.ok()) s = refresh();
    if (s.ok()) s = append(Op::kClose, "", {});
    if (!s.ok()) {
      FERRY_LOG(WARNING) << "FileStore " << path_ << ": cannot record close: " << s.message();
    } else if (closed_ >= *options_.world_size && same_file(fd_, path_)) {
      // Every store of the run is done: the next run may reuse the path from scratch.
      // (A path that names another file already belongs to a newer run.)
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
  auto corrupt = [&](std::string_view why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return absl::DataLossError(absl::StrCat("FileStore ", path_, ": corrupt record at offset ", offset_ + pos, " (",
                                            av(why), "); is this file a ferry store?"));
  };
  while (buf.size() - pos >= kRecordHeaderBytes) {
    const uint8_t* rec = &buf[pos];
    uint8_t op = rec[0];
    uint32_t klen, vlen, crc;
    std::memcpy(&klen, rec + 1, 4);
    std::memcpy(&vlen, rec + 5, 4);
    std::memcpy(&crc, rec + 9, 4);
    size_t total = kRecordHeaderBytes + size_t{klen} + size_t{vlen};
    // A record cut short, zero-filled or garbled was being written when its writer (or
    // the machine) died: the log ends before it. The next writer cuts it away
    // (append); readers stop there.
    if (buf.size() - pos < total || record_crc(rec, total) != crc) break;
    std::string key(reinterpret_cast<const char*>(rec + kRecordHeaderBytes), klen);
    const uint8_t* value = rec + kRecordHeaderBytes + klen;
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
      case Op::kJoin:
        ++joined_;
        break;
      case Op::kSetMany: {
        // Checked whole before any item applies.
        std::vector<std::pair<std::string, Bytes>> items;
        size_t at = 0;
        auto u32 = [&](uint32_t* v) {
          if (vlen - at < 4) return false;
          std::memcpy(v, value + at, 4);
          at += 4;
          return true;
        };
        uint32_t count = 0;
        if (!u32(&count) || count > (vlen - at) / 8) return corrupt("bad multi_set count");
        for (uint32_t i = 0; i < count; ++i) {
          uint32_t kl = 0, vl = 0;
          if (!u32(&kl) || !u32(&vl) || vlen - at < size_t{kl} + vl) return corrupt("bad multi_set item");
          items.emplace_back(std::string(reinterpret_cast<const char*>(value + at), kl),
                             Bytes(value + at + kl, value + at + kl + vl));
          at += size_t{kl} + vl;
        }
        if (at != vlen) return corrupt("bytes after the last multi_set item");
        for (auto& [k, v] : items) map_.insert_or_assign(std::move(k), std::move(v));
        break;
      }
      default:
        return corrupt(absl::StrCat("unknown op ", op));
    }
    pos += total;
  }
  offset_ += pos;
  return absl::OkStatus();
}

absl::Status FileStore::write_at(const Bytes& data, uint64_t offset) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::pwrite(fd_, data.data() + done, data.size() - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error("write", errno);
    }
    done += static_cast<size_t>(n);
  }
  if (options_.fsync && ::fdatasync(fd_) != 0) return io_error("fdatasync", errno);
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
    FERRY_LOG(WARNING) << "FileStore " << path_ << ": dropping a torn record of "
                       << (static_cast<uint64_t>(st.st_size) - offset_) << " bytes at offset " << offset_
                       << " (its writer died mid-write)";
    if (::ftruncate(fd_, static_cast<off_t>(offset_)) != 0) return io_error("truncate", errno);
  }
  uint32_t klen = static_cast<uint32_t>(key.size());
  uint32_t vlen = static_cast<uint32_t>(value.size());
  Bytes record(kRecordHeaderBytes + key.size() + value.size());
  record[0] = static_cast<uint8_t>(op);
  std::memcpy(&record[1], &klen, 4);
  std::memcpy(&record[5], &vlen, 4);
  std::memcpy(record.data() + kRecordHeaderBytes, key.data(), key.size());
  if (!value.empty()) std::memcpy(record.data() + kRecordHeaderBytes + key.size(), value.data(), value.size());
  uint32_t crc = record_crc(record.data(), record.size());
  std::memcpy(&record[9], &crc, 4);
  FERRY_RETURN_IF_ERROR(write_at(record, offset_));
  // Apply by replaying, so this process's view is exactly what others will read.
  return refresh();
}

absl::Status FileStore::set(std::string_view key, const Bytes& value) {
  absl::MutexLock mu_lock(&mu_);
  FileLock flock(fd_);
  FERRY_RETURN_IF_ERROR(lock(flock, true, timeout()));
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
      absl::MutexLock mu_lock(&mu_);
      FileLock flock(fd_);
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      FERRY_RETURN_IF_ERROR(lock(flock, false, std::max(left, std::chrono::milliseconds(0))));
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
  absl::MutexLock mu_lock(&mu_);
  FileLock flock(fd_);
  FERRY_RETURN_IF_ERROR(lock(flock, true, timeout()));
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
  absl::MutexLock mu_lock(&mu_);
  FileLock flock(fd_);
  FERRY_RETURN_IF_ERROR(lock(flock, true, timeout()));
  FERRY_RETURN_IF_ERROR(refresh());
  auto it = map_.find(av(key));
  bool matches = it == map_.end() ? expected.empty() : it->second == expected;
  if (!matches) return it == map_.end() ? Bytes() : it->second;
  FERRY_RETURN_IF_ERROR(append(Op::kSet, key, desired));
  return desired;
}

absl::StatusOr<bool> FileStore::check(const std::vector<std::string>& keys) {
  absl::MutexLock mu_lock(&mu_);
  FileLock flock(fd_);
  FERRY_RETURN_IF_ERROR(lock(flock, false, timeout()));
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
  absl::MutexLock mu_lock(&mu_);
  FileLock flock(fd_);
  FERRY_RETURN_IF_ERROR(lock(flock, true, timeout()));
  FERRY_RETURN_IF_ERROR(refresh());
  if (!map_.contains(av(key))) return false;
  FERRY_RETURN_IF_ERROR(append(Op::kDelete, key, {}));
  return true;
}

absl::StatusOr<int64_t> FileStore::num_keys() {
  absl::MutexLock mu_lock(&mu_);
  FileLock flock(fd_);
  FERRY_RETURN_IF_ERROR(lock(flock, false, timeout()));
  FERRY_RETURN_IF_ERROR(refresh());
  return static_cast<int64_t>(map_.size());
}

absl::StatusOr<std::vector<Bytes>> FileStore::multi_get(const std::vector<std::string>& keys,
                                                        std::optional<std::chrono::milliseconds> timeout) {
  return await_keys("multi_get", keys, effective(timeout));
}

absl::Status FileStore::multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  if (keys.size() != values.size()) return internal::multi_set_size_error(keys.size(), values.size());
  absl::MutexLock mu_lock(&mu_);
  FileLock flock(fd_);
  FERRY_RETURN_IF_ERROR(lock(flock, true, timeout()));
  // One record: after a crash, all of it or none of it is there.
  Bytes blob;
  auto put_u32 = [&blob](uint32_t v) {
    uint8_t b[4];
    std::memcpy(b, &v, 4);
    blob.insert(blob.end(), b, b + 4);
  };
  uint64_t total = 4;
  for (size_t i = 0; i < keys.size(); ++i) total += 8 + keys[i].size() + values[i].size();
  if (total > UINT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("FileStore ", path_, ": multi_set of ", keys.size(), " keys is larger than 4 GiB"));
  }
  blob.reserve(total);
  put_u32(static_cast<uint32_t>(keys.size()));
  for (size_t i = 0; i < keys.size(); ++i) {
    put_u32(static_cast<uint32_t>(keys[i].size()));
    put_u32(static_cast<uint32_t>(values[i].size()));
    blob.insert(blob.end(), keys[i].begin(), keys[i].end());
    blob.insert(blob.end(), values[i].begin(), values[i].end());
  }
  FERRY_RETURN_IF_ERROR(refresh());
  return append(Op::kSetMany, "", blob);
}

}  // namespace ferry
