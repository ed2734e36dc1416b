#include <cstring>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "serialization/error.h"
#include "serialization/message.h"
#include "serialization/types.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

struct Point {
  int32_t x = 0;
  double y = 0;
  std::vector<std::string> tags;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(x, y, tags);
  }
  friend bool operator==(const Point&, const Point&) = default;
};

// Seals and re-parses, as the transport would.
Message over_the_wire(Message m) {
  std::vector<Tensor> tensors = m.tensors();
  std::string wire = m.seal();
  absl::StatusOr<Message> back = Message::parse(std::move(wire), std::move(tensors));
  EXPECT_TRUE(back.ok()) << back.status();
  return *std::move(back);
}

TEST(Message, HeaderRoundTrips) {
  Message m(MessageType::kError, 0x0123456789abcdefULL);
  m.buffer() += "payload";
  Message back = over_the_wire(std::move(m));
  EXPECT_EQ(back.type(), MessageType::kError);
  EXPECT_EQ(back.id(), 0x0123456789abcdefULL);
  EXPECT_EQ(back.payload(), "payload");
}

// A request carries its caller's timeout, so a server can drop it once the caller
// gave up (issue 27, finding 10).
TEST(Message, ARequestsTimeoutRoundTripsAndCanBeRewrittenWhenSealed) {
  EXPECT_FALSE(Message(MessageType::kRequest, 1).timeout().has_value());
  Message m(MessageType::kRequest, 1);
  m.set_timeout(std::chrono::milliseconds(2500));
  EXPECT_EQ(over_the_wire(m).timeout(), std::chrono::milliseconds(2500));
  m.set_timeout(std::chrono::milliseconds(0));  // none
  EXPECT_FALSE(over_the_wire(m).timeout().has_value());
  m.set_timeout(std::chrono::hours(24 * 365));  // saturates at ~49 days
  EXPECT_EQ(over_the_wire(m).timeout(), std::chrono::milliseconds(UINT32_MAX));
  Message held(MessageType::kRequest, 7);
  held.set_timeout(std::chrono::milliseconds(900));
  std::string wire = held.seal();
  Message::reseal_timeout(wire, std::chrono::milliseconds(40));
  absl::StatusOr<Message> back = Message::parse(std::move(wire), {});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->timeout(), std::chrono::milliseconds(40));
  EXPECT_EQ(back->id(), 7u);
}

TEST(Message, ARequestNamesWhatItCallsAndAnythingElseIsUnnamed) {
  Message request(MessageType::kRequest, 1);
  {
    PayloadWriter w(request);
    w(std::string("add"));
    request.set_function_size(3);
    w(std::string("int64, int64 -> int64"), int64_t{1});
  }
  EXPECT_EQ(request.function(), "add");
  // The same after the trip over the wire, read from the header's size alone.
  absl::StatusOr<Message> back = Message::parse(request.seal(), {});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->function(), "add");
  EXPECT_EQ(request.function(), "") << "sealed: the buffer went with the wire";

  Message response(MessageType::kResponse, 1);
  {
    PayloadWriter w(response);
    w(std::string("add"));
  }
  response.set_function_size(3);
  EXPECT_EQ(response.function(), "") << "only requests carry a name";
  Message unnamed(MessageType::kRequest, 2);
  {
    PayloadWriter w(unnamed);
    w(std::string("add"));
  }
  EXPECT_EQ(unnamed.function(), "") << "its writer did not name it";
  // A size the payload does not open with, or longer than any name, is not taken.
  Message wrong(MessageType::kRequest, 3);
  {
    PayloadWriter w(wrong);
    w(std::string("add"));
  }
  wrong.set_function_size(4);
  EXPECT_EQ(wrong.function(), "");
  Message long_name(MessageType::kRequest, 5);
  {
    PayloadWriter w(long_name);
    w(std::string(Message::kMaxFunctionSize + 1, 'f'));
  }
  long_name.set_function_size(Message::kMaxFunctionSize + 1);
  EXPECT_EQ(long_name.function(), "");
}

