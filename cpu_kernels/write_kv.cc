// Writing a step's new K or V rows into the paged cache, in place, as an XLA FFI call.
//
// Why native code: XLA's CPU scatter has no bf16 path; writing 64 tokens into a bf16 cache
// converted the whole cache to f32 and back. This call copies each new row to its slot in
// the cache buffer it is given, which XLA aliases to its output (the caller passes
// input_output_aliases), so a step writes only its own rows, in any cache dtype.
//
//   cache   f32 or bf16 [num_layers, num_blocks, block_size, Hkv, D]  (aliased to the result)
//   rows    f32[T, Hkv, D]          slots i32[T]: block * block_size + offset within a layer;
//   layer   i32[] (a traced scalar: the scan's layer index, or a constant)
// A slot outside [0, num_blocks * block_size) is padding: dropped, like XLA's mode="drop".
// f32 -> bf16 rounds to nearest even, as XLA's convert does.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, uint16_t* dst) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a (quiet) NaN
    *dst = static_cast<uint16_t>((u >> 16) | 0x40u);
    return;
  }
  *dst = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <ffi::DataType KV>
ffi::Error write_impl(ffi::Buffer<KV> cache, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::S32> slots,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<KV> out) {
  using T = ffi::NativeType<KV>;
  const auto cd = cache.dimensions(), rd = rows.dimensions();
  if (cd.size() != 5 || rd.size() != 3 || rd[1] != cd[3] || rd[2] != cd[4] || slots.element_count() != rd[0])
    return ffi::Error::InvalidArgument("cache [L, blocks, block_size, Hkv, D], rows [T, Hkv, D], slots [T]");
  const int64_t num_slots = cd[1] * cd[2], row = cd[3] * cd[4];
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= cd[0]) return ffi::Error::InvalidArgument("layer index out of range");
  T* dst = out->typed_data();
  if (dst != cache.typed_data())  // not aliased after all: start from a copy of the cache
    std::memcpy(dst, cache.typed_data(), sizeof(T) * cache.element_count());
  const float* src = rows.typed_data();
  const int32_t* slot = slots.typed_data();
  for (int64_t t = 0; t < rd[0]; ++t) {
    if (slot[t] < 0 || slot[t] >= num_slots) continue;
    T* target = dst + (l * num_slots + slot[t]) * row;
    for (int64_t i = 0; i < row; ++i) store(src[t * row + i], target + i);
  }
  return ffi::Error::Success();
}

}  // namespace

#define PAGED_JAX_WRITE_HANDLER(name, KV)                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, write_impl<KV>,                         \
                                ffi::Ffi::Bind()                              \
                                    .Arg<ffi::Buffer<KV>>()                   \
                                    .Arg<ffi::Buffer<ffi::F32>>()             \
                                    .Arg<ffi::Buffer<ffi::S32>>()             \
                                    .Arg<ffi::Buffer<ffi::S32>>()             \
                                    .Ret<ffi::Buffer<KV>>());

PAGED_JAX_WRITE_HANDLER(WriteKvF32, ffi::F32)
PAGED_JAX_WRITE_HANDLER(WriteKvBF16, ffi::BF16)
