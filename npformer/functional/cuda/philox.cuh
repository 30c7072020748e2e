// Philox4x32-10 (Salmon et al., SC 2011): the counter-based generator of every dropout mask.
// The CUDA twin of autograd/random.py (philox4x32, bits16); both give the same bits for the same
// (seed, offset, index), so a kernel draws exactly the mask the reference draws, and a backward
// kernel regenerates the forward's mask instead of reading a stored one.
#pragma once

struct PhiloxWords { unsigned int w[4]; };

// Ten rounds on a counter c (4 words) under a key k (2 words):
//   (hi0, lo0) = M0 * c0,  (hi1, lo1) = M1 * c2,  c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0),
// with k += (W0, W1) between rounds.
__device__ __forceinline__ PhiloxWords philox4x32_10(unsigned int c0, unsigned int c1, unsigned int c2,
                                                     unsigned int c3, unsigned int k0, unsigned int k1) {
    const unsigned int M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
    #pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round) { k0 += W0; k1 += W1; }
        const unsigned int hi0 = __umulhi(M0, c0), lo0 = M0 * c0;
        const unsigned int hi1 = __umulhi(M1, c2), lo1 = M1 * c2;
        c0 = hi1 ^ c1 ^ k0; c1 = lo1; c2 = hi0 ^ c3 ^ k1; c3 = lo0;
    }
    PhiloxWords out = {{c0, c1, c2, c3}};
    return out;
}

// Value `index` (0, 1, 2, ...) of the stream of `seed`: counter (index / 8) as two 32-bit words,
// key (seed mod 2^32, seed >> 32); value 2m of a counter is the low half of word m, 2m + 1 the
// high half. A thread that needs 8 consecutive values should call philox4x32_10 once instead.
__device__ __forceinline__ unsigned short philox_bits16(unsigned long long seed, unsigned long long index) {
    const unsigned long long counter = index / 8;
    const PhiloxWords r = philox4x32_10((unsigned int)counter, (unsigned int)(counter >> 32), 0u, 0u,
                                        (unsigned int)seed, (unsigned int)(seed >> 32));
    const unsigned int word = r.w[(index % 8) / 2];
    return (unsigned short)((index % 2) ? word >> 16 : word & 0xFFFFu);
}

// Dropout's keep test: value >= threshold keeps the entry, threshold = min(round(p 2^16), 2^16 - 1)
// (autograd.random / F.dropout: the drop probability is p rounded to a multiple of 2^-16).
__device__ __forceinline__ bool philox_keep(unsigned long long seed, unsigned long long index,
                                            unsigned int threshold) {
    return philox_bits16(seed, index) >= threshold;
}
