// The CPU logic gate's shared library: kernels/trust_ratio.cu, unchanged, on cuda_on_cpu.h.
//
// Built at test time (kernels/testing/harness.py) with
//   g++ -std=c++20 -O2 -fPIC -shared -ffp-contract=off -fno-strict-aliasing [-DHLCPU_SOURCE=...]
// and driven from Python through ctypes. Exports:
//   int hlcpu_launch(name, grid, block, args, policy, seed)   like cuLaunchKernel: `args` is
//       an array of pointers to the argument values; 0 = ok, 1 = kernel error (deadlock,
//       divergence, bad warp mask: hlcpu_last_error() says which), 2 = unknown kernel name
//   const char* hlcpu_last_error()
//   hlcpu_{f16,bf16}_{to,from}_f32   the kernel's 16-bit conversions, for exhaustive checks
// and a few self-test kernels (hlcpu_selftest_*) that pin the emulator's own semantics.
#include "cuda_on_cpu.h"

#ifdef HLCPU_SOURCE
#include HLCPU_SOURCE   // a mutated copy of the kernel, for the tests that the gate catches bugs
#else
#include "../trust_ratio.cu"
#endif

#include <map>
#include <string>
#include <tuple>
#include <type_traits>

namespace {

std::string g_error;

template <class... P, size_t... I>
std::function<void()> bind_args(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
    std::tuple<std::remove_cv_t<P>...> values{
        *static_cast<std::remove_cv_t<P>*>(args[I])...};   // copied at launch, as CUDA does
    return [kernel, values] { std::apply(kernel, values); };
}

template <class... P>
std::function<std::function<void()>(void**)> entry(void (*kernel)(P...)) {
    return [kernel](void** args) { return bind_args(kernel, args, std::index_sequence_for<P...>{}); };
}

}  // namespace

// ---- self-test kernels: the emulator's semantics, checked by tests/test_kernel_logic.py ----

// out[6 * tid + k]: shfl_down(lane, 1), shfl_up(lane, 2), shfl_xor(lane, 5), shfl(lane, 7),
// shfl_down(lane, 3, width 8), shfl(lane, lane + 1 mod width, width 4)
extern "C" __global__ void hlcpu_selftest_shfl(int* out) {
    const int lane = threadIdx.x & 31, t = threadIdx.x;
    out[6 * t + 0] = __shfl_down_sync(0xffffffffu, lane, 1);
    out[6 * t + 1] = __shfl_up_sync(0xffffffffu, lane, 2);
    out[6 * t + 2] = __shfl_xor_sync(0xffffffffu, lane, 5);
    out[6 * t + 3] = __shfl_sync(0xffffffffu, lane, 7);
    out[6 * t + 4] = __shfl_down_sync(0xffffffffu, lane, 3, 8);
    out[6 * t + 5] = __shfl_sync(0xffffffffu, lane, lane + 1, 4);
}

// out[tid] = the value atomicAdd returned; *counter ends at the number of threads in the grid.
extern "C" __global__ void hlcpu_selftest_atomic(int* counter, int* out) {
    __syncthreads();   // interleave the threads before the atomics
    out[blockIdx.x * blockDim.x + threadIdx.x] = atomicAdd(counter, 1);
}

// Shared memory across a barrier: out[t] = 10 * (n - 1 - t) + blockIdx.x, with or without the
// barrier (the second kernel is wrong without one).
extern "C" __global__ void hlcpu_selftest_shared(int* out, int use_barrier) {
    __shared__ int s[1024];
    s[threadIdx.x] = 10 * threadIdx.x + blockIdx.x;
    if (use_barrier) __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];
}

// Thread 0 leaves before the barrier: a deadlock.
extern "C" __global__ void hlcpu_selftest_exit_before_barrier(int* out) {
    if (threadIdx.x == 0) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}

// Odd and even threads at different __syncthreads: divergent barrier.
extern "C" __global__ void hlcpu_selftest_divergent_barrier(int* out) {
    if (threadIdx.x & 1) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1;
}

// Lanes 16..31 skip a full-mask shuffle: a deadlock.
extern "C" __global__ void hlcpu_selftest_missing_lane(int* out) {
    if ((threadIdx.x & 31) < 16) out[threadIdx.x] = __shfl_sync(0xffffffffu, 1, 0);
}

// Lanes 0..15 shuffle with a half mask but read lane 20: outside the mask.
extern "C" __global__ void hlcpu_selftest_read_outside_mask(int* out) {
    if ((threadIdx.x & 31) < 16) out[threadIdx.x] = __shfl_sync(0x0000ffffu, 1, 20);
}

// __syncwarp with a mask that lacks the calling lane.
extern "C" __global__ void hlcpu_selftest_bad_syncwarp(int* out) {
    __syncwarp(0x1u);
    out[threadIdx.x] = 1;
}

namespace {

const std::map<std::string, std::function<std::function<void()>(void**)>>& kernels() {
    static const std::map<std::string, std::function<std::function<void()>(void**)>> k = {
        {"hl_norms_pass1", entry(hl_norms_pass1)},
        {"hl_lamb_pass1", entry(hl_lamb_pass1)},
        {"hl_lars_apply", entry(hl_lars_apply)},
        {"hl_lamb_apply", entry(hl_lamb_apply)},
        {"hlcpu_selftest_shfl", entry(hlcpu_selftest_shfl)},
        {"hlcpu_selftest_atomic", entry(hlcpu_selftest_atomic)},
        {"hlcpu_selftest_shared", entry(hlcpu_selftest_shared)},
        {"hlcpu_selftest_exit_before_barrier", entry(hlcpu_selftest_exit_before_barrier)},
        {"hlcpu_selftest_divergent_barrier", entry(hlcpu_selftest_divergent_barrier)},
        {"hlcpu_selftest_missing_lane", entry(hlcpu_selftest_missing_lane)},
        {"hlcpu_selftest_read_outside_mask", entry(hlcpu_selftest_read_outside_mask)},
        {"hlcpu_selftest_bad_syncwarp", entry(hlcpu_selftest_bad_syncwarp)},
    };
    return k;
}

}  // namespace

extern "C" {

int hlcpu_launch(const char* name, unsigned int grid, unsigned int block, void** args,
                 int policy, unsigned long long seed) {
    const auto& k = kernels();
    auto it = k.find(name);
    if (it == k.end()) {
        g_error = std::string("unknown kernel ") + name;
        return 2;
    }
    g_error = hlcpu::launch(dim3(grid), dim3(block), it->second(args), policy, seed);
    return g_error.empty() ? 0 : 1;
}

const char* hlcpu_last_error() { return g_error.c_str(); }

void hlcpu_f16_to_f32(const unsigned short* in, float* out, long long n) {
    for (long long i = 0; i < n; ++i) out[i] = hl_f16_to_f32(in[i]);
}
void hlcpu_f16_from_f32(const float* in, unsigned short* out, long long n) {
    for (long long i = 0; i < n; ++i) out[i] = (unsigned short)hl_f32_to_f16(in[i]);
}
void hlcpu_bf16_to_f32(const unsigned short* in, float* out, long long n) {
    for (long long i = 0; i < n; ++i) out[i] = hl_bf16_to_f32(in[i]);
}
void hlcpu_bf16_from_f32(const float* in, unsigned short* out, long long n) {
    for (long long i = 0; i < n; ++i) out[i] = (unsigned short)hl_f32_to_bf16(in[i]);
}

}  // extern "C"
