// Uses the installed torch component: an at::Tensor through a payload and DLPack,
// checking that the bytes were never copied.
#include <ATen/Functions.h>

#include <iostream>

#include "dlpack/convert.h"
#include "torch/wire.h"

int main() {
  at::Tensor t = at::arange(8192, at::kFloat);  // 32 KiB: out of band
  ferry::Message m(ferry::MessageType::kRequest, 1);
  {
    ferry::PayloadWriter w(m);
    w(t);
  }
  auto back = ferry::read_payload<at::Tensor>(m);
  auto dl = ferry::to_dlpack(m.tensors().at(0));
  bool same = back.ok() && std::get<0>(*back).data_ptr() == t.data_ptr() && dl.ok() &&
              (*dl)->dl_tensor.data == t.data_ptr();
  std::cout << "consumer_torch: " << (same ? "same pointer" : "COPIED") << "\n";
  return same ? 0 : 1;
}
