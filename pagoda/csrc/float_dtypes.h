// The element types the fused kernels take (float32, bfloat16) and where they round.
#pragma once
#include <ATen/ATen.h>

namespace pagoda_dtypes {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

// Rounds to T and back: where the eager code stores a T intermediate.
template <typename T>
inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

// f(T{}) for the tensor's element type, float32 or bfloat16; anything else is an error.
template <typename F>
void dispatch(const at::Tensor& t, const char* name, F&& f) {
  if (t.scalar_type() == at::kFloat) f(float{});
  else if (t.scalar_type() == at::kBFloat16) f(at::BFloat16{});
  else TORCH_CHECK(false, name, ": float32 or bfloat16 only");
}

}  // namespace pagoda_dtypes
