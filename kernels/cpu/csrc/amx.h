/* AMX tile state, shared by the kernels that multiply through tiles (linear_bf16.c, paged_decode.c,
 * paged_extend.c): Linux's permission to use it, the layout of a tile configuration, the attention kernels'
 * configuration and their P V step. */
#ifndef LLMSERVE_AMX_H
#define LLMSERVE_AMX_H

#if defined(__AMX_TILE__)
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* Linux gives a process AMX's tile state only once asked (else its first tile instruction faults). Each
 * file that includes this asks once for itself; threads racing here ask twice, harmlessly. */
static int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return permitted;
}

/* All eight tiles 16 rows of 64 bytes, as both attention kernels use them. */
static inline void configure_full_tiles(void) {
    struct tile_config config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.bytes_per_row[t] = 64;
    _tile_loadconfig(&config);
}

#if defined(__AMX_BF16__)
/* O += P V for one block of 32 keys, as both attention kernels run it: P's 16 rows (bf16, `p_stride` bytes apart)
 * into tmm0, four blocks of 16 output dimensions of the keys' value pairs (`v_stride` bytes a pair of keys) through
 * tmm1-3, the sums in tmm4-7. */
static inline __attribute__((always_inline)) void tiles_pv(const void *p, long p_stride, const uint16_t *v,
                                                           long v_stride) {
    _tile_loadd(0, p, p_stride);
    _tile_loadd(1, v, v_stride);
    _tile_dpbf16ps(4, 0, 1);
    _tile_loadd(2, v + 32, v_stride);
    _tile_dpbf16ps(5, 0, 2);
    _tile_loadd(3, v + 64, v_stride);
    _tile_dpbf16ps(6, 0, 3);
    _tile_loadd(1, v + 96, v_stride);
    _tile_dpbf16ps(7, 0, 1);
}
#endif
#endif

#endif
