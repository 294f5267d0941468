/* FP4 block quantize / dequantize for CPU float32 buffers (common/fp4_native.py loads it).
 *
 * Bit-identical to the pure-torch reference in common/codec.py (tests/unit/test_fp4_native.py
 * checks it): same scale rule, same round-to-nearest with ties to the even code, same cap near
 * float32's maximum, same packing (element 0 in the low nibble). Built with -ffp-contract=off
 * and without -ffast-math, so every product is one correctly rounded float32 multiply, as in
 * torch. One pass over the data, one block of 32 values at a time, so it runs at memory speed
 * where the torch version makes a dozen full-size temporaries.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 32
#define E8M0_BIAS 127
#define E8M0_NAN 255
#define MIN_EXP (-127)
#define MAX_EXP 127

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

/* ---- Server ingest: statistics and accumulation straight from the wire encoding ----------
 *
 * server/ingest.py validates a push (finite values, norm, largest magnitude) before it takes
 * the aggregator's lock, then adds weight * value to the round's float32 sum (under the lock,
 * or after it for pushes added together: server/round_adds.py). Both run here in one pass over the packed codes each, with no float32 copy of the push.
 */

/* 2^(byte - 127) for an E8M0 byte other than 255, built from its bits (ldexpf is a libm call
 * per block): exponent field `byte`, or for byte 0 the subnormal 2^-127. */
static float e8m0_scale(uint8_t scale_byte)
{
    const uint32_t bits = scale_byte ? (uint32_t)scale_byte << 23 : 1u << 22;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return scale;
}

/* The decoded values of a block's 16 codes (sign bit 3) at scale 2^(byte - 127), exactly as
 * fp4_dequantize computes them: grid[c] * scale in float32. */
static void block_lut(const float *grid, uint8_t scale_byte, float lut[16])
{
    const float scale = e8m0_scale(scale_byte);
    for (int c = 0; c < 8; c++) {
        lut[c] = grid[c] * scale;
        lut[c + 8] = -grid[c] * scale;
    }
}

static int has_nan_scale(const uint8_t *scales, int64_t n_blocks)
{
    int nan = 0;
    for (int64_t b = 0; b < n_blocks; b++)
        nan |= scales[b] == E8M0_NAN;
    return nan;
}

/* Each grid value squared as an integer number of units of 2^-shift, below 2^16 (E2M1: units
 * of 1/4, E3M0: of 2^-12); returns shift, or -1 when no shift up to 40 makes them so. */
static int square_units(const float *grid, uint16_t units[8])
{
    for (int shift = 0; shift <= 40; shift++) {
        int ok = 1;
        for (int c = 0; c < 8 && ok; c++) {
            const double u = ldexp((double)grid[c] * grid[c], shift);
            ok = u == floor(u) && u < 65536.0;
            units[c] = ok ? (uint16_t)u : 0;
        }
        if (ok)
            return shift;
    }
    return -1;
}

/* Per-scale totals of fp4_stats: for each scale byte, the sum over its blocks of the squared
 * magnitudes in units (an exact integer) and the largest magnitude code. */
struct scale_totals {
    uint64_t units[256];
    uint8_t top[256];
};

static void add_block(struct scale_totals *t, uint8_t scale_byte, uint64_t units, int top)
{
    t->units[scale_byte] += units;
    t->top[scale_byte] = top > t->top[scale_byte] ? (uint8_t)top : t->top[scale_byte];
}

