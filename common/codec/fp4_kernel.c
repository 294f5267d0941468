/* FP4 block quantize / dequantize for CPU float32 buffers (common/codec/native.py loads it).
 *
 * Bit-identical to the pure-torch reference in common/codec/fp4.py (tests/unit/test_fp4_native.py
 * checks it): same scale rule, same round-to-nearest with ties to the even code, same cap near
 * float32's maximum, same packing (element 0 in the low nibble). Built with -ffp-contract=off
 * and without -ffast-math, so every product is one correctly rounded float32 multiply, as in
 * torch. One pass over the data, one block of 32 values at a time, so it runs at memory speed
 * where the torch version makes a dozen full-size temporaries.
 */
#include "fp4_blocks.h"


/* The smallest e with amax <= top * 2^e, clamped to E8M0 (as _block_scale_exponents). */
static int block_exponent(float amax, double top, int top_shift)
{
    if (amax == 0.0f)
        return MIN_EXP;
    int exponent;
    frexpf(amax, &exponent);
    int e = exponent - top_shift;
    if ((double)amax > ldexp(top, e))
        e += 1;
    if (e < MIN_EXP)
        e = MIN_EXP;
    if (e > MAX_EXP)
        e = MAX_EXP;
    return e;
}

/* Quantize one block of 32 values (already zero-padded) into 16 packed bytes.
 * Written as fixed-length loops over the block so the compiler vectorises each of them. */
static void quantize_block(const float *x, int e, const float *mids, const float *grid,
                           uint8_t *packed)
{
    /* 2^-e is exact in float32 for e in [-127, 127] (2^-127 is a subnormal). */
    const float inv_scale = ldexpf(1.0f, -e);
    /* Near float32's maximum the top codes would decode to infinity: cap them. */
    const double headroom = ldexp((double)3.4028234663852886e38, -e);
    int32_t top_code = -1;
    for (int k = 0; k < 8; k++)
        top_code += (double)grid[k] <= headroom;
    float m[BLOCK];
    int32_t code[BLOCK];
    for (int i = 0; i < BLOCK; i++) {
        m[i] = fabsf(x[i] * inv_scale);
        code[i] = 0;
    }
    /* Nearest grid value: the number of midpoints below m; exactly at an odd midpoint k
     * (between codes k and k+1, k odd) one more, so ties go to the even code. */
    for (int k = 0; k < 7; k++) {
        const float mid = mids[k];
        const int32_t odd = k & 1;
        for (int i = 0; i < BLOCK; i++)
            code[i] += (mid < m[i]) + (odd & (mid == m[i]));
    }
    for (int i = 0; i < BLOCK; i++) {
        int32_t c = code[i] < top_code ? code[i] : top_code;
        code[i] = c | ((x[i] < 0.0f) << 3);
    }
    for (int j = 0; j < BLOCK / 2; j++)
        packed[j] = (uint8_t)(code[2 * j] | (code[2 * j + 1] << 4));
}

/* The largest |x| of a block, on the bit patterns: for non-negative floats (NaN excluded,
 * the caller refuses it) integer order is float order, and an integer max vectorises. */
static float block_amax(const float *x)
{
    uint32_t top = 0;
    for (int i = 0; i < BLOCK; i++) {
        uint32_t bits;
        memcpy(&bits, &x[i], sizeof bits);
        bits &= 0x7FFFFFFFu;
        top = bits > top ? bits : top;
    }
    float amax;
    memcpy(&amax, &top, sizeof amax);
    return amax;
}

/* Packed codes ((n+1)/2 bytes) and scale bytes (ceil(n/32)) of n finite floats. */
void fp4_quantize(const float *x, int64_t n, const float *grid, const float *mids, double top,
                  int top_shift, uint8_t *packed, uint8_t *scales)
{
    int64_t full = n / BLOCK;
    for (int64_t b = 0; b < full; b++) {
        const float *block = x + b * BLOCK;
        float amax = block_amax(block);
        int e = block_exponent(amax, top, top_shift);
        scales[b] = (uint8_t)(e + E8M0_BIAS);
        quantize_block(block, e, mids, grid, packed + b * (BLOCK / 2));
    }
    int64_t rest = n - full * BLOCK;
    if (rest > 0) {
        float block[BLOCK] = {0};
        uint8_t tail[BLOCK / 2];
        memcpy(block, x + full * BLOCK, (size_t)rest * sizeof(float));
        float amax = block_amax(block);
        int e = block_exponent(amax, top, top_shift);
        scales[full] = (uint8_t)(e + E8M0_BIAS);
        quantize_block(block, e, mids, grid, tail);
        memcpy(packed + full * (BLOCK / 2), tail, (size_t)(rest + 1) / 2);
    }
}

/* n floats from packed codes and scale bytes. Returns 0, -1 if a scale byte is the E8M0 NaN
 * (nothing written), or the number of values that decoded to infinity. */
int64_t fp4_dequantize(const uint8_t *packed, const uint8_t *scales, int64_t n,
                       const float *grid, float *out)
{
    int64_t n_blocks = (n + BLOCK - 1) / BLOCK;
    for (int64_t b = 0; b < n_blocks; b++)
        if (scales[b] == E8M0_NAN)
            return -1;
    int64_t infinite = 0;
    for (int64_t b = 0; b < n_blocks; b++) {
        const float scale = ldexpf(1.0f, (int)scales[b] - E8M0_BIAS);
        float lut[16];
        for (int c = 0; c < 8; c++) {
            lut[c] = grid[c] * scale;
            lut[c + 8] = -grid[c] * scale;
        }
        const uint8_t *bytes = packed + b * (BLOCK / 2);
        int64_t count = n - b * BLOCK < BLOCK ? n - b * BLOCK : BLOCK;
        float *dst = out + b * BLOCK;
        if (count == BLOCK) {
            for (int j = 0; j < BLOCK / 2; j++) {
                dst[2 * j] = lut[bytes[j] & 0x0F];
                dst[2 * j + 1] = lut[bytes[j] >> 4];
            }
        } else {
            for (int64_t i = 0; i < count; i++)
                dst[i] = lut[(bytes[i / 2] >> (4 * (i % 2))) & 0x0F];
        }
        if (isinf(lut[7]))
            for (int64_t i = 0; i < count; i++)
                infinite += isinf(dst[i]) != 0; /* isinf may be -1 for -inf */
    }
    return infinite;
}
