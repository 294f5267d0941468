/* Top-k selection for the sparse codecs (common/codec/sparse.py; common/codec/native.py loads it).
 *
 * For each of `rows` rows of `width` finite float32 values, the indices of the k largest
 * magnitudes, ascending, into idx (rows x k); among magnitudes equal to the smallest kept one,
 * the lowest indices: the rule the torch path implements with topk and its tie fix. The
 * magnitude's bits (sign cleared) order like the magnitudes, so a three-level radix select on
 * them (bits 30-21, 20-10, 9-0) finds the k-th largest exactly, then one scan in index order
 * writes the kept indices already sorted. A row of 4096 values stays in L1 throughout.
 */
#include <stdint.h>
#include <string.h>

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