/* Adds `count` blocks of 32 codes (16 bytes each) to the per-scale totals. */
static void add_blocks_scalar(const uint8_t *packed, const uint8_t *scales, int64_t count,
                              const uint16_t units[8], struct scale_totals *t)
{
    for (int64_t b = 0; b < count; b++) {
        uint32_t sum = 0;
        int top = 0;
        for (int j = 0; j < BLOCK / 2; j++) {
            const uint8_t byte = packed[b * (BLOCK / 2) + j];
            const int lo = byte & 7, hi = (byte >> 4) & 7;
            sum += units[lo] + units[hi];
            top = lo > top ? lo : top;
            top = hi > top ? hi : top;
        }
        add_block(t, scales[b], sum, top);
    }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
/* add_blocks_scalar, two blocks (32 bytes) per step: the squares by table lookup (pshufb on
 * the low and high bytes of the units), summed per block by psadbw; the top code by byte max. */
__attribute__((target("avx2"))) static void add_blocks_avx2(
    const uint8_t *packed, const uint8_t *scales, int64_t count, const uint16_t units[8],
    struct scale_totals *t)
{
    uint8_t low_bytes[16] = {0}, high_bytes[16] = {0};
    for (int c = 0; c < 8; c++) {
        low_bytes[c] = (uint8_t)(units[c] & 0xFF);
        high_bytes[c] = (uint8_t)(units[c] >> 8);
    }
    const __m256i low_table =
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)low_bytes));
    const __m256i high_table =
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)high_bytes));
    const __m256i seven = _mm256_set1_epi8(7), zero = _mm256_setzero_si256();
    int64_t b = 0;
    for (; b + 2 <= count; b += 2) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(packed + b * (BLOCK / 2)));
        const __m256i even = _mm256_and_si256(x, seven);                      /* low nibbles */
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(x, 4), seven); /* high ones */
        const __m256i low = _mm256_add_epi64(
            _mm256_sad_epu8(_mm256_shuffle_epi8(low_table, even), zero),
            _mm256_sad_epu8(_mm256_shuffle_epi8(low_table, odd), zero));
        const __m256i high = _mm256_add_epi64(
            _mm256_sad_epu8(_mm256_shuffle_epi8(high_table, even), zero),
            _mm256_sad_epu8(_mm256_shuffle_epi8(high_table, odd), zero));
        /* Each block's squares: its two 64-bit sums added, in the low half of its lane.
         * Read out with extracts, not a store and scalar loads: a narrower load from part of
         * a wider store waited for the store, which made this loop twice as slow. */
        __m256i sums = _mm256_add_epi64(low, _mm256_slli_epi64(high, 8));
        sums = _mm256_add_epi64(sums, _mm256_srli_si256(sums, 8));
        __m256i top = _mm256_max_epu8(even, odd); /* per 128-bit lane = per block */
        top = _mm256_max_epu8(top, _mm256_srli_si256(top, 8));
        top = _mm256_max_epu8(top, _mm256_srli_si256(top, 4));
        top = _mm256_max_epu8(top, _mm256_srli_si256(top, 2));
        top = _mm256_max_epu8(top, _mm256_srli_si256(top, 1));
        const __m128i first = _mm256_castsi256_si128(sums);
        const __m128i second = _mm256_extracti128_si256(sums, 1);
        add_block(t, scales[b], (uint64_t)_mm_cvtsi128_si64(first), _mm256_extract_epi8(top, 0));
        add_block(t, scales[b + 1], (uint64_t)_mm_cvtsi128_si64(second),
                  _mm256_extract_epi8(top, 16));
    }
    add_blocks_scalar(packed + b * (BLOCK / 2), scales + b, count - b, units, t);
}
#endif

static void add_blocks(const uint8_t *packed, const uint8_t *scales, int64_t count,
                       const uint16_t units[8], struct scale_totals *t)
{
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    if (__builtin_cpu_supports("avx2")) {
        add_blocks_avx2(packed, scales, count, units, t);
        return;
    }
#endif
    add_blocks_scalar(packed, scales, count, units, t);
}

/* Sum of squares (float64) and largest magnitude of n packed values, without decoding them
 * to memory. Returns like fp4_dequantize: -1 for a NaN scale byte anywhere (checked first,
 * nothing else reported), else the number of values that decode to infinity (then the
 * outputs are meaningless); -2 for a grid whose squares are not whole 16-bit units.
 *
 * A decoded value is grid[c] * 2^e, exact in float32 (the grids have at most two significant
 * bits; infinities are refused), so its square is an exact whole number of units times
 * 2^(2e): the squares are summed per scale byte in integers (exactly), and only the final sum
 * over the 255 scales rounds, so the result can differ from a float64 dot product of the
 * decoded values in the last bits. */
