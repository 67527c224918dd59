/* AMX tile state, shared by the kernels that multiply through tiles (linear_bf16.c, paged_extend.c): Linux's
 * permission to use it, and the layout of a tile configuration. */
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
#endif

#endif
