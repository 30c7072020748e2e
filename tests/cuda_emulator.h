// A CUDA emulator for the host: npformer's .cu kernels compiled by g++ and run on the CPU, so
// that their indexing, loops, block reductions and launch arguments are tested on machines
// without a GPU (tests/cuda_emulator.py builds and drives it; tests/test_kernels_emulated.py).
//
// Every CUDA thread of a block is a fiber (ucontext) on one OS thread. A fiber runs until it
// reaches a barrier: __syncthreads() (the whole block) or a warp shuffle (its warp), or returns.
// When every fiber is blocked, the warps whose lanes all wait at a shuffle are released, else the
// block barrier once every thread waits there. The fibers run in an order drawn anew from `seed`
// for every round, so a missing barrier (a thread reading shared memory before another wrote it,
// or overwriting it before another read it) gives wrong results for some seeds. Reported as
// errors: threads that return while others wait at a barrier, a shuffle that not every lane of
// the warp reaches, a deadlock. Blocks run one after the other, so `__shared__` variables are
// function statics and atomics are plain read-modify-writes. Math comes from <cmath> (float
// overloads for float arguments).
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};

inline dim3 threadIdx, blockIdx, blockDim, gridDim;
constexpr int warpSize = 32;

using std::erf;
using std::exp;
using std::fabs;
using std::isfinite;
using std::isnan;
using std::log;
using std::max;
using std::min;
using std::pow;
using std::sqrt;
using std::tanh;

template <typename T> inline T rsqrt(T x) { return T(1) / std::sqrt(x); }
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
inline float __int_as_float(int bits) { float f; std::memcpy(&f, &bits, 4); return f; }
inline double __longlong_as_double(long long bits) { double d; std::memcpy(&d, &bits, 8); return d; }
template <typename T> inline T __ldg(const T* p) { return *p; }
inline void __threadfence() {}

