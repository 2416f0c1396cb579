/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78): the checksum of WAL records and object
 * blocks (docs/wal-format.md, docs/object-format.md).
 *
 * Two implementations, picked once at start (s3s_crc32c_init):
 * - hardware: the SSE4.2 `crc32` instruction on x86-64, three independent streams interleaved
 *   over 8 KiB (then 256-byte) chunks to hide the instruction's 3-cycle latency, the streams
 *   combined by "shift by n zero bytes" operators (precomputed GF(2) matrices as lookup tables);
 * - table: slicing-by-8 on any machine.
 * Both give identical results; tests compare them with each other and with the pure-Python twin
 * (wal/reference.py). The combination technique follows the public description by Mark Adler.
 */
#ifndef S3S_CRC32C_H
#define S3S_CRC32C_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define S3S_CRC32C_POLY 0x82F63B78u
#define S3S_CRC32C_LONG 8192
#define S3S_CRC32C_SHORT 256

static uint32_t s3s_crc32c_table[8][256];
static uint32_t s3s_crc32c_long[4][256];
static uint32_t s3s_crc32c_short[4][256];
static int s3s_crc32c_use_hw = 0;
static int s3s_crc32c_hw_ok = 0;     /* the CPU and build have the instruction */

static uint32_t s3s_gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1)
            sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void s3s_gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++)
        square[n] = s3s_gf2_times(mat, mat[n]);
}

/* The operator that appends `len` zero bytes to a raw (not pre/post-inverted) CRC register. */
static void s3s_crc32c_zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32];
    uint32_t row = 1;
    odd[0] = S3S_CRC32C_POLY;             /* one zero bit */
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    s3s_gf2_square(even, odd);            /* two zero bits */
    s3s_gf2_square(odd, even);            /* four zero bits */
    /* each square doubles the bits: the first below gives one zero byte */
    do {
        s3s_gf2_square(even, odd);
        len >>= 1;
        if (len == 0)
            return;
        s3s_gf2_square(odd, even);
        len >>= 1;
    } while (len);
    for (int n = 0; n < 32; n++)
        even[n] = odd[n];
}

static void s3s_crc32c_zeros(uint32_t zeros[][256], size_t len) {
    uint32_t op[32];
    s3s_crc32c_zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = s3s_gf2_times(op, n);
        zeros[1][n] = s3s_gf2_times(op, n << 8);
        zeros[2][n] = s3s_gf2_times(op, n << 16);
        zeros[3][n] = s3s_gf2_times(op, n << 24);
    }
}

static inline uint32_t s3s_crc32c_shift(uint32_t zeros[][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
           zeros[3][crc >> 24];
}

static uint32_t s3s_crc32c_sw(uint32_t crc, const unsigned char *p, size_t n) {
    uint32_t c = ~crc;
    while (n && ((uintptr_t)p & 7)) {
        c = s3s_crc32c_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
        n--;
    }
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);                 /* little-endian machines only (as is the format) */
        v ^= c;
        c = s3s_crc32c_table[7][v & 0xff] ^ s3s_crc32c_table[6][(v >> 8) & 0xff] ^
            s3s_crc32c_table[5][(v >> 16) & 0xff] ^ s3s_crc32c_table[4][(v >> 24) & 0xff] ^
            s3s_crc32c_table[3][(v >> 32) & 0xff] ^ s3s_crc32c_table[2][(v >> 40) & 0xff] ^
            s3s_crc32c_table[1][(v >> 48) & 0xff] ^ s3s_crc32c_table[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = s3s_crc32c_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return ~c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define S3S_CRC32C_HAVE_HW 1
/* While at least 3 x `chunk` bytes remain: the CRC of three consecutive chunks as three
 * independent streams, then shifted into one. `c0` is the running (inverted) register. */
__attribute__((target("sse4.2")))
static inline uint64_t s3s_crc32c_hw_3way(uint64_t c0, const unsigned char **pp, size_t *np, size_t chunk,
                                          uint32_t zeros[][256]) {
    const unsigned char *p = *pp, *end;
    size_t n = *np;
    uint64_t c1, c2, v;
    while (n >= 3 * chunk) {
        c1 = c2 = 0;
        end = p + chunk;
        do {
            memcpy(&v, p, 8);
            c0 = __builtin_ia32_crc32di(c0, v);
            memcpy(&v, p + chunk, 8);
            c1 = __builtin_ia32_crc32di(c1, v);
            memcpy(&v, p + 2 * chunk, 8);
            c2 = __builtin_ia32_crc32di(c2, v);
            p += 8;
        } while (p < end);
        c0 = s3s_crc32c_shift(zeros, (uint32_t)c0) ^ c1;
        c0 = s3s_crc32c_shift(zeros, (uint32_t)c0) ^ c2;
        p += 2 * chunk;
        n -= 3 * chunk;
    }
    *pp = p;
    *np = n;
    return c0;
}

__attribute__((target("sse4.2")))
static uint32_t s3s_crc32c_hw(uint32_t crc, const unsigned char *p, size_t n) {
    uint64_t c0 = (uint32_t)~crc;
    uint64_t v;
    while (n && ((uintptr_t)p & 7)) {
        c0 = __builtin_ia32_crc32qi((uint32_t)c0, *p++);
        n--;
    }
    c0 = s3s_crc32c_hw_3way(c0, &p, &n, S3S_CRC32C_LONG, s3s_crc32c_long);
    c0 = s3s_crc32c_hw_3way(c0, &p, &n, S3S_CRC32C_SHORT, s3s_crc32c_short);
    while (n >= 8) {
        memcpy(&v, p, 8);
        c0 = __builtin_ia32_crc32di(c0, v);
        p += 8;
        n -= 8;
    }
    while (n--)
        c0 = __builtin_ia32_crc32qi((uint32_t)c0, *p++);
    return ~(uint32_t)c0;
}
#else
#define S3S_CRC32C_HAVE_HW 0
static uint32_t s3s_crc32c_hw(uint32_t crc, const unsigned char *p, size_t n) {
    return s3s_crc32c_sw(crc, p, n);
}
#endif

/* Build the tables and pick the implementation; returns 1 if the hardware one is used. */
static int s3s_crc32c_init(int allow_hw) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ S3S_CRC32C_POLY : c >> 1;
        s3s_crc32c_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = s3s_crc32c_table[0][i];
        for (int t = 1; t < 8; t++) {
            c = s3s_crc32c_table[0][c & 0xff] ^ (c >> 8);
            s3s_crc32c_table[t][i] = c;
        }
    }
    s3s_crc32c_zeros(s3s_crc32c_long, S3S_CRC32C_LONG);
    s3s_crc32c_zeros(s3s_crc32c_short, S3S_CRC32C_SHORT);
#if S3S_CRC32C_HAVE_HW
    __builtin_cpu_init();
    s3s_crc32c_hw_ok = __builtin_cpu_supports("sse4.2") != 0;
    s3s_crc32c_use_hw = allow_hw && s3s_crc32c_hw_ok;
#else
    (void)allow_hw;
    s3s_crc32c_use_hw = 0;
#endif
    return s3s_crc32c_use_hw;
}

static inline uint32_t s3s_crc32c(uint32_t crc, const unsigned char *p, size_t n) {
    return s3s_crc32c_use_hw ? s3s_crc32c_hw(crc, p, n) : s3s_crc32c_sw(crc, p, n);
}

#endif
