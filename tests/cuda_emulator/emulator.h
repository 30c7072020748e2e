// A CUDA emulator for the test suite: runs npformer's .cu kernels on the CPU, unchanged, so that
// machines without a GPU test their indexing, barriers, shuffles and arithmetic against the
// numpy references (tests/test_flash_attention.py, tests/test_dropout.py).
//
// Every CUDA thread of a block is a fiber (ucontext) on one OS thread. A fiber runs until it
// reaches a barrier: __syncthreads() (the whole block) or a warp shuffle (its warp). When every
// fiber is blocked, the barriers whose threads have all arrived are released. The order in
// which fibers run between barriers is a permutation drawn from `seed` for every round, so a
// missing barrier (a thread reading shared memory before another wrote it, or overwriting it
// before another read it) gives wrong results for some seeds. Blocks run one after another, so
// a `__shared__` variable can be a function-level `static`. Reported as errors (abort): a
// barrier that some threads of the block never reach, a shuffle with lanes at another barrier.
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x = 1, y = 1, z = 1; };
inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

using std::exp;
using std::isfinite;
using std::log;
using std::max;
using std::min;

inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
inline float __int_as_float(int bits) { float f; std::memcpy(&f, &bits, 4); return f; }
inline double __longlong_as_double(long long bits) { double d; std::memcpy(&d, &bits, 8); return d; }

namespace emulator {

enum Wait { RUNNING = 0, BLOCK_BARRIER = 1, WARP_BARRIER = 2 };
constexpr std::size_t STACK_BYTES = 256 * 1024;

struct Fiber {
    ucontext_t context;
    Wait waiting = RUNNING;
    bool done = false;
    unsigned long long shuffles = 0;    // shuffles this thread has made (their slots alternate)
};

inline std::vector<Fiber> fibers;
inline std::vector<std::vector<char>> stacks;
inline std::vector<unsigned long long> slots;   // [warp][2][32]: the values offered to a shuffle
inline ucontext_t scheduler;
inline int current = -1;
inline std::function<void()> body;

[[noreturn]] inline void fail(const char* what) {
    std::fprintf(stderr, "cuda emulator: %s (block %u, thread %d)\n", what, blockIdx.x, current);
    std::abort();
}

inline void yield(Wait why) {
    fibers[current].waiting = why;
    swapcontext(&fibers[current].context, &scheduler);
}

inline void trampoline() {
    body();
    fibers[current].done = true;       // returning resumes the scheduler (uc_link)
}

// xorshift64*: the permutation of each round
inline unsigned long long next(unsigned long long& state) {
    state ^= state >> 12; state ^= state << 25; state ^= state >> 27;
    return state * 2685821657736338717ull;
}

inline void run_block(int threads, unsigned long long seed) {
    fibers.assign(threads, Fiber{});
    if ((int)stacks.size() < threads) stacks.resize(threads, std::vector<char>(STACK_BYTES));
    slots.assign(((threads + 31) / 32) * 64, 0);
    for (int t = 0; t < threads; ++t) {
        getcontext(&fibers[t].context);
        fibers[t].context.uc_stack.ss_sp = stacks[t].data();
        fibers[t].context.uc_stack.ss_size = STACK_BYTES;
        fibers[t].context.uc_link = &scheduler;
        makecontext(&fibers[t].context, trampoline, 0);
    }
    std::vector<int> order(threads);
    for (int t = 0; t < threads; ++t) order[t] = t;
    unsigned long long state = seed * 0x9E3779B97F4A7C15ull + 1;
    for (;;) {
        for (int t = threads - 1; t > 0; --t) std::swap(order[t], order[next(state) % (t + 1)]);
        for (int t : order) {
            if (fibers[t].done || fibers[t].waiting != RUNNING) continue;
            current = t;
            threadIdx = {(unsigned int)t, 0, 0};
            swapcontext(&scheduler, &fibers[t].context);
        }
        int done = 0, at_block = 0;
        for (const Fiber& f : fibers) {
            done += f.done;
            at_block += f.waiting == BLOCK_BARRIER;
        }
        if (done == threads) return;
        bool released = false;
        for (int w = 0; w * 32 < threads; ++w) {             // warps whose lanes all wait at a shuffle
            const int first = w * 32, last = std::min(threads, first + 32);
            int at_warp = 0;
            for (int t = first; t < last; ++t) at_warp += fibers[t].waiting == WARP_BARRIER;
            if (at_warp == 0) continue;
            if (at_warp != last - first) { current = first; fail("a shuffle that not every lane of the warp reached"); }
            for (int t = first; t < last; ++t) fibers[t].waiting = RUNNING;
            released = true;
        }
        if (!released && at_block > 0) {                      // then the block barrier
            if (at_block != threads) {
                for (int t = 0; t < threads; ++t)
                    if (fibers[t].waiting != BLOCK_BARRIER) { current = t; break; }
                fail("__syncthreads() not reached by every thread of the block");
            }
            for (Fiber& f : fibers) f.waiting = RUNNING;
            released = true;
        }
        if (!released) fail("deadlock");
    }
}

// One letter per kernel parameter type, for the launcher's check of the arguments it was given:
// scalars i (int), l (long long), I (unsigned int), L (unsigned long long), f (float), d (double);
// pointers F (float), D (double), B (bool), X (long long).
template <typename P>
constexpr char type_code() {
    using U = std::remove_cv_t<P>;
    if constexpr (std::is_pointer_v<U>) {
        using E = std::remove_cv_t<std::remove_pointer_t<U>>;
        if constexpr (std::is_same_v<E, float>) return 'F';
        else if constexpr (std::is_same_v<E, double>) return 'D';
        else if constexpr (std::is_same_v<E, bool>) return 'B';
        else if constexpr (std::is_same_v<E, long long>) return 'X';
        else return '?';
    } else if constexpr (std::is_same_v<U, int>) return 'i';
    else if constexpr (std::is_same_v<U, long long>) return 'l';
    else if constexpr (std::is_same_v<U, unsigned int>) return 'I';
    else if constexpr (std::is_same_v<U, unsigned long long>) return 'L';
    else if constexpr (std::is_same_v<U, float>) return 'f';
    else if constexpr (std::is_same_v<U, double>) return 'd';
    else return '?';
}

// Launch `kernel` on grid x block threads with its parameters given as CUDA takes them: an array
// of pointers to the values (cuLaunchKernel's kernelParams), whose types `given` spells with the
// letters of type_code. Returns 0, or 1 (and writes the kernel's letters to `expected`) when the
// arguments do not have the parameters' types.
template <typename... P, std::size_t... I>
void call(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<P>>*>(args[I])...);
}