namespace emu {

enum State { RUNNING, AT_BARRIER, DONE, FAILED };
enum Barrier { SYNCTHREADS = 1, SHUFFLE = 2 };

struct Fiber {
    ucontext_t context;
    dim3 thread;
    State state;
    int barrier;
};

constexpr size_t STACK_BYTES = 256 * 1024;
inline unsigned long long seed = 0;            // the order of the fibers in each round (emu_set_seed)
inline ucontext_t scheduler;
inline std::vector<Fiber> fibers;
inline std::vector<std::vector<char>> stacks;
inline std::vector<unsigned char> exchange;   // 16 bytes per thread for the shuffles
inline int current = -1;
inline std::function<void()> body;
inline std::string error;

inline int linear_thread() {
    return int(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
}

inline void fail(const std::string& message) {  // from inside a fiber: stop this launch
    if (error.empty()) error = message;
    fibers[current].state = FAILED;
    swapcontext(&fibers[current].context, &scheduler);
}

inline void wait_at(int barrier) {
    fibers[current].state = AT_BARRIER;
    fibers[current].barrier = barrier;
    swapcontext(&fibers[current].context, &scheduler);
}

inline void entry() {
    body();
    fibers[current].state = DONE;  // returns to uc_link, the scheduler
}

// xorshift64*: the permutations of the rounds
inline unsigned long long next_random(unsigned long long& state) {
    state ^= state >> 12; state ^= state << 25; state ^= state >> 27;
    return state * 2685821657736338717ull;
}

inline bool block_error(const std::string& what) {
    error = what + " (block " + std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) + ", " +
            std::to_string(blockIdx.z) + ")";
    return false;
}

// Runs one block of `threads` fibers to completion; false (and `error`) when it goes wrong.
inline bool run_block(int threads, unsigned long long block_seed) {
    fibers.resize(threads);
    if (stacks.size() < size_t(threads)) stacks.resize(threads);
    exchange.assign(16 * size_t(threads), 0);
    std::vector<int> order(threads);
    for (int i = 0; i < threads; ++i) {
        Fiber& f = fibers[i];
        if (stacks[i].empty()) stacks[i].resize(STACK_BYTES);
        f.thread.x = i % blockDim.x;
        f.thread.y = (i / blockDim.x) % blockDim.y;
        f.thread.z = i / (blockDim.x * blockDim.y);
        f.state = RUNNING;
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = stacks[i].data();
        f.context.uc_stack.ss_size = STACK_BYTES;
        f.context.uc_link = &scheduler;
        makecontext(&f.context, entry, 0);
        order[i] = i;
    }
    unsigned long long random = block_seed * 0x9E3779B97F4A7C15ull + 1;
    for (;;) {
        for (int i = threads - 1; i > 0; --i) std::swap(order[i], order[next_random(random) % (i + 1)]);
        for (int i : order) {
            if (fibers[i].state != RUNNING) continue;
            current = i;
            threadIdx = fibers[i].thread;
            swapcontext(&scheduler, &fibers[i].context);
            if (fibers[i].state == FAILED) return false;
        }
        int done = 0, at_block = 0;
        for (const Fiber& f : fibers) {
            done += f.state == DONE;
            at_block += f.state == AT_BARRIER && f.barrier == SYNCTHREADS;
        }
        if (done == threads) return true;
        bool released = false;
        for (int first = 0; first < threads; first += 32) {   // warps whose lanes all wait at a shuffle
            const int last = std::min(threads, first + 32);
            int at_shuffle = 0;
            for (int i = first; i < last; ++i) at_shuffle += fibers[i].state == AT_BARRIER && fibers[i].barrier == SHUFFLE;
            if (!at_shuffle) continue;
            if (at_shuffle != last - first)
                return block_error("a warp shuffle that not every lane of warp " + std::to_string(first / 32) +
                                   " reaches (" + std::to_string(at_shuffle) + " of " + std::to_string(last - first) + ")");
            for (int i = first; i < last; ++i) fibers[i].state = RUNNING;
            released = true;
        }
        if (released) continue;
        if (at_block == threads) {                              // then the block barrier
            for (Fiber& f : fibers) f.state = RUNNING;
            continue;
        }
        if (at_block && done)
            return block_error(std::to_string(done) + " threads returned while " + std::to_string(at_block) +
                               " wait at __syncthreads");
        return block_error("a deadlock: no barrier can be released");
    }
}

inline bool launch(dim3 grid, dim3 block, std::function<void()> kernel) {
    error.clear();
    const long long threads = (long long)block.x * block.y * block.z;
    if (threads < 1 || threads > 1024 || block.z > 64) {
        error = "invalid block size " + std::to_string(block.x) + " x " + std::to_string(block.y) + " x " +
                std::to_string(block.z) + " (at most 1024 threads, z at most 64)";
        return false;
    }
    if (grid.x < 1 || grid.y < 1 || grid.z < 1 || grid.y > 65535 || grid.z > 65535) {
        error = "invalid grid size";
        return false;
    }
    body = std::move(kernel);
    gridDim = grid;
    blockDim = block;
    unsigned long long index = 0;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx.x = x; blockIdx.y = y; blockIdx.z = z;
                if (!run_block(int(threads), seed + index++)) return false;
            }
    return true;
}

// A warp shuffle: every lane leaves its value, the warp meets, each reads its source lane's value,
// the warp meets again (so the slots can be reused).
template <typename T>
inline T shuffle(T value, int source_lane_of_warp) {
    static_assert(sizeof(T) <= 16, "shuffle of a value wider than 16 bytes");
    const int self = linear_thread(), warp_first = self - self % 32;
    std::memcpy(&exchange[16 * size_t(self)], &value, sizeof(T));
    wait_at(SHUFFLE);
    const int source = warp_first + source_lane_of_warp;
    if (source >= int(fibers.size())) fail("a warp shuffle reads a lane past the end of the block");
    T result;
    std::memcpy(&result, &exchange[16 * size_t(source)], sizeof(T));
    wait_at(SHUFFLE);
    return result;
}

// The type of a kernel parameter as one character, for the launcher's argument check: scalars
// f d i l I L ? (float, double, int, long long, unsigned, unsigned long long, bool), pointers to
// them F D B X U W (float, double, bool, long long, unsigned long long, unsigned int).
template <typename T> struct TypeCode { static constexpr char value = '-'; };
template <> struct TypeCode<float> { static constexpr char value = 'f'; };
template <> struct TypeCode<double> { static constexpr char value = 'd'; };
template <> struct TypeCode<int> { static constexpr char value = 'i'; };
template <> struct TypeCode<long long> { static constexpr char value = 'l'; };
template <> struct TypeCode<unsigned int> { static constexpr char value = 'I'; };
template <> struct TypeCode<unsigned long long> { static constexpr char value = 'L'; };
template <> struct TypeCode<bool> { static constexpr char value = '?'; };
template <typename T> struct TypeCode<T*> {
    static constexpr char value = std::is_same_v<std::remove_cv_t<T>, float> ? 'F'
        : std::is_same_v<std::remove_cv_t<T>, double> ? 'D'
        : std::is_same_v<std::remove_cv_t<T>, bool> ? 'B'
        : std::is_same_v<std::remove_cv_t<T>, long long> ? 'X'
        : std::is_same_v<std::remove_cv_t<T>, unsigned long long> ? 'U'
        : std::is_same_v<std::remove_cv_t<T>, unsigned int> ? 'W' : '*';
};