int64_t fp4_stats(const uint8_t *packed, const uint8_t *scales, int64_t n, const float *grid,
                  double *squares, float *max_abs)
{
    const int64_t n_blocks = (n + BLOCK - 1) / BLOCK, full = n / BLOCK;
    *squares = 0.0;
    *max_abs = 0.0f;
    if (has_nan_scale(scales, n_blocks))
        return -1;
    uint16_t units[8];
    const int shift = square_units(grid, units);
    if (shift < 0)
        return -2;
    static const struct scale_totals empty;
    struct scale_totals t = empty;
    add_blocks(packed, scales, full, units, &t);
    if (full < n_blocks) { /* the last, partial block: codes past n (padding) do not count */
        const uint8_t *bytes = packed + full * (BLOCK / 2);
        uint64_t sum = 0;
        int top = 0;
        for (int64_t i = 0; i < n - full * BLOCK; i++) {
            const int c = (bytes[i / 2] >> (4 * (i % 2))) & 7;
            sum += units[c];
            top = c > top ? c : top;
        }
        add_block(&t, scales[full], sum, top);
    }
    double total = 0.0;
    float largest = 0.0f;
    int64_t infinite = 0;
    for (int s = 0; s < E8M0_NAN; s++) {
        const float top_value = grid[t.top[s]] * e8m0_scale((uint8_t)s);
        if (isinf(top_value)) { /* hostile input only: count the values, block by block */
            float lut[16];
            block_lut(grid, (uint8_t)s, lut);
            for (int64_t b = 0; b < n_blocks; b++) {
                const int64_t count = n - b * BLOCK < BLOCK ? n - b * BLOCK : BLOCK;
                for (int64_t i = 0; scales[b] == s && i < count; i++)
                    infinite += isinf(lut[(packed[b * 16 + i / 2] >> (4 * (i % 2))) & 15]) != 0;
            }
            continue;
        }
        largest = top_value > largest ? top_value : largest;
        /* units * 2^(2e - shift), 2e - shift within float64's normal range */
        total += ldexp((double)t.units[s], 2 * (s - E8M0_BIAS) - shift);
    }
    *squares = total;
    *max_abs = largest;
    return infinite;
}

#define ACC_SET 0      /* sum = value * weight            (torch: copy_ then mul_)         */
#define ACC_ADD_FMA 1  /* sum = fma(weight, value, sum)   (torch: add_(alpha=) with FMA)   */
#define ACC_ADD_MUL 2  /* sum = sum + weight * value      (torch: add_(alpha=) without FMA) */

/* The per-block loops, written for the vectoriser; inlined into one wrapper per ISA below. */
static inline __attribute__((always_inline)) int64_t accumulate_blocks(
    const uint8_t *packed, const uint8_t *scales, int64_t n, const float *grid, float weight,
    int mode, float *sum)
{
    const int64_t n_blocks = (n + BLOCK - 1) / BLOCK;
    if (has_nan_scale(scales, n_blocks))
        return -1;
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *bytes = packed + b * (BLOCK / 2);
        const int64_t count = n - b * BLOCK < BLOCK ? n - b * BLOCK : BLOCK;
        float *dst = sum + b * BLOCK;
        float lut[16], v[BLOCK];
        block_lut(grid, scales[b], lut);
        if (mode == ACC_ADD_MUL || mode == ACC_SET)
            for (int c = 0; c < 16; c++)
                lut[c] = mode == ACC_SET ? lut[c] * weight : weight * lut[c];
        for (int j = 0; j < BLOCK / 2; j++) {
            v[2 * j] = lut[bytes[j] & 0x0F];
            v[2 * j + 1] = lut[bytes[j] >> 4];
        }
        if (count < BLOCK) {
            for (int64_t i = 0; i < count; i++)
                dst[i] = mode == ACC_SET       ? v[i]
                         : mode == ACC_ADD_FMA ? fmaf(weight, v[i], dst[i])
                                               : dst[i] + v[i];
        } else if (mode == ACC_SET) {
            for (int i = 0; i < BLOCK; i++)
                dst[i] = v[i];
        } else if (mode == ACC_ADD_FMA) {
            for (int i = 0; i < BLOCK; i++)
                dst[i] = fmaf(weight, v[i], dst[i]);
        } else {
            for (int i = 0; i < BLOCK; i++)
                dst[i] = dst[i] + v[i];
        }
    }
    return 0;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* accumulate_blocks with the table lookup in registers: a block's 8 magnitudes (grid * scale,
 * times the weight where the mode rounds that product first) in one vector, each code's value
 * picked by vpermps on its low 3 bits, its sign (bit 3) xor-ed in. The same float32 products
 * and sums as accumulate_blocks (negation is exact), without its scalar gather. */
