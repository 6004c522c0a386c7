// Room the native kernels' threads share or write: whole cache lines, aligned and padded,
// so what one core writes never sits in a line another core reads. A thread's scratch
// allocated beside the rounded input the other threads read made every write of it take
// the line back from them, slowing a lone product.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>
#include <vector>

namespace justfit {

constexpr size_t kLine = 64;

template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) {
    const size_t bytes = (n * sizeof(T) + kLine - 1) / kLine * kLine;
    void* p = std::aligned_alloc(kLine, bytes ? bytes : kLine);
    if (!p) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
};

// A vector in whole cache lines of its own.
template <typename T>
using Lines = std::vector<T, LineAllocator<T>>;

}  // namespace justfit
