// File: tensor/device.h
//
// Device: where a tensor's bytes live, CPU or one CUDA device. Parsed from and
// printed as "cpu" and "cuda:1" (a bare "cuda" means cuda:0).
//
//   absl::StatusOr<Device> d = Device::parse("cuda:1");
//   d->to_string();  // "cuda:1"
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace ferry {

enum class DeviceType : int8_t { kCpu = 0, kCuda = 1 };

// A value type; cheap to copy; thread-compatible.
class Device {
 public:
  // The CPU.
  constexpr Device() = default;
  static constexpr Device cpu() { return Device(); }
  // cuda:index. The index is not checked against the machine here; allocation is.
  static constexpr Device cuda(int index) { return Device(DeviceType::kCuda, index); }

  // Parses "cpu", "cuda" or "cuda:N" (N a non-negative decimal integer).
  static absl::StatusOr<Device> parse(std::string_view text);

  constexpr DeviceType type() const { return type_; }
  // -1 for the CPU.
  constexpr int index() const { return index_; }
  constexpr bool is_cpu() const { return type_ == DeviceType::kCpu; }
  constexpr bool is_cuda() const { return type_ == DeviceType::kCuda; }
  std::string to_string() const;

  friend constexpr bool operator==(const Device&, const Device&) = default;
  // CPU first, then CUDA devices by index.
  friend constexpr bool operator<(const Device& a, const Device& b) {
    return a.type_ != b.type_ ? a.type_ < b.type_ : a.index_ < b.index_;
  }
  template <typename H>
  friend H AbslHashValue(H h, const Device& d) {
    return H::combine(std::move(h), d.type_, d.index_);
  }
  // cereal support: travels as its string form.
  template <class Archive>
  std::string save_minimal(const Archive&) const { return to_string(); }
  template <class Archive>
  void load_minimal(const Archive&, const std::string& text);

 private:
  constexpr Device(DeviceType type, int index) : type_(type), index_(index) {}

  DeviceType type_ = DeviceType::kCpu;
  int index_ = -1;
};

std::ostream& operator<<(std::ostream& os, const Device& device);

namespace internal {
// Used by cereal's load_minimal, which cannot return a status: throws
// std::invalid_argument, which the deserializer turns into a status.
Device parse_device_or_throw(std::string_view text);
}  // namespace internal

template <class Archive>
void Device::load_minimal(const Archive&, const std::string& text) {
  *this = internal::parse_device_or_throw(text);
}

}  // namespace ferry
