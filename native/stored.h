// How the native kernels read MLX's affine-quantized storage: scales and biases as
// stored (float16 or float32), the bit width a template parameter.
#pragma once

#include "mlx/types/half_types.h"

namespace justfit {

// f.template operator()<Bits>(scales, biases), the pointers typed as stored.
template <typename F>
inline void with_stored(int bits, bool half, const void* scales, const void* biases, F&& f) {
  auto go = [&](auto* s, auto* b) {
    if (bits == 4)
      f.template operator()<4>(s, b);
    else
      f.template operator()<8>(s, b);
  };
  if (half)
    go(static_cast<const mlx::core::float16_t*>(scales), static_cast<const mlx::core::float16_t*>(biases));
  else
    go(static_cast<const float*>(scales), static_cast<const float*>(biases));
}

}  // namespace justfit
