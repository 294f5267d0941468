/* What the fp4 C files share (common/codec/native.py builds them into one library): the wire
 * encoding's blocks of 32 values with one E8M0 scale byte each, and per-block helpers. */
#ifndef FP4_BLOCKS_H
#define FP4_BLOCKS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 32
#define E8M0_BIAS 127
#define E8M0_NAN 255
#define MIN_EXP (-127)
#define MAX_EXP 127
/* 2^(byte - 127) for an E8M0 byte other than 255, built from its bits (ldexpf is a libm call
 * per block): exponent field `byte`, or for byte 0 the subnormal 2^-127. */
static inline float e8m0_scale(uint8_t scale_byte)
{
    const uint32_t bits = scale_byte ? (uint32_t)scale_byte << 23 : 1u << 22;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return scale;
}

/* The decoded values of a block's 16 codes (sign bit 3) at scale 2^(byte - 127), exactly as
 * fp4_dequantize computes them: grid[c] * scale in float32. */
static inline void block_lut(const float *grid, uint8_t scale_byte, float lut[16])
{
    const float scale = e8m0_scale(scale_byte);
    for (int c = 0; c < 8; c++) {
        lut[c] = grid[c] * scale;
        lut[c + 8] = -grid[c] * scale;
    }
}

static inline int has_nan_scale(const uint8_t *scales, int64_t n_blocks)
{
    int nan = 0;
    for (int64_t b = 0; b < n_blocks; b++)
        nan |= scales[b] == E8M0_NAN;
    return nan;
}

#endif
