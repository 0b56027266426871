// What every AMX kernel here needs (amx_matmul.cc, attention_amx.h): permission for the tile
// state and the one tile configuration they all use, eight 16-row x 64-byte tiles.
// Compiled only where the compiler targets AMX (-march=native on such a CPU).

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace paged_jax_cpu {

// Linux hands a process the AMX tile state only on request (arch_prctl); once per process.
inline bool amx_permitted() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7: 16 rows of 64 bytes (16 f32, or 32 bf16 as 16 pairs). Per thread; the caller
// releases them (_tile_release) when its work is done.
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

}  // namespace paged_jax_cpu

#endif
