// cuda_on_cpu.h: run unchanged CUDA C kernels on the CPU, for logic tests without a GPU.
//
// Include this header, then the .cu file, in one C++20 translation unit (g++ -std=c++20).
// It defines the CUDA built-ins a kernel uses (qualifiers, threadIdx & co., vector types, the
// _rn arithmetic intrinsics, __syncthreads, __syncwarp, the __shfl_*_sync family, atomics,
// fences, cache-hinted loads) and a launcher, hlcpu::launch(grid, block, fn), that runs
//   - the blocks one after another (order chosen by a policy), so __shared__ variables are
//     plain static storage, poisoned with 0xff bytes (NaN for floats) before every block;
//   - every CUDA thread of a block as a ucontext fiber, switched cooperatively at barriers
//     only: __syncthreads, __syncwarp and every shuffle. Which runnable fiber goes next is the
//     schedule policy: lowest thread first (a warp races ahead of the others: exposes a missing
//     __syncthreads), highest first, or seeded random.
// It reports (as an error of the launch, never by crashing):
//   - a deadlock: no fiber can run but some have not finished (a thread exited or waits at
//     another barrier while the rest wait at __syncthreads; a lane of a shuffle mask missing);
//   - __syncthreads reached from different source lines in one barrier phase;
//   - warp operations whose mask lacks the calling lane, whose lanes pass different masks or
//     are at different shuffle counts, or that read a lane outside the mask.
// Semantics follow the CUDA C++ Programming Guide (warp shuffle functions, synchronisation
// functions); warps are 32 lanes. This is a logic checker, not a performance model: memory is
// sequentially consistent, and atomics are trivially atomic because fibers never preempt.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <source_location>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define HLCPU_ASAN 1
#else
#define HLCPU_ASAN 0
#endif

// ---------------------------------------------------------------------------------------------
// Qualifiers and vector types
// ---------------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __constant__ static
// Static storage in its own section, so the launcher can poison all of it before each block.
#define __shared__ static __attribute__((section("hlcpu_shared")))

struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
    dim3() = default;
    dim3(unsigned int a, unsigned int b = 1, unsigned int c = 1) : x(a), y(b), z(c) {}
};
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) double2 { double x, y; };
struct alignas(8) int2 { int x, y; };
struct alignas(8) uint2 { unsigned int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };

inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline double2 make_double2(double x, double y) { return {x, y}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline uint2 make_uint2(unsigned int x, unsigned int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
    return {x, y, z, w};
}

inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------
// Arithmetic intrinsics (IEEE, round to nearest even; g++ on x86-64 without -mfma never fuses)
// ---------------------------------------------------------------------------------------------
inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
// Build with -ffp-contract=off (and no -mfma) so that nothing else fuses either.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline unsigned int __float2uint_rn(float f) { return (unsigned int)std::nearbyint(f); }
inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }
inline float __double2float_rn(double d) { return (float)d; }

template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// Atomics: fibers switch only at barriers, so a read-modify-write is never interleaved.
template <class T> inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <class T> inline T atomicSub(T* p, T v) { T old = *p; *p = old - v; return old; }
template <class T> inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
template <class T> inline T atomicMax(T* p, T v) { T old = *p; *p = old < v ? v : old; return old; }
template <class T> inline T atomicMin(T* p, T v) { T old = *p; *p = v < old ? v : old; return old; }
template <class T> inline T atomicOr(T* p, T v) { T old = *p; *p = old | v; return old; }
template <class T> inline T atomicAnd(T* p, T v) { T old = *p; *p = old & v; return old; }
template <class T> inline T atomicCAS(T* p, T cmp, T v) {
    T old = *p;
    if (old == cmp) *p = v;
    return old;
}

// ---------------------------------------------------------------------------------------------
// The fiber scheduler
// ---------------------------------------------------------------------------------------------
extern "C" char __start_hlcpu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_hlcpu_shared[] __attribute__((weak, visibility("hidden")));