// A header whose name the payload does not open with is refused, not read past.
TEST(Message, AHeaderThatNamesWhatThePayloadLacksIsRefused) {
  Message request(MessageType::kRequest, 1);
  {
    PayloadWriter w(request);
    w(std::string("add"));
    request.set_function_size(3);
  }
  const std::string wire = request.seal();
  for (uint16_t size : {uint16_t{2}, uint16_t{4}, uint16_t{500}, uint16_t{65535}}) {
    std::string forged = wire;
    std::memcpy(forged.data() + 16, &size, 2);
    EXPECT_THAT(Message::parse(std::move(forged), {}),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("names a function of")))
        << size;
  }
  std::string reply = wire;
  reply[3] = static_cast<char>(MessageType::kResponse);
  EXPECT_THAT(Message::parse(std::move(reply), {}), StatusIs(absl::StatusCode::kDataLoss))
      << "only a request is named";
  std::string cut = wire.substr(0, Message::kFunctionOffset + 2);
  EXPECT_THAT(Message::parse(std::move(cut), {}), StatusIs(absl::StatusCode::kDataLoss));
}

// Sealing hands the buffer out whole; the message can be written and sealed again.
TEST(Message, ASealedMessageCanBeWrittenAgain) {
  Message m(MessageType::kRequest, 3);
  m.buffer() += "first";
  std::string wire = m.seal();
  EXPECT_EQ(wire.size(), Message::kHeaderSize + 5);
  EXPECT_TRUE(m.payload().empty());
  EXPECT_EQ(Message::parse(m.seal(), {}).value().payload(), "");
  m.buffer() += "second";
  absl::StatusOr<Message> back = Message::parse(m.seal(), {});
  ASSERT_OK(back.status());
  EXPECT_EQ(back->payload(), "second");
  EXPECT_EQ(back->id(), 3u);
  EXPECT_EQ(Message::parse(std::move(wire), {}).value().payload(), "first");
}

TEST(Message, RejectsBadHeaders) {
  EXPECT_THAT(Message::parse("short", {}), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("shorter than its 20-byte header")));
  std::string garbage(32, 'x');
  EXPECT_THAT(Message::parse(garbage, {}), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("not a ferry message")));
  Message m(MessageType::kRequest, 1);
  std::string wire = m.seal();
  wire[2] = 9;
  EXPECT_THAT(Message::parse(wire, {}), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("wire version 9")));
  wire[2] = Message::kVersion;
  wire[3] = 77;
  EXPECT_THAT(Message::parse(wire, {}), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("unknown type 77")));
}

TEST(Payload, ValuesOfEveryKindRoundTrip) {
  Message m(MessageType::kResponse, 1);
  std::map<std::string, std::optional<std::tuple<int64_t, bool>>> nested = {{"a", std::make_tuple(int64_t{5}, true)},
                                                                           {"b", std::nullopt}};
  Point p{3, 2.5, {"u", "v"}};
  {
    PayloadWriter w(m);
    w(int8_t{-1}, uint64_t{1} << 60, 1.5f, std::string("hello"), nested, p);
  }
  Message back = over_the_wire(std::move(m));
  auto v = read_payload<int8_t, uint64_t, float, std::string, decltype(nested), Point>(back);
  ASSERT_OK(v.status());
  EXPECT_EQ(std::get<0>(*v), -1);
  EXPECT_EQ(std::get<1>(*v), uint64_t{1} << 60);
  EXPECT_EQ(std::get<2>(*v), 1.5f);
  EXPECT_EQ(std::get<3>(*v), "hello");
  EXPECT_EQ(std::get<4>(*v), nested);
  EXPECT_EQ(std::get<5>(*v), p);
}