__attribute__((target("avx2,fma"))) static int64_t accumulate_avx2(
    const uint8_t *packed, const uint8_t *scales, int64_t n, const float *grid, float weight,
    int mode, float *sum)
{
    const int64_t n_blocks = (n + BLOCK - 1) / BLOCK, full = n / BLOCK;
    if (has_nan_scale(scales, n_blocks))
        return -1;
    const __m256 grid8 = _mm256_loadu_ps(grid), w = _mm256_set1_ps(weight);
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    const __m256i sign_bit = _mm256_set1_epi32((int)0x80000000u);
    for (int64_t b = 0; b < full; b++) {
        __m256 table = _mm256_mul_ps(grid8, _mm256_set1_ps(e8m0_scale(scales[b])));
        if (mode == ACC_SET)
            table = _mm256_mul_ps(table, w);
        else if (mode == ACC_ADD_MUL)
            table = _mm256_mul_ps(w, table);
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(packed + b * (BLOCK / 2)));
        const __m128i lo = _mm_and_si128(bytes, low_mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);
        const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);
        const __m256i codes[4] = {
            _mm256_cvtepu8_epi32(first), _mm256_cvtepu8_epi32(_mm_srli_si128(first, 8)),
            _mm256_cvtepu8_epi32(second), _mm256_cvtepu8_epi32(_mm_srli_si128(second, 8))};
        float *dst = sum + b * BLOCK;
        for (int k = 0; k < 4; k++) {
            const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(codes[k], 28), sign_bit);
            const __m256 v = _mm256_xor_ps(_mm256_permutevar8x32_ps(table, codes[k]),
                                           _mm256_castsi256_ps(sign));
            __m256 out;
            if (mode == ACC_SET)
                out = v;
            else if (mode == ACC_ADD_FMA)
                out = _mm256_fmadd_ps(w, v, _mm256_loadu_ps(dst + 8 * k));
            else
                out = _mm256_add_ps(_mm256_loadu_ps(dst + 8 * k), v);
            _mm256_storeu_ps(dst + 8 * k, out);
        }
    }
    if (full < n_blocks) /* the last, partial block */
        return accumulate_blocks(packed + full * (BLOCK / 2), scales + full, n - full * BLOCK,
                                 grid, weight, mode, sum + full * BLOCK);
    return 0;
}

/* accumulate_avx2 with 16 values to a vector: the block's table holds all 16 codes' values
 * (the 8 magnitudes, then their negations: negation is exact), so one vpermps picks each
 * value, sign included. About a third of accumulate_avx2's instructions per value, the same
 * float32 products and sums for finite values (fp4_stats refuses a push with an infinity
 * before it is added; infinity times a weight of 0 would give a NaN of the other sign). */
