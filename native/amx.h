// AMX tile helpers shared by the AMX kernels (cpu_amx_linear.cpp, cpu_amx_int8_linear.cpp,
// cpu_amx_attention.cpp);
// included only where the compiler targets AMX-TILE.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace modserve {

// Linux hands a process the AMX tile state only on request (once per process, for all its
// threads): 0 when granted.
inline int request_amx() {
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0 ? 0 : -1;
}

// Configures this thread's eight tiles (palette 1): tile t has rows[t] rows (at least 1) of
// 64 bytes. Loading a configuration clears every tile.
inline void configure_tiles(const int (&rows)[8]) {
    struct alignas(64) TileConfig {
        uint8_t palette_id;
        uint8_t start_row;
        uint8_t reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = static_cast<uint8_t>(rows[t] > 0 ? rows[t] : 1);
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

}  // namespace modserve