TEST(Payload, SmallTensorsInlineLargeOnesInTheTable) {
  Tensor small = Tensor::from_vector<float>({1, 2, 3});
  Tensor large = *Tensor::zeros({kDefaultInlineTensorBytes / 4 + 1}, DType::kFloat32);
  Message m(MessageType::kRequest, 1);
  {
    PayloadWriter w(m);
    w(small, large, Tensor());
  }
  ASSERT_EQ(m.tensors().size(), 1u);
  EXPECT_EQ(m.tensors()[0].data(), large.data()) << "a table tensor must not be copied";
  Message back = over_the_wire(std::move(m));
  auto v = read_payload<Tensor, Tensor, Tensor>(back);
  ASSERT_OK(v.status());
  EXPECT_TRUE(std::get<0>(*v).equal(small));
  EXPECT_TRUE(std::get<1>(*v).equal(large));
  EXPECT_FALSE(std::get<2>(*v).defined());
}

TEST(Payload, TruncatedOrHostileInputIsAnErrorNotACrash) {
  Message m(MessageType::kResponse, 1);
  {
    PayloadWriter w(m);
    w(std::string("hello world"), int64_t{7});
  }
  std::string wire = m.seal();
  // Every truncation point decodes to an error.
  for (size_t cut = Message::kHeaderSize; cut < wire.size(); ++cut) {
    Message part = *Message::parse(wire.substr(0, cut), {});
    EXPECT_THAT((read_payload<std::string, int64_t>(part)), StatusIs(absl::StatusCode::kInvalidArgument)) << cut;
  }
  // A huge declared string length does not allocate: it exceeds the bytes present.
  Message hostile(MessageType::kResponse, 1);
  uint64_t huge = uint64_t{1} << 62;
  hostile.buffer().append(reinterpret_cast<const char*>(&huge), 8);
  EXPECT_THAT(read_payload<std::string>(hostile),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("declares 4611686018427387904 elements")));
  // Trailing bytes are reported.
  Message extra = *Message::parse(wire + "zz", {});
  EXPECT_THAT((read_payload<std::string, int64_t>(extra)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 unexpected bytes")));
  // A bool byte that is neither 0 nor 1.
  Message bad_bool(MessageType::kResponse, 1);
  bad_bool.buffer().push_back(7);
  EXPECT_THAT(read_payload<bool>(bad_bool), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("invalid bool")));
}