namespace hlcpu {

enum Policy { LOWEST_FIRST = 0, HIGHEST_FIRST = 1, RANDOM = 2 };
enum State { RUNNABLE, AT_SYNCTHREADS, AT_WARP, DONE };

struct Fiber {
    ucontext_t ctx;
    State state = DONE;
    unsigned int tid = 0;
    unsigned int warp_mask = 0;  // mask passed to the pending warp operation
    unsigned long long warp_seq = 0;  // warp operations done by this lane
    std::source_location where;
};

struct Lane64 { unsigned char bytes[8]; };

struct Runtime {
    int policy = LOWEST_FIRST;
    unsigned long long rng = 0x9e3779b97f4a7c15ull;
    size_t stack_bytes = HLCPU_ASAN ? (512u << 10) : (128u << 10);
    std::vector<Fiber> fibers;
    std::vector<char*> stacks;
    ucontext_t sched;
    Fiber* current = nullptr;
    std::function<void()> body;
    std::string error;
    bool aborted = false;
    unsigned int nthreads = 0, at_barrier = 0;
    unsigned int low_hint = 0;  // no fiber below this index is runnable (LOWEST_FIRST scan)
    std::source_location barrier_where;
    // shuffle exchange: [warp][buffer][lane]
    std::vector<Lane64> exchange;
#if HLCPU_ASAN
    const void* sched_stack_bottom = nullptr;
    size_t sched_stack_size = 0;
#endif
};

inline Runtime& rt() {
    static Runtime r;
    return r;
}

inline std::string where_str(const std::source_location& l) {
    const char* f = l.file_name();
    const char* slash = std::strrchr(f, '/');
    return std::string(slash ? slash + 1 : f) + ":" + std::to_string(l.line());
}

inline std::string block_str() {
    return "block (" + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," +
           std::to_string(blockIdx.z) + ")";
}

// Switch from the current fiber to the scheduler (and back, unless `dying`).
inline void yield_to_scheduler(bool dying = false) {
    Runtime& r = rt();
    Fiber* f = r.current;
#if HLCPU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(dying ? nullptr : &fake, r.sched_stack_bottom,
                                   r.sched_stack_size);
    swapcontext(&f->ctx, &r.sched);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    (void)dying;
    swapcontext(&f->ctx, &r.sched);
#endif
}

// Record an error and leave the fiber for good; the launch returns it.
[[noreturn]] inline void fail(const std::string& msg) {
    Runtime& r = rt();
    if (r.error.empty()) r.error = msg;
    r.aborted = true;
    for (;;) yield_to_scheduler(true);
}

inline unsigned int lane_id() { return rt().current->tid & 31u; }  // linear thread id

inline void syncthreads(std::source_location loc) {
    Runtime& r = rt();
    Fiber* f = r.current;
    if (r.at_barrier == 0) r.barrier_where = loc;
    else if (loc.line() != r.barrier_where.line() ||
             std::strcmp(loc.file_name(), r.barrier_where.file_name()) != 0)
        fail("divergent __syncthreads in " + block_str() + ": thread " + std::to_string(f->tid) +
             " at " + where_str(loc) + ", others at " + where_str(r.barrier_where));
    f->state = AT_SYNCTHREADS;
    f->where = loc;
    if (++r.at_barrier == r.nthreads) {
        r.at_barrier = 0;
        for (Fiber& g : r.fibers) g.state = RUNNABLE;
        r.low_hint = 0;
    }
    yield_to_scheduler();
}

// Wait until every lane of `mask` has reached a warp operation with the same mask and count.
inline void warp_sync(unsigned int mask, const char* what, std::source_location loc) {
    Runtime& r = rt();
    Fiber* f = r.current;
    const unsigned int lane = lane_id();
    if (!(mask & (1u << lane)))
        fail(std::string(what) + " at " + where_str(loc) + ": mask 0x" + [&] {
            char b[16]; std::snprintf(b, sizeof b, "%08x", mask); return std::string(b);
        }() + " lacks the calling lane " + std::to_string(lane) + " (thread " +
             std::to_string(f->tid) + ", " + block_str() + ")");
    const unsigned int base = f->tid - lane;
    if (base + 32 > r.nthreads && (mask >> (r.nthreads - base)) != 0)
        fail(std::string(what) + " at " + where_str(loc) + ": mask names lanes beyond the block");
    f->state = AT_WARP;
    f->warp_mask = mask;
    f->where = loc;
    bool all = true;
    for (unsigned int l = 0; l < 32; ++l) {
        if (!(mask & (1u << l))) continue;
        Fiber& g = r.fibers[base + l];
        if (g.state != AT_WARP) { all = false; continue; }
        if (g.warp_mask != mask)
            fail(std::string(what) + " at " + where_str(loc) + ": lanes " +
                 std::to_string(lane) + " and " + std::to_string(l) + " pass different masks");
        if (g.warp_seq != f->warp_seq)
            fail(std::string(what) + " at " + where_str(loc) + ": lanes " + std::to_string(lane) +
                 " and " + std::to_string(l) + " are at different warp operations (divergence)");
    }
    if (all)
        for (unsigned int l = 0; l < 32; ++l)
            if (mask & (1u << l)) {
                r.fibers[base + l].state = RUNNABLE;
                r.fibers[base + l].warp_seq += 1;
                r.low_hint = std::min(r.low_hint, base + l);
            }
    yield_to_scheduler();
}

