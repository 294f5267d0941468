/* Server ingest, second pass: weight * value added to a round's float32 sum straight from a
 * push's wire encoding (common/codec/native.py loads it), under the aggregator's lock or after it
 * for pushes added together (server/rounds/round.py); one pass over the packed codes, with no
 * float32 copy of the push.
 */
#include "fp4_blocks.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#endif

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
