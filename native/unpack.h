// MLX's affine-quantized weights unpacked for the kernels that read rows of them (the
// matvecs, dequantize): 4-bit as nibbles, 8-bit as bytes, 5 and 6 bits as a little-endian
// bit stream (value j at bits [j * Bits, (j + 1) * Bits)), 32 values at a time.
#pragma once

#include <cstdint>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace justfit {

// Widths the matvec kernels read as a bit stream (4 and 8 have their own paths).
constexpr bool streamed_width(int bits) { return bits == 5 || bits == 6; }

// Value j of a bit-stream row, portably.
template <int Bits>
inline uint32_t stream_value(const uint8_t* src, int j) {
  const int bit = j * Bits, shift = bit & 7;
  uint32_t v = src[bit >> 3] >> shift;
  if (shift + Bits > 8) v |= static_cast<uint32_t>(src[(bit >> 3) + 1]) << (8 - shift);
  return v & ((1u << Bits) - 1);
}

// A group's values as floats, portably.
template <int Bits>
inline void unpack_group(const uint8_t* src, float* dst, int group_size) {
  // 4 bits: value 2k is byte k's low nibble, 2k + 1 its high one (a bit stream too)
  for (int j = 0; j < group_size; ++j) dst[j] = static_cast<float>(Bits == 8 ? src[j] : stream_value<Bits>(src, j));
}

#ifdef __AVX2__
// For 32 values (4 * Bits bytes) as two vectors of 16 16-bit lanes: the two source bytes
// each lane takes (values 0-15 from a 16-byte load at the block's start, 16-31 from one
// ending at its end, so nothing past the block is read), and the multiplier that puts
// the value's lowest bit at bit 8 (a variable shift AVX2 lacks for 16-bit lanes).
template <int Bits>
struct WordLanes {
  static_assert(Bits > 4 && Bits < 8, "4 * Bits bytes must hold a 16-byte load");
  alignas(32) int8_t picks[2][32] = {};
  alignas(32) int16_t multipliers[16] = {};
  constexpr WordLanes() {
    for (int set = 0; set < 2; ++set)
      for (int v = 0; v < 16; ++v) {
        const int bit = (16 * set + v) * Bits, shift = bit & 7, at = (v / 8) * 16 + (v % 8) * 2;
        const int byte = (bit >> 3) - (set ? 4 * Bits - 16 : 0);
        picks[set][at] = static_cast<int8_t>(byte);
        picks[set][at + 1] = static_cast<int8_t>(shift + Bits > 8 ? byte + 1 : -128);  // -128: a zero byte
        multipliers[v] = static_cast<int16_t>(1 << (8 - shift));  // the same for both sets
      }
  }
};
template <int Bits>
constexpr WordLanes<Bits> kWordLanes{};

// 32 consecutive values, in order, as 16-bit lanes: values 0-15 in `lo`, 16-31 in `hi`.
template <int Bits>
inline void words32(const uint8_t* src, __m256i& lo, __m256i& hi) {
  const auto& t = kWordLanes<Bits>;
  const __m256i a = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m256i b = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 4 * Bits - 16)));
  const __m256i multipliers = _mm256_load_si256(reinterpret_cast<const __m256i*>(t.multipliers));
  const __m256i mask = _mm256_set1_epi16((1 << Bits) - 1);
  auto take = [&](__m256i bytes, const int8_t* picks) {
    const __m256i words = _mm256_shuffle_epi8(bytes, _mm256_load_si256(reinterpret_cast<const __m256i*>(picks)));
    return _mm256_and_si256(_mm256_srli_epi16(_mm256_mullo_epi16(words, multipliers), 8), mask);
  };
  lo = take(a, t.picks[0]);
  hi = take(b, t.picks[1]);
}

// The same 32 values as bytes, in order.
template <int Bits>
inline __m256i bytes32(const uint8_t* src) {
  __m256i lo, hi;
  words32<Bits>(src, lo, hi);
  return _mm256_permute4x64_epi64(_mm256_packus_epi16(lo, hi), 0xD8);
}

// 32 consecutive values, in order, as four vectors of 8 floats.
template <int Bits>
inline void floats32(const uint8_t* src, __m256 q[4]) {
  if constexpr (Bits == 4) {  // 16 bytes; value 2k is byte k's low nibble, 2k + 1 its high one
    const __m128i mask = _mm_set1_epi8(15);
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    __m128i a = _mm_unpacklo_epi8(lo, hi), b = _mm_unpackhi_epi8(lo, hi);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
  } else if constexpr (Bits == 8) {
    for (int k = 0; k < 4; ++k)
      q[k] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * k))));
  } else if constexpr (Bits < 4) {  // 2 and 3 bits (allocated key channels): rare enough to unpack one by one
    alignas(32) float v[32];
    for (int j = 0; j < 32; ++j) v[j] = static_cast<float>(stream_value<Bits>(src, j));
    for (int k = 0; k < 4; ++k) q[k] = _mm256_load_ps(v + 8 * k);
  } else {
    __m256i lo, hi;
    words32<Bits>(src, lo, hi);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(lo)));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(lo, 1)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(hi)));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(hi, 1)));
  }
}
#endif

}  // namespace justfit