enum ShflKind { SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR };

template <class T>
inline T shfl(unsigned int mask, T var, int arg, int width, ShflKind kind, const char* what,
              std::source_location loc) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    Runtime& r = rt();
    Fiber* f = r.current;
    if (width <= 0 || width > 32 || (width & (width - 1)))
        fail(std::string(what) + " at " + where_str(loc) + ": width " + std::to_string(width) +
             " is not a power of 2 in [1, 32]");
    const unsigned int lane = lane_id(), warp = f->tid >> 5;
    const unsigned int buf = (unsigned int)(f->warp_seq & 1ull);  // double-buffered exchange
    Lane64& mine = r.exchange[(warp * 2 + buf) * 32 + lane];
    std::memcpy(mine.bytes, &var, sizeof(T));
    warp_sync(mask, what, loc);
    const int w = width, seg = (int)lane & ~(w - 1), pos = (int)lane - seg;
    int src;
    switch (kind) {
        case SHFL_IDX: src = seg + (((arg % w) + w) % w); break;
        case SHFL_UP: src = pos - arg < 0 ? (int)lane : (int)lane - arg; break;
        case SHFL_DOWN: src = pos + arg >= w ? (int)lane : (int)lane + arg; break;
        default: src = (int)lane ^ arg; if (src < seg || src >= seg + w) src = (int)lane; break;
    }
    if (!(mask & (1u << src)))
        fail(std::string(what) + " at " + where_str(loc) + ": lane " + std::to_string(lane) +
             " reads lane " + std::to_string(src) + ", which is not in the mask");
    T out;
    std::memcpy(&out, r.exchange[(warp * 2 + buf) * 32 + src].bytes, sizeof(T));
    return out;
}

inline void fiber_entry() {
    Runtime& r = rt();
#if HLCPU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &r.sched_stack_bottom, &r.sched_stack_size);
#endif
    r.body();
    r.current->state = DONE;
    yield_to_scheduler(true);
}

inline std::string describe_deadlock() {
    Runtime& r = rt();
    unsigned int done = 0, bar = 0, warp = 0;
    std::string bar_at, warp_at;
    for (Fiber& f : r.fibers) {
        if (f.state == DONE) ++done;
        if (f.state == AT_SYNCTHREADS) { ++bar; bar_at = where_str(f.where); }
        if (f.state == AT_WARP) { ++warp; warp_at = where_str(f.where); }
    }
    std::string s = "deadlock in " + block_str() + " of " + std::to_string(r.nthreads) +
                    " threads: ";
    if (bar) s += std::to_string(bar) + " wait at __syncthreads (" + bar_at + "); ";
    if (warp) s += std::to_string(warp) + " wait at a warp operation (" + warp_at + "); ";
    s += std::to_string(done) + " exited";
    return s;
}

inline unsigned long long next_rand() {
    unsigned long long& x = rt().rng;
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    return x;
}