template <typename... P>
int launch(void (*kernel)(P...), unsigned int grid, unsigned int block, void** args, unsigned long long seed,
           const char* given, char* expected) {
    const char codes[] = {type_code<P>()..., '\0'};
    if (std::strcmp(codes, given) != 0) {
        std::strcpy(expected, codes);
        return 1;
    }
    if (block == 0 || block > 1024 || block % 32) fail("threads per block must be a multiple of 32 in [32, 1024]");
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    body = [&] { call(kernel, args, std::index_sequence_for<P...>{}); };
    for (unsigned int b = 0; b < grid; ++b) {
        blockIdx = {b, 0, 0};
        run_block((int)block, seed + b);
    }
    return 0;
}

}  // namespace emulator

inline void __syncthreads() { emulator::yield(emulator::BLOCK_BARRIER); }

// __shfl_xor_sync(mask, value, lane_mask): lane l gets the value of lane l ^ lane_mask. The value
// is offered in one of two slots (alternating per shuffle), then the lane waits for its warp;
// a lane can only offer into a slot again after every lane passed the next shuffle, i.e. read it.
template <typename T>
T __shfl_xor_sync(unsigned int mask, T value, int lane_mask) {
    using namespace emulator;
    static_assert(sizeof(T) <= 8, "shuffles of at most 8 bytes");
    if (mask != 0xffffffffu) fail("only full-warp shuffles are emulated");
    const int t = (int)threadIdx.x, warp = t / 32, lane = t % 32;
    const int phase = (int)(fibers[t].shuffles++ % 2);
    unsigned long long bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    slots[(warp * 2 + phase) * 32 + lane] = bits;
    yield(WARP_BARRIER);
    bits = slots[(warp * 2 + phase) * 32 + (lane ^ lane_mask)];
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}