__attribute__((target("avx512f"))) static int64_t accumulate_avx512(
    const uint8_t *packed, const uint8_t *scales, int64_t n, const float *grid, float weight,
    int mode, float *sum)
{
    const int64_t n_blocks = (n + BLOCK - 1) / BLOCK, full = n / BLOCK;
    if (has_nan_scale(scales, n_blocks))
        return -1;
    float signed_grid[16];
    for (int c = 0; c < 8; c++) {
        signed_grid[c] = grid[c];
        signed_grid[c + 8] = -grid[c];
    }
    const __m512 grid16 = _mm512_loadu_ps(signed_grid);
    const __m512 w = _mm512_set1_ps(weight);
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < full; b++) {
        __m512 table = _mm512_mul_ps(grid16, _mm512_set1_ps(e8m0_scale(scales[b])));
        if (mode == ACC_SET)
            table = _mm512_mul_ps(table, w);
        else if (mode == ACC_ADD_MUL)
            table = _mm512_mul_ps(w, table);
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(packed + b * (BLOCK / 2)));
        const __m128i lo = _mm_and_si128(bytes, low_mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);
        const __m512i codes[2] = {_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)),
                                  _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi))};
        float *dst = sum + b * BLOCK;
        for (int k = 0; k < 2; k++) {
            const __m512 v = _mm512_permutexvar_ps(codes[k], table);
            __m512 out;
            if (mode == ACC_SET)
                out = v;
            else if (mode == ACC_ADD_FMA)
                out = _mm512_fmadd_ps(w, v, _mm512_loadu_ps(dst + 16 * k));
            else
                out = _mm512_add_ps(_mm512_loadu_ps(dst + 16 * k), v);
            _mm512_storeu_ps(dst + 16 * k, out);
        }
    }
    if (full < n_blocks) /* the last, partial block */
        return accumulate_blocks(packed + full * (BLOCK / 2), scales + full, n - full * BLOCK,
                                 grid, weight, mode, sum + full * BLOCK);
    return 0;
}
#endif

/* The widest instruction set fp4_accumulate may use (FP4_ISA_*), where the CPU has it: tests
 * and benchmarks lower it to check and time the narrower paths on a machine with the wider. */
#define FP4_ISA_PORTABLE 0
#define FP4_ISA_AVX2 1
#define FP4_ISA_AVX512 2
int fp4_isa_limit = FP4_ISA_AVX512;

/* The widest FP4_ISA_* this CPU runs (whatever the limit). */
int fp4_widest_isa(void)
{
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    if (__builtin_cpu_supports("avx512f"))
        return FP4_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return FP4_ISA_AVX2;
#endif
    return FP4_ISA_PORTABLE;
}

/* Without hardware FMA, fmaf is libm's correctly rounded call: the same bits, slower. */
static int64_t accumulate_portable(const uint8_t *packed, const uint8_t *scales, int64_t n,
                                   const float *grid, float weight, int mode, float *sum)
{
    return accumulate_blocks(packed, scales, n, grid, weight, mode, sum);
}

/* sum[i] (op) weight * value[i] for n packed values, as `mode` says (ACC_*): element by
 * element the float32 operations of the torch path, so the result is bit-identical. In
 * ACC_ADD_MUL the product weight * value is rounded to float32 before the add (per block
 * table); in ACC_SET, value * weight. Returns -1 (nothing written) for a NaN scale byte. */