// Run one block to completion; false (with rt().error set) on an error.
inline bool run_block() {
    Runtime& r = rt();
    if (__start_hlcpu_shared && __stop_hlcpu_shared)
        std::memset(__start_hlcpu_shared, 0xff, (size_t)(__stop_hlcpu_shared - __start_hlcpu_shared));
    r.at_barrier = 0;
    r.low_hint = 0;
    for (unsigned int t = 0; t < r.nthreads; ++t) {
        Fiber& f = r.fibers[t];
        f.state = RUNNABLE;
        f.tid = t;
        f.warp_seq = 0;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = r.stacks[t];
        f.ctx.uc_stack.ss_size = r.stack_bytes;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiber_entry, 0);
    }
    std::vector<unsigned int> runnable;
    runnable.reserve(r.nthreads);
    for (;;) {
        int pick = -1;
        if (r.policy == LOWEST_FIRST) {
            for (unsigned int t = r.low_hint; t < r.nthreads; ++t)
                if (r.fibers[t].state == RUNNABLE) { pick = (int)t; break; }
            r.low_hint = pick < 0 ? r.nthreads : (unsigned int)pick;
        } else if (r.policy == HIGHEST_FIRST) {
            for (unsigned int t = r.nthreads; t-- > 0;)
                if (r.fibers[t].state == RUNNABLE) { pick = (int)t; break; }
        } else {
            runnable.clear();
            for (unsigned int t = 0; t < r.nthreads; ++t)
                if (r.fibers[t].state == RUNNABLE) runnable.push_back(t);
            if (!runnable.empty()) pick = (int)runnable[next_rand() % runnable.size()];
        }
        if (pick < 0) {
            for (Fiber& f : r.fibers)
                if (f.state != DONE) { r.error = describe_deadlock(); return false; }
            return true;
        }
        Fiber& f = r.fibers[pick];
        r.current = &f;
        threadIdx = {f.tid % blockDim.x, (f.tid / blockDim.x) % blockDim.y,
                     f.tid / (blockDim.x * blockDim.y)};
#if HLCPU_ASAN
        void* fake = nullptr;
        __sanitizer_start_switch_fiber(&fake, f.ctx.uc_stack.ss_sp, f.ctx.uc_stack.ss_size);
        swapcontext(&r.sched, &f.ctx);
        __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
        swapcontext(&r.sched, &f.ctx);
#endif
        if (r.aborted) return false;
    }
}

// Launch `body` (a call of the kernel with its arguments) on grid x block. Returns "" on success
// or the error. policy: LOWEST_FIRST, HIGHEST_FIRST or RANDOM (seeded); blocks run in index
// order, reverse order, or a seeded random permutation, by the same policy.
inline std::string launch(dim3 grid, dim3 block, std::function<void()> body, int policy = 0,
                          unsigned long long seed = 1) {
    Runtime& r = rt();
    r.error.clear();
    r.aborted = false;
    r.policy = policy;
    r.rng = seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
    if (r.rng == 0) r.rng = 1;
    r.body = std::move(body);
    const unsigned long long nthreads = (unsigned long long)block.x * block.y * block.z;
    if (nthreads == 0 || nthreads > 1024) return "invalid block size " + std::to_string(nthreads);
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) return "invalid grid size";
    r.nthreads = (unsigned int)nthreads;
    r.fibers.resize(r.nthreads);
    while (r.stacks.size() < r.nthreads) r.stacks.push_back(static_cast<char*>(std::malloc(r.stack_bytes)));
    r.exchange.assign(((r.nthreads + 31) / 32) * 2 * 32, Lane64{});
    gridDim = grid;
    blockDim = block;
    std::vector<unsigned long long> order((unsigned long long)grid.x * grid.y * grid.z);
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    if (policy == HIGHEST_FIRST) std::reverse(order.begin(), order.end());
    if (policy == RANDOM)
        for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[next_rand() % i]);
    for (unsigned long long b : order) {
        blockIdx = {(unsigned int)(b % grid.x), (unsigned int)((b / grid.x) % grid.y),
                    (unsigned int)(b / ((unsigned long long)grid.x * grid.y))};
        if (!run_block()) return r.error.empty() ? "launch aborted" : r.error;
    }
    return "";
}

}  // namespace hlcpu

// ---------------------------------------------------------------------------------------------
// The synchronising built-ins
// ---------------------------------------------------------------------------------------------
inline void __syncthreads(std::source_location loc = std::source_location::current()) {
    hlcpu::syncthreads(loc);
}
inline void __syncwarp(unsigned int mask = 0xffffffffu,
                       std::source_location loc = std::source_location::current()) {
    hlcpu::warp_sync(mask, "__syncwarp", loc);
}
template <class T>
inline T __shfl_sync(unsigned int mask, T var, int src, int width = warpSize,
                     std::source_location loc = std::source_location::current()) {
    return hlcpu::shfl(mask, var, src, width, hlcpu::SHFL_IDX, "__shfl_sync", loc);
}
template <class T>
inline T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize,
                        std::source_location loc = std::source_location::current()) {
    return hlcpu::shfl(mask, var, (int)delta, width, hlcpu::SHFL_UP, "__shfl_up_sync", loc);
}
template <class T>
inline T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize,
                          std::source_location loc = std::source_location::current()) {
    return hlcpu::shfl(mask, var, (int)delta, width, hlcpu::SHFL_DOWN, "__shfl_down_sync", loc);
}
template <class T>
inline T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = warpSize,
                         std::source_location loc = std::source_location::current()) {
    return hlcpu::shfl(mask, var, lane_mask, width, hlcpu::SHFL_XOR, "__shfl_xor_sync", loc);
}