// The launch entries of a compiled source, one per kernel instance (see EMULATED_KERNELS).
struct Entry {
    const char* name;
    bool (*launch)(dim3, dim3, void**);
    int params;
    size_t sizes[32];
    char types[33];
};

template <auto Kernel> struct Launcher;

template <typename... Args, void (*Kernel)(Args...)>
struct Launcher<Kernel> {
    template <size_t... I>
    static bool call(dim3 grid, dim3 block, void** params, std::index_sequence<I...>) {
        return emu::launch(grid, block, [params] { Kernel(*static_cast<std::decay_t<Args>*>(params[I])...); });
    }
    static bool run(dim3 grid, dim3 block, void** params) {
        return call(grid, block, params, std::index_sequence_for<Args...>{});
    }
    static Entry entry(const char* name) {
        Entry e{name, &run, int(sizeof...(Args)), {}, {}};
        size_t sizes[] = {sizeof(std::decay_t<Args>)..., 0};
        char types[] = {TypeCode<std::decay_t<Args>>::value..., 0};
        for (size_t i = 0; i < sizeof...(Args); ++i) { e.sizes[i] = sizes[i]; e.types[i] = types[i]; }
        return e;
    }
};

}  // namespace emu

inline void __syncthreads() { emu::wait_at(emu::SYNCTHREADS); }

template <typename T> inline T __shfl_xor_sync(unsigned, T value, int lane_mask, int width = 32) {
    const int lane = emu::linear_thread() % 32;
    return emu::shuffle(value, (lane ^ lane_mask) % width + lane / width * width);
}
template <typename T> inline T __shfl_down_sync(unsigned, T value, unsigned delta, int width = 32) {
    const int lane = emu::linear_thread() % 32, in_group = lane % width;
    return emu::shuffle(value, in_group + int(delta) < width ? lane + int(delta) : lane);
}
template <typename T> inline T __shfl_sync(unsigned, T value, int source, int width = 32) {
    const int lane = emu::linear_thread() % 32;
    return emu::shuffle(value, lane / width * width + source % width);
}

template <typename T> inline T atomicAdd(T* address, T value) { T old = *address; *address = old + value; return old; }
template <typename T> inline T atomicMax(T* address, T value) { T old = *address; *address = std::max(old, value); return old; }
template <typename T> inline T atomicMin(T* address, T value) { T old = *address; *address = std::min(old, value); return old; }
template <typename T> inline T atomicExch(T* address, T value) { T old = *address; *address = value; return old; }

// After the source: EMULATED_KERNELS(EMULATED(kernel<float>) EMULATED(kernel<double>) ...)
#define EMULATED(...) emu::Launcher<&__VA_ARGS__>::entry(#__VA_ARGS__),
#define EMULATED_KERNELS(...)                                                                    \
    static const emu::Entry emulated_entries[] = {__VA_ARGS__};                                   \
    extern "C" int emu_count() { return int(sizeof(emulated_entries) / sizeof(emu::Entry)); }     \
    extern "C" const char* emu_name(int i) { return emulated_entries[i].name; }                   \
    extern "C" int emu_params(int i) { return emulated_entries[i].params; }                       \
    extern "C" size_t emu_param_size(int i, int j) { return emulated_entries[i].sizes[j]; }       \
    extern "C" const char* emu_param_types(int i) { return emulated_entries[i].types; }           \
    extern "C" const char* emu_error() { return emu::error.c_str(); }                             \
    extern "C" void emu_set_seed(unsigned long long s) { emu::seed = s; }                         \
    extern "C" int emu_launch(int i, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, \
                              unsigned bz, void** params) {                                       \
        return emulated_entries[i].launch(dim3{gx, gy, gz}, dim3{bx, by, bz}, params) ? 0 : 1;    \
    }
