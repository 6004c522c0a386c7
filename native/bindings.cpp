// Python bindings of JustFit's native kernels (module justfit_native._ext).
#include <nanobind/nanobind.h>
#include <nanobind/stl/variant.h>

#include "qmatvec.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "JustFit's native kernels for MLX's CPU backend";
  m.def("quantized_matvec", &justfit::quantized_matvec, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a,
        "bits"_a, nb::kw_only(), "stream"_a = nb::none(),
        "x @ dequantize(w, scales, biases).T for MLX's affine-quantized weights (4 or 8 bits), float32.");
}
