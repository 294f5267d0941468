/* Server ingest, first pass: a push's sum of squares and largest magnitude straight from its
 * wire encoding (common/codec/native.py loads it). server/rounds/ingest.py checks a push (finite
 * values, norm, largest magnitude) with this before it takes the aggregator's lock; one pass
 * over the packed codes, with no float32 copy of the push.
 */
#include "fp4_blocks.h"
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