TEST(Payload, BadTensorRecordsAreErrors) {
  Tensor large = *Tensor::zeros({64 * 1024}, DType::kUInt8);
  Message m(MessageType::kResponse, 1);
  {
    PayloadWriter w(m);
    w(large);
  }
  std::string wire = m.seal();
  // The tensor table is missing.
  EXPECT_THAT(read_payload<Tensor>(*Message::parse(wire, {})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor table index 0 out of range (0 tensors")));
  // The received buffer has the wrong size.
  Tensor wrong = *Tensor::zeros({10}, DType::kUInt8);
  EXPECT_THAT(read_payload<Tensor>(*Message::parse(wire, {wrong})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("declares 65536 bytes but 10 were received")));
  // An invalid dtype byte.
  std::string bad = wire;
  bad[Message::kHeaderSize + 1] = 42;
  EXPECT_THAT(read_payload<Tensor>(*Message::parse(bad, {large})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("invalid dtype 42")));
  // A negative dimension.
  std::string neg = wire;
  int64_t minus = -5;
  std::memcpy(neg.data() + Message::kHeaderSize + 6, &minus, 8);
  EXPECT_THAT(read_payload<Tensor>(*Message::parse(neg, {large})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative dimension")));
}

TEST(Payload, HugeDeclaredShapesAreRejectedBeforeAllocating) {
  Message m(MessageType::kResponse, 1);
  {
    PayloadWriter w(m);
    w(Tensor::from_vector<double>({1.0}));
  }
  std::string wire = m.seal();
  // Rewrite the one dimension to 2^61: the byte count would wrap to 0.
  std::string huge = wire;
  int64_t dim = int64_t{1} << 61;
  std::memcpy(huge.data() + Message::kHeaderSize + 6, &dim, 8);
  EXPECT_THAT(read_payload<Tensor>(*Message::parse(huge, {})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more bytes than")));
  // The same shape through the tensor table.
  Message table(MessageType::kResponse, 1);
  {
    PayloadWriter w(table, /*inline_threshold=*/0);
    w(Tensor::from_vector<double>({1.0}));
  }
  std::vector<Tensor> received = table.tensors();
  std::string wire2 = table.seal();
  std::memcpy(wire2.data() + Message::kHeaderSize + 6, &dim, 8);
  EXPECT_THAT(read_payload<Tensor>(*Message::parse(wire2, received)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too large")));
}

// A hostile count no larger than the bytes left, but larger than those bytes can hold
// at the element type's smallest encoding, is refused before the vector is sized.
TEST(Payload, CountsAreCheckedAgainstTheElementsSmallestEncoding) {
  auto payload_with_count = [](uint64_t count, size_t filler) {
    Message m(MessageType::kResponse, 1);
    m.buffer().append(reinterpret_cast<const char*>(&count), 8);
    m.buffer().append(filler, '\0');
    return m;
  };
  // 800 bytes left: 800 one-byte elements would fit, 800 int64s need 6400.
  EXPECT_THAT(read_payload<std::vector<int64_t>>(payload_with_count(800, 800)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("declares 800 elements of at least 8 bytes each but only 800 bytes are left")));
  EXPECT_THAT(read_payload<std::vector<std::string>>(payload_with_count(800, 800)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("of at least 8 bytes each")));
  EXPECT_THAT(read_payload<std::vector<std::vector<double>>>(payload_with_count(101, 800)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("of at least 8 bytes each")));
  EXPECT_THAT((read_payload<std::vector<std::pair<int32_t, double>>>(payload_with_count(67, 800))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("of at least 12 bytes each")));
  EXPECT_THAT((read_payload<std::vector<std::tuple<int64_t, std::string, Tensor>>>(payload_with_count(50, 800))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("of at least 17 bytes each")));
  // Honest counts still decode, including vectors of bools and of empty-ish values.
  Message ok(MessageType::kResponse, 1);
  {
    PayloadWriter w(ok);
    w(std::vector<int64_t>{1, 2, 3}, std::vector<std::string>{"a", ""}, std::vector<bool>{true, false},
      std::vector<std::optional<int32_t>>{std::nullopt, 5});
  }
  auto back = read_payload<std::vector<int64_t>, std::vector<std::string>, std::vector<bool>,
                           std::vector<std::optional<int32_t>>>(ok);
  ASSERT_OK(back.status());
  EXPECT_EQ(std::get<0>(*back), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(std::get<1>(*back)[0], "a");
  EXPECT_EQ(std::get<3>(*back)[1], 5);
}

// A large value that encodes in one byte (a bool): a count checked against the
// encoding's one byte per element says nothing of the memory 16 KiB elements take.
struct Bulky {
  bool flag = false;
  char pad[16 * 1024] = {};
  template <class Archive>
  void serialize(Archive& ar) {
    ar(flag);
  }
};

// This process's peak resident memory (VmHWM) in bytes.
uint64_t peak_rss() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

// Issue 27, finding 4: a vector was sized n * sizeof(T) from a count that was only
// checked against the bytes left (1 per Tensor, optional or user struct): a 1 GiB
// payload for a std::vector<Tensor> made about 64 GiB. It now grows as elements decode.
TEST(Payload, AVectorGrowsWithItsElementsNotWithItsCount) {
  auto payload_with_count = [](uint64_t count, size_t filler, char fill) {
    Message m(MessageType::kResponse, 1);
    m.buffer().append(reinterpret_cast<const char*>(&count), 8);
    m.buffer().append(filler, fill);
    return m;
  };
  // A count of 2^30 with a few bytes: a clear error, nothing allocated.
  EXPECT_THAT(read_payload<std::vector<Tensor>>(payload_with_count(uint64_t{1} << 30, 16, '\0')),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("declares 1073741824 elements")));
  // 32,768 one-byte elements are present, but invalid from the first: sized up front
  // that was 512 MiB. Measured in a child, whose peak starts small.
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(1, [&](int) {
    Message m = payload_with_count(32768, 32768, '\x07');
    const uint64_t before = peak_rss();
    EXPECT_THAT(read_payload<std::vector<Bulky>>(m),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("invalid bool byte")));
    EXPECT_LT(peak_rss(), before + (64u << 20)) << "peak before: " << before;
  }));
  // Honest ones still decode.
  Message ok(MessageType::kResponse, 1);
  {
    PayloadWriter w(ok);
    Tensor t = *Tensor::zeros({2}, DType::kInt32);
    w(std::vector<Tensor>{t, Tensor(), t}, std::vector<std::optional<int32_t>>{1, std::nullopt});
  }
  auto back = read_payload<std::vector<Tensor>, std::vector<std::optional<int32_t>>>(ok);
  ASSERT_OK(back.status());
  EXPECT_EQ(std::get<0>(*back).size(), 3u);
  EXPECT_FALSE(std::get<0>(*back)[1].defined());
  EXPECT_EQ(std::get<1>(*back), (std::vector<std::optional<int32_t>>{1, std::nullopt}));
}

// Found by fuzz/payload_fuzz.cc: a 0-dim tensor's empty shape made the reader pass a
// null pointer to memcpy (undefined behaviour, reported by UBSan in the sanitizer build).
TEST(Payload, ZeroDimTensorsAndEmptyVectorsRoundTrip) {
  Message m(MessageType::kResponse, 1);
  Tensor scalar = *Tensor::zeros({}, DType::kInt64);
  {
    PayloadWriter w(m);
    w(scalar, std::vector<int64_t>{}, std::vector<std::string>{});
  }
  auto back = read_payload<Tensor, std::vector<int64_t>, std::vector<std::string>>(m);
  ASSERT_OK(back.status());
  EXPECT_EQ(std::get<0>(*back).dim(), 0);
  EXPECT_EQ(std::get<0>(*back).numel(), 1);
  EXPECT_TRUE(std::get<1>(*back).empty());
}

TEST(MessageSize, AnnouncedBytesAreCheckedAgainstTheLimitWithoutOverflow) {
  std::vector<uint64_t> fine{1000, 2000};
  EXPECT_OK(check_message_size(100, fine, 3100));
  EXPECT_THAT(check_message_size(101, fine, 3100),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("announces 3101 bytes"), HasSubstr("largest tensor (#1) has 2000 bytes"),
                             HasSubstr("limit of 3100 bytes"), HasSubstr("FERRY_MAX_MESSAGE_BYTES"))));
  // A peer announcing a 1 TiB tensor, with the default limit.
  std::vector<uint64_t> tib{uint64_t{1} << 40};
  EXPECT_THAT(check_message_size(64, tib), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("1099511627776")));
  // Lengths whose sum wraps around 2^64.
  std::vector<uint64_t> wrap{UINT64_MAX, 2};
  EXPECT_THAT(check_message_size(0, wrap, UINT64_MAX),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("more than 2^64")));
  EXPECT_OK(check_message_size(0, {}, 0));
  EXPECT_EQ(max_message_bytes(), kDefaultMaxMessageBytes);
}

TEST(ErrorMessage, CarriesCodeAndText) {
  Message m = make_error_message(9, "worker3", absl::NotFoundError("worker3: no function named \"f\""));
  EXPECT_EQ(m.type(), MessageType::kError);
  EXPECT_EQ(m.id(), 9u);
  Message back = over_the_wire(std::move(m));
  EXPECT_THAT(error_from_message(back), StatusIs(absl::StatusCode::kNotFound, "worker3: no function named \"f\""));
  Message broken(MessageType::kError, 1);
  broken.buffer() += "\x01";
  EXPECT_THAT(error_from_message(broken), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("error payload")));
}

TEST(Signature, NamesTypes) {
  EXPECT_EQ((signature<int64_t, const std::string&, std::vector<Tensor>>()), "(int64, string, vector<Tensor>)");
  EXPECT_EQ((signature<std::map<std::string, std::optional<double>>, std::tuple<int8_t, bool>>()),
            "(map<string, optional<float64>>, tuple<int8, bool>)");
  EXPECT_EQ(signature<>(), "()");
  EXPECT_EQ(signature<Point>(), "(ferry::(anonymous namespace)::Point)");
}

}  // namespace
}  // namespace ferry