int64_t fp4_accumulate(const uint8_t *packed, const uint8_t *scales, int64_t n,
                       const float *grid, float weight, int mode, float *sum)
{
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    if (fp4_isa_limit >= FP4_ISA_AVX512 && __builtin_cpu_supports("avx512f"))
        return accumulate_avx512(packed, scales, n, grid, weight, mode, sum);
    if (fp4_isa_limit >= FP4_ISA_AVX2 && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma"))
        return accumulate_avx2(packed, scales, n, grid, weight, mode, sum);
#endif
    return accumulate_portable(packed, scales, n, grid, weight, mode, sum);
}

/* fp4_accumulate for `count` pushes into one sum, in push order: element by element the
 * same float32 operations as one fp4_accumulate call per push, so the result is
 * bit-identical; but the sum is read and written once per TILE values for all of them
 * instead of once per push. A large fragment's sum does not fit in any cache, so adding
 * pushes one by one moves it through memory each time; here a tile stays in L2 while every
 * push is added to it (bench/ingest.py server_paths measures the two). Returns -1 (nothing
 * written) if any push has a NaN scale byte. */
#define TILE (1 << 14) /* values: 64 KiB of sum, a multiple of BLOCK */
int64_t fp4_accumulate_many(int64_t count, const uint8_t *const *packed,
                            const uint8_t *const *scales, int64_t n, const float *const *grids,
                            const float *weights, const int *modes, float *sum)
{
    for (int64_t j = 0; j < count; j++)
        if (has_nan_scale(scales[j], (n + BLOCK - 1) / BLOCK))
            return -1;
    for (int64_t start = 0; start < n; start += TILE) {
        const int64_t len = n - start < TILE ? n - start : TILE;
        for (int64_t j = 0; j < count; j++)
            fp4_accumulate(packed[j] + start / 2, scales[j] + start / BLOCK, len, grids[j],
                           weights[j], modes[j], sum + start);
    }
    return 0;
}

/* ---- Top-k selection for the sparse codecs (common/sparse.py) ----------------------------
 *
 * For each of `rows` rows of `width` finite float32 values, the indices of the k largest
 * magnitudes, ascending, into idx (rows x k); among magnitudes equal to the smallest kept one,
 * the lowest indices: the rule the torch path implements with topk and its tie fix. The
 * magnitude's bits (sign cleared) order like the magnitudes, so a three-level radix select on
 * them (bits 30-21, 20-10, 9-0) finds the k-th largest exactly, then one scan in index order
 * writes the kept indices already sorted. A row of 4096 values stays in L1 throughout.
 */
#define SEL_BINS1 1024
#define SEL_BINS2 2048
#define SEL_BINS3 1024

/* The bin of the k-th largest (counting from the top bin down) and how many of the k fall
 * into that bin. */
static int64_t select_bin(const int32_t *hist, int64_t bins, int64_t *need)
{
    int64_t b = bins - 1;
    for (; b > 0; b--) {
        if (hist[b] >= *need)
            break;
        *need -= hist[b];
    }
    return b;
}

void topk_select(const float *x, int64_t rows, int64_t width, int64_t k, int64_t *idx)
{
    int32_t hist1[SEL_BINS1], hist2[SEL_BINS2], hist3[SEL_BINS3];
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *bits = (const uint32_t *)(x + r * width);
        int64_t *out = idx + r * k;
        memset(hist1, 0, sizeof hist1);
        for (int64_t i = 0; i < width; i++)
            hist1[(bits[i] & 0x7FFFFFFFu) >> 21]++;
        int64_t need = k;
        uint32_t b1 = (uint32_t)select_bin(hist1, SEL_BINS1, &need);
        memset(hist2, 0, sizeof hist2);
        for (int64_t i = 0; i < width; i++) {
            uint32_t key = bits[i] & 0x7FFFFFFFu;
            if ((key >> 21) == b1)
                hist2[(key >> 10) & 0x7FF]++;
        }
        uint32_t b2 = (uint32_t)select_bin(hist2, SEL_BINS2, &need);
        uint32_t prefix = (b1 << 11) | b2;
        memset(hist3, 0, sizeof hist3);
        for (int64_t i = 0; i < width; i++) {
            uint32_t key = bits[i] & 0x7FFFFFFFu;
            if ((key >> 10) == prefix)
                hist3[key & 0x3FF]++;
        }
        uint32_t threshold = (prefix << 10) | (uint32_t)select_bin(hist3, SEL_BINS3, &need);
        /* `need` kept entries equal the threshold; everything above it is kept. */
        int64_t n = 0;
        for (int64_t i = 0; i < width && n < k; i++) {
            uint32_t key = bits[i] & 0x7FFFFFFFu;
            if (key > threshold || (key == threshold && need-- > 0))
                out[n++] = i;
        }
    }
}
