// Fused per-layer norms, trust ratios and LARS/LAMB updates for every layer in one launch.
//
// Compiled at run time by CuPy/NVRTC (hpclb/kernels.py hands this file's text, unchanged, to
// cupy.RawModule), checked offline by nvcc (tests/test_kernel_compile.py) and run on the CPU
// through kernels/testing/cuda_on_cpu.h (tests/test_kernel_logic.py). It therefore includes no
// header and uses only CUDA built-ins; the few lines that need PTX sit under __CUDA_ARCH__ and
// have a portable twin that the CPU gate exercises.
//
// Design (the chunked multi-tensor scheme of NVIDIA apex's multi_tensor_apply / l2norm, written
// anew): every tensor is cut into chunks of `chunk_size` elements (an empty tensor still owns one
// chunk, so every tensor is finalised). The host builds, once per parameter list, a table in
// device memory (not in kernel arguments, so thousands of tensors fit in one launch):
//   desc[t*8 + 0..7] = w ptr, g ptr, m ptr, v ptr (0 = absent), numel, first chunk,
//                      meta (dtype | adapt << 8), hyper-parameter row
//   chunk_tensor[c]  = the tensor that owns global chunk c
//   hp[row*16 + k]   = fp32 hyper-parameters (HL_HP_* below)
// A grid-stride loop hands chunks to blocks. Pass 1 reduces sum(w^2) and sum(g^2) (or sum(u^2)
// for LAMB) of one chunk per block in fp32, writes a per-chunk partial (no float atomics), and
// the block that completes a tensor (an integer ticket counter, reset by that block) sums the
// tensor's partials in a fixed order in fp64, takes the square roots and writes the norms, the
// trust ratio and the non-finite count. Results are bitwise deterministic for a given block size
// and chunk size, whatever the order in which blocks run.
//
// Formulas (LARS: You, Gitman, Ginsburg 2017, arXiv 1708.03888; LAMB: You et al., ICLR 2020,
// arXiv 1904.00962):
//   LARS  ratio = eta*|w| / (|g| + wd*|w| + eps)
//   LAMB  u = m_hat / (sqrt(v_hat) + eps) + wd*w,   ratio = |w| / |u|
//   ratio = 1 when the layer is excluded (adapt = 0) or |w| or |g| (|u|) is 0 (or NaN);
//   otherwise, when the row's HL_HP_TMAX > 0 (a trust-ratio clamp is set; a valid clamp has
//   max > min >= 0), ratio = min(max(ratio, HL_HP_TMIN), HL_HP_TMAX), NaN kept.
// Non-finite layers: pass 1 counts the layers whose |w| or |g| (|u|) is inf/NaN; pass 2 leaves
// such a layer's w, m and v untouched (it reads the norms of pass 1). The found-inf flag
// (`found_inf`, a device fp32 scalar or 0 = none; torch's GradScaler contract): when it is set
// and not 0, pass 1 still writes the norms and ratios but counts every layer as skipped, and
// pass 2 changes nothing (no w, m or v is written). LAMB's pass 1 therefore
// only reads the moments; pass 2 recomputes them (same arithmetic, same bits) and stores them.
// The element-wise arithmetic uses the _rn intrinsics (no FMA contraction) in the same order as
// hpclb/optim/lars.py and lamb.py, so the fused step follows the torch path rounding for rounding.
//
// Kernels: hl_norms_pass1 (pass 1, LARS or LAMB_NORMS), hl_lamb_pass1 (pass 1, LAMB_FUSED),
// hl_lars_apply and hl_lamb_apply (pass 2). Launch contract (hpclb/kernels.py keeps it):
// blockDim.x a multiple of 32, at most HL_MAX_THREADS (HL_MAX_THREADS_LAMB for the LAMB
// kernels); a 1-D grid of any size >= 1; tickets zeroed once when the table is built; one
// stream at a time per table (the partials and tickets are the table's scratch space; the host
// keys its table cache by stream).

#define HL_MAX_THREADS 1024
#define HL_MAX_THREADS_LAMB 512   // hl_lamb_pass1 and hl_lamb_apply
#define HL_MAX_WARPS (HL_MAX_THREADS / 32)
#define HL_DESC_WORDS 8
#define HL_HP_WORDS 16

// desc slots
#define HL_D_W 0
#define HL_D_G 1
#define HL_D_M 2
#define HL_D_V 3
#define HL_D_NUMEL 4
#define HL_D_FIRST 5
#define HL_D_META 6
#define HL_D_ROW 7

// hyper-parameter slots (fp32)
#define HL_HP_LR 0
#define HL_HP_ETA 1
#define HL_HP_WD 2
#define HL_HP_EPS 3
#define HL_HP_BETA1 4   // LARS: momentum
#define HL_HP_BETA2 5
#define HL_HP_BC1 6     // 1 - beta1^t
#define HL_HP_BC2 7     // 1 - beta2^t
#define HL_HP_OMB1 8    // 1 - beta1
#define HL_HP_OMB2 9    // 1 - beta2
#define HL_HP_TMIN 10   // trust-ratio clamp: lower bound (used when HL_HP_TMAX > 0)
#define HL_HP_TMAX 11   // trust-ratio clamp: upper bound; 0 = no clamp

// dtype codes
#define HL_F32 0
#define HL_F16 1
#define HL_BF16 2

// pass-1 modes
#define HL_MODE_LARS 0        // norms of w and g, LARS ratio
#define HL_MODE_LAMB_NORMS 1  // norms of w and u (u given in the g slot), LAMB ratio
#define HL_MODE_LAMB_FUSED 2  // update m, v from g, form u on the fly, norms of w and u

// ---------------------------------------------------------------------------------------------
// Scalar helpers and 16-bit conversions
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ long long hl_min_ll(long long a, long long b) { return a < b ? a : b; }

__device__ __forceinline__ long long hl_nchunks(long long numel, int chunk_size) {
    return numel <= 0 ? 1 : (numel + chunk_size - 1) / chunk_size;
}

__device__ __forceinline__ bool hl_isfinite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// The found-inf flag is set: the whole step is skipped (NaN counts as set, as in the torch path).
__device__ __forceinline__ bool hl_skip(const float* found_inf) {
    return found_inf != nullptr && !(*found_inf == 0.0f);
}

__device__ __forceinline__ float hl_bf16_to_f32(unsigned int h) {
    return __uint_as_float((h & 0xffffu) << 16);
}

// Round to nearest even; NaN stays a quiet NaN of the same sign.
__device__ __forceinline__ unsigned int hl_f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu;
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}

__device__ __forceinline__ float hl_f16_to_f32(unsigned int h) {
#if defined(__CUDA_ARCH__)
    float f;
    unsigned short hs = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(hs));
    return f;
#else
    const unsigned int sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (e == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (man << 13));
    if (e != 0u) return __uint_as_float(sign | ((e + 112u) << 23) | (man << 13));
    // zero or subnormal: man * 2^-24, exact in fp32
    return __uint_as_float(sign | __float_as_uint((float)man * 5.9604644775390625e-08f));
#endif
}

// Round to nearest even, overflow to inf, NaN stays a quiet NaN.
__device__ __forceinline__ unsigned int hl_f32_to_f16(float f) {
#if defined(__CUDA_ARCH__)
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    const unsigned int u = __float_as_uint(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | ((a >> 13) & 0x3ffu);
    if (a >= 0x477ff000u) return sign | 0x7c00u;           // >= 65520 rounds to inf
    if (a >= 0x38800000u) {                                // normal half (>= 2^-14)
        unsigned int r = a - 0x38000000u;                  // rebias the exponent by 127 - 15
        r += 0xfffu + ((r >> 13) & 1u);
        return sign | (r >> 13);
    }
    if (a < 0x33000000u) return sign;                      // < 2^-25 rounds to 0
    return sign | __float2uint_rn(__uint_as_float(a) * 16777216.0f);  // subnormal: m * 2^-24
#endif
}

// ---------------------------------------------------------------------------------------------
// Typed loads and stores: scalar and 16-byte vectors (4 fp32 or 8 fp16/bf16 values)
// ---------------------------------------------------------------------------------------------

template <int DT> struct HlType;
template <> struct HlType<HL_F32> { enum { SIZE = 4, VEC = 4 }; };
template <> struct HlType<HL_F16> { enum { SIZE = 2, VEC = 8 }; };
template <> struct HlType<HL_BF16> { enum { SIZE = 2, VEC = 8 }; };

template <int DT> __device__ __forceinline__ float hl_from_bits(unsigned int b) {
    if (DT == HL_F32) return __uint_as_float(b);
    if (DT == HL_F16) return hl_f16_to_f32(b);
    return hl_bf16_to_f32(b);
}

template <int DT> __device__ __forceinline__ unsigned int hl_to_bits(float x) {
    if (DT == HL_F32) return __float_as_uint(x);
    if (DT == HL_F16) return hl_f32_to_f16(x);
    return hl_f32_to_bf16(x);
}

// x rounded to the storage type and back (identity for fp32).
template <int DT> __device__ __forceinline__ float hl_round(float x) {
    return DT == HL_F32 ? x : hl_from_bits<DT>(hl_to_bits<DT>(x));
}

template <int DT> __device__ __forceinline__ float hl_load1(const char* p, long long i) {
    if (DT == HL_F32) return reinterpret_cast<const float*>(p)[i];
    return hl_from_bits<DT>(reinterpret_cast<const unsigned short*>(p)[i]);
}

template <int DT> __device__ __forceinline__ void hl_store1(char* p, long long i, float x) {
    if (DT == HL_F32) reinterpret_cast<float*>(p)[i] = x;
    else reinterpret_cast<unsigned short*>(p)[i] = (unsigned short)hl_to_bits<DT>(x);
}

// Element e of a 16-byte vector held as four 32-bit words.
template <int DT> __device__ __forceinline__ float hl_vget(const uint4& r, int e) {
    if (DT == HL_F32) {
        const unsigned int word = e == 0 ? r.x : e == 1 ? r.y : e == 2 ? r.z : r.w;
        return __uint_as_float(word);
    }
    const int k = e >> 1;
    const unsigned int word = k == 0 ? r.x : k == 1 ? r.y : k == 2 ? r.z : r.w;
    return hl_from_bits<DT>((e & 1) ? (word >> 16) : (word & 0xffffu));
}

template <int DT> __device__ __forceinline__ void hl_vset(uint4& r, int e, float x) {
    unsigned int bits = hl_to_bits<DT>(x);
    unsigned int* word;
    const int k = DT == HL_F32 ? e : (e >> 1);
    word = k == 0 ? &r.x : k == 1 ? &r.y : k == 2 ? &r.z : &r.w;
    if (DT == HL_F32) *word = bits;
    else if (e & 1) *word = (*word & 0x0000ffffu) | (bits << 16);
    else *word = (*word & 0xffff0000u) | (bits & 0xffffu);
}

__device__ __forceinline__ bool hl_aligned16(const char* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull;
}

// ---------------------------------------------------------------------------------------------
// Element-wise operations. Each sees one element of w, g, m, v (fp32 copies; unused slots hold
// 0) and may change w, m, v and add to the two sums. Flags say which arrays it reads/writes.
// ---------------------------------------------------------------------------------------------

struct HlSumSq {          // pass 1, LARS and LAMB_NORMS: sum w^2 and g^2
    enum { RG = 1, RM = 0, RV = 0, WW = 0, WM = 0, WV = 0 };
    __device__ __forceinline__ void operator()(float& w, float g, float&, float&,
                                               float& sw, float& so) const {
        sw += w * w;
        so += g * g;
    }
};

struct HlSumSqW {         // pass 1 when the gradient is missing: it counts as zeros
    enum { RG = 0, RM = 0, RV = 0, WW = 0, WM = 0, WV = 0 };
    __device__ __forceinline__ void operator()(float& w, float, float&, float&,
                                               float& sw, float&) const {
        sw += w * w;
    }
};

struct HlLambHp {
    float wd, eps, beta1, beta2, omb1, omb2, bc1, bc2;
};

__device__ __forceinline__ HlLambHp hl_lamb_hp(const float* h, bool adapt) {
    HlLambHp p;
    p.wd = adapt ? h[HL_HP_WD] : 0.0f;
    p.eps = h[HL_HP_EPS];
    p.beta1 = h[HL_HP_BETA1];
    p.beta2 = h[HL_HP_BETA2];
    p.omb1 = h[HL_HP_OMB1];
    p.omb2 = h[HL_HP_OMB2];
    p.bc1 = h[HL_HP_BC1];
    p.bc2 = h[HL_HP_BC2];
    return p;
}

// u = m_hat / (sqrt(v_hat) + eps) + wd * w, in the order of hpclb/optim/lamb.py.
__device__ __forceinline__ float hl_lamb_u(float w, float m, float v, const HlLambHp& p) {
    const float m_hat = __fdiv_rn(m, p.bc1);
    const float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(v, p.bc2)), p.eps);
    return __fadd_rn(__fdiv_rn(m_hat, denom), __fmul_rn(w, p.wd));
}

// The new moments, rounded to the storage type (u must come from the stored values):
// torch.lerp(m, g, 1 - beta1) and v * beta2 + (1 - beta2) * g * g.
template <int DT>
__device__ __forceinline__ void hl_lamb_moments(float g, float& m, float& v, const HlLambHp& p) {
    if (p.omb1 < 0.5f) m = __fadd_rn(m, __fmul_rn(p.omb1, __fsub_rn(g, m)));
    else m = __fsub_rn(g, __fmul_rn(__fsub_rn(g, m), p.beta1));
    v = __fadd_rn(__fmul_rn(v, p.beta2), __fmul_rn(__fmul_rn(g, g), p.omb2));
    m = hl_round<DT>(m);
    v = hl_round<DT>(v);
}

template <int DT> struct HlLambMoments {   // pass 1, LAMB_FUSED: u from the new moments (not
    enum { RG = 1, RM = 1, RV = 1, WW = 0, WM = 0, WV = 0 };   // stored), sums of w^2, u^2
    HlLambHp p;
    __device__ __forceinline__ void operator()(float& w, float g, float& m, float& v,
                                               float& sw, float& so) const {
        hl_lamb_moments<DT>(g, m, v, p);
        const float u = hl_lamb_u(w, m, v, p);
        sw += w * w;
        so += u * u;
    }
};

struct HlLarsApply {      // pass 2, LARS: v <- m*v + step*(g + wd*w); w <- w - v
    enum { RG = 1, RM = 1, RV = 0, WW = 1, WM = 1, WV = 0 };
    float step, wd, momentum;
    __device__ __forceinline__ void operator()(float& w, float g, float& m, float&,
                                               float&, float&) const {
        const float d = __fmul_rn(__fadd_rn(g, __fmul_rn(w, wd)), step);
        m = __fadd_rn(__fmul_rn(m, momentum), d);
        w = __fsub_rn(w, m);
    }
};

template <int DT> struct HlLambApply {   // pass 2, LAMB: new moments stored, w <- w - step*u
    enum { RG = 1, RM = 1, RV = 1, WW = 1, WM = 1, WV = 1 };
    HlLambHp p;
    float step;
    __device__ __forceinline__ void operator()(float& w, float g, float& m, float& v,
                                               float&, float&) const {
        hl_lamb_moments<DT>(g, m, v, p);
        w = __fsub_rn(w, __fmul_rn(hl_lamb_u(w, m, v, p), step));
    }
};

// Apply `op` to elements [begin, end) of one tensor, by the whole block. 16-byte vector
// accesses (two per thread in flight) when every array used is 16-byte aligned at `begin`,
// scalar accesses for the rest. Returns this thread's two partial sums.
template <int DT, class Op>
__device__ __forceinline__ float2 hl_chunk(const long long* d, long long begin, long long end,
                                           const Op& op) {
    const int S = HlType<DT>::SIZE, VEC = HlType<DT>::VEC;
    char* w = reinterpret_cast<char*>(d[HL_D_W]);
    char* g = reinterpret_cast<char*>(d[HL_D_G]);
    char* m = reinterpret_cast<char*>(d[HL_D_M]);
    char* v = reinterpret_cast<char*>(d[HL_D_V]);
    float sw0 = 0.0f, so0 = 0.0f, sw1 = 0.0f, so1 = 0.0f;
    long long i = begin;
    const long long off = begin * S;
    const bool vec = hl_aligned16(w + off) && (!Op::RG || hl_aligned16(g + off)) &&
                     (!(Op::RM || Op::WM) || hl_aligned16(m + off)) &&
                     (!(Op::RV || Op::WV) || hl_aligned16(v + off));
    if (vec) {
        const long long nv = (end - begin) / VEC;
        uint4* wv = reinterpret_cast<uint4*>(w + off);
        const uint4* gv = reinterpret_cast<const uint4*>(g + off);
        uint4* mv = reinterpret_cast<uint4*>(m + off);
        uint4* vv = reinterpret_cast<uint4*>(v + off);
        const long long bd = blockDim.x;
        for (long long k = threadIdx.x; k < nv; k += 2 * bd) {
            const long long k1 = k + bd;
            const bool two = k1 < nv;
            const uint4 z = make_uint4(0u, 0u, 0u, 0u);
            uint4 rw0 = wv[k], rg0 = z, rm0 = z, rv0 = z;
            uint4 rw1 = z, rg1 = z, rm1 = z, rv1 = z;
            if (Op::RG) rg0 = gv[k];
            if (Op::RM) rm0 = mv[k];
            if (Op::RV) rv0 = vv[k];
            if (two) {
                rw1 = wv[k1];
                if (Op::RG) rg1 = gv[k1];
                if (Op::RM) rm1 = mv[k1];
                if (Op::RV) rv1 = vv[k1];
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                float xw = hl_vget<DT>(rw0, e), xg = hl_vget<DT>(rg0, e);
                float xm = hl_vget<DT>(rm0, e), xv = hl_vget<DT>(rv0, e);
                op(xw, xg, xm, xv, sw0, so0);
                if (Op::WW) hl_vset<DT>(rw0, e, xw);
                if (Op::WM) hl_vset<DT>(rm0, e, xm);
                if (Op::WV) hl_vset<DT>(rv0, e, xv);
            }
            if (Op::WW) wv[k] = rw0;
            if (Op::WM) mv[k] = rm0;
            if (Op::WV) vv[k] = rv0;
            if (two) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    float xw = hl_vget<DT>(rw1, e), xg = hl_vget<DT>(rg1, e);
                    float xm = hl_vget<DT>(rm1, e), xv = hl_vget<DT>(rv1, e);
                    op(xw, xg, xm, xv, sw1, so1);
                    if (Op::WW) hl_vset<DT>(rw1, e, xw);
                    if (Op::WM) hl_vset<DT>(rm1, e, xm);
                    if (Op::WV) hl_vset<DT>(rv1, e, xv);
                }
                if (Op::WW) wv[k1] = rw1;
                if (Op::WM) mv[k1] = rm1;
                if (Op::WV) vv[k1] = rv1;
            }
        }
        i = begin + nv * VEC;
    }
    for (long long j = i + threadIdx.x; j < end; j += blockDim.x) {   // tail, or unaligned
        float xw = hl_load1<DT>(w, j);
        float xg = Op::RG ? hl_load1<DT>(g, j) : 0.0f;
        float xm = Op::RM ? hl_load1<DT>(m, j) : 0.0f;
        float xv = Op::RV ? hl_load1<DT>(v, j) : 0.0f;
        op(xw, xg, xm, xv, sw0, so0);
        if (Op::WW) hl_store1<DT>(w, j, xw);
        if (Op::WM) hl_store1<DT>(m, j, xm);
        if (Op::WV) hl_store1<DT>(v, j, xv);
    }
    return make_float2(sw0 + sw1, so0 + so1);
}

// ---------------------------------------------------------------------------------------------
// Block reductions: fixed shuffle tree within warps, then warp 0 over the warps' results.
// Every thread of the block must call them; the result is valid in thread 0.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float2 hl_warp_sum(float2 a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        a.x += __shfl_down_sync(0xffffffffu, a.x, o);
        a.y += __shfl_down_sync(0xffffffffu, a.y, o);
    }
    return a;
}

__device__ __forceinline__ double2 hl_warp_sum(double2 a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        a.x += __shfl_down_sync(0xffffffffu, a.x, o);
        a.y += __shfl_down_sync(0xffffffffu, a.y, o);
    }
    return a;
}

__device__ float2 hl_block_sum(float2 a) {
    __shared__ float2 s_warp[HL_MAX_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    a = hl_warp_sum(a);
    if (lane == 0) s_warp[warp] = a;
    __syncthreads();
    if (warp == 0) {
        a = lane < nwarps ? s_warp[lane] : make_float2(0.0f, 0.0f);
        a = hl_warp_sum(a);
    }
    __syncthreads();   // s_warp is written again by the next call
    return a;
}

__device__ double2 hl_block_sum(double2 a) {
    __shared__ double2 s_warp_d[HL_MAX_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    a = hl_warp_sum(a);
    if (lane == 0) s_warp_d[warp] = a;
    __syncthreads();
    if (warp == 0) {
        a = lane < nwarps ? s_warp_d[lane] : make_double2(0.0, 0.0);
        a = hl_warp_sum(a);
    }
    __syncthreads();
    return a;
}

// ---------------------------------------------------------------------------------------------
// Pass 1
// ---------------------------------------------------------------------------------------------

// Norms, trust ratio and non-finite count of tensor t from its sums of squares (thread 0 only).
__device__ void hl_finalize(int t, const long long* d, const float* h, int mode, double sw,
                           double so, float* ratio, float* w_norm, float* o_norm,
                           int* nonfinite, bool skip) {
    const float wn = (float)__dsqrt_rn(sw), on = (float)__dsqrt_rn(so);
    const bool adapt = ((d[HL_D_META] >> 8) & 1) != 0;
    float r = 1.0f;
    if (adapt && wn > 0.0f && on > 0.0f) {   // false for NaN norms too, as in the torch path
        if (mode == HL_MODE_LARS) {
            const float den = __fadd_rn(__fadd_rn(on, __fmul_rn(h[HL_HP_WD], wn)), h[HL_HP_EPS]);
            r = __fdiv_rn(__fmul_rn(h[HL_HP_ETA], wn), den);
        } else {
            r = __fdiv_rn(wn, on);
        }
        const float tmax = h[HL_HP_TMAX];
        if (tmax > 0.0f) {   // comparisons keep a NaN ratio NaN, as torch.clamp does
            const float tmin = h[HL_HP_TMIN];
            r = r < tmin ? tmin : (r > tmax ? tmax : r);
        }
    }
    ratio[t] = r;
    w_norm[t] = wn;
    o_norm[t] = on;
    if (skip || !(hl_isfinite(wn) && hl_isfinite(on))) atomicAdd(nonfinite, 1);
}

template <int DT>
__device__ float2 hl_pass1_chunk(int mode, const long long* d, const float* h, long long begin,
                                 long long end) {
    if (mode == HL_MODE_LAMB_FUSED) {
        HlLambMoments<DT> op;
        op.p = hl_lamb_hp(h, ((d[HL_D_META] >> 8) & 1) != 0);
        return hl_chunk<DT>(d, begin, end, op);
    }
    if (d[HL_D_G] != 0) return hl_chunk<DT>(d, begin, end, HlSumSq());
    return hl_chunk<DT>(d, begin, end, HlSumSqW());
}

// The body of both pass-1 kernels. FUSED: LAMB_FUSED mode only; else LARS or LAMB_NORMS.
template <bool FUSED>
__device__ __forceinline__ void hl_pass1(const long long* __restrict__ desc,
                                         const int* __restrict__ chunk_tensor, int n_chunks,
                                         int chunk_size, const float* __restrict__ hp, int mode,
                                         float2* __restrict__ partials,
                                         unsigned int* __restrict__ tickets,
                                         float* __restrict__ ratio, float* __restrict__ w_norm,
                                         float* __restrict__ o_norm,
                                         int* __restrict__ nonfinite,
                                         const float* __restrict__ found_inf) {
    __shared__ int s_last;
    const bool skip = hl_skip(found_inf);
    if (FUSED) mode = HL_MODE_LAMB_FUSED;
    else if (mode == HL_MODE_LAMB_FUSED) mode = HL_MODE_LAMB_NORMS;
    for (int c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const int t = chunk_tensor[c];
        const long long* d = desc + (long long)t * HL_DESC_WORDS;
        const long long numel = d[HL_D_NUMEL], first = d[HL_D_FIRST];
        const long long begin = (long long)(c - first) * chunk_size;
        const long long end = hl_min_ll(begin + chunk_size, numel);
        const float* h = hp + d[HL_D_ROW] * HL_HP_WORDS;
        const int dtype = (int)(d[HL_D_META] & 0xff);
        float2 s;
        if (dtype == HL_F16) s = hl_pass1_chunk<HL_F16>(mode, d, h, begin, end);
        else if (dtype == HL_BF16) s = hl_pass1_chunk<HL_BF16>(mode, d, h, begin, end);
        else s = hl_pass1_chunk<HL_F32>(mode, d, h, begin, end);
        s = hl_block_sum(s);
        const long long nct = hl_nchunks(numel, chunk_size);
        if (nct == 1) {   // the only chunk: finalise at once, no partial, no ticket
            if (threadIdx.x == 0)
                hl_finalize(t, d, h, mode, (double)s.x, (double)s.y, ratio, w_norm, o_norm,
                            nonfinite, skip);
            continue;
        }
        if (threadIdx.x == 0) {
            partials[c] = s;
            __threadfence();   // the partial is visible before the ticket is taken
            const unsigned int done = atomicAdd(&tickets[t], 1u);
            s_last = done == (unsigned int)(nct - 1);
        }
        __syncthreads();
        if (s_last) {   // this block completed tensor t: sum its partials in a fixed order
            double2 acc = make_double2(0.0, 0.0);
            for (long long k = threadIdx.x; k < nct; k += blockDim.x) {
                const float2 p = __ldcg(&partials[first + k]);
                acc.x += (double)p.x;
                acc.y += (double)p.y;
            }
            acc = hl_block_sum(acc);
            if (threadIdx.x == 0) {
                hl_finalize(t, d, h, mode, acc.x, acc.y, ratio, w_norm, o_norm, nonfinite,
                            skip);
                tickets[t] = 0u;   // ready for the next launch on this table
            }
        }
        // No barrier needed before s_last is written again: thread 0 does that only after the
        // two barriers of the next hl_block_sum, which every thread reaches after reading it.
    }
}

// Pass 1, modes LARS and LAMB_NORMS.
extern "C" __global__ void __launch_bounds__(HL_MAX_THREADS)
hl_norms_pass1(const long long* __restrict__ desc, const int* __restrict__ chunk_tensor,
               int n_chunks, int chunk_size, const float* __restrict__ hp, int mode,
               float2* __restrict__ partials, unsigned int* __restrict__ tickets,
               float* __restrict__ ratio, float* __restrict__ w_norm,
               float* __restrict__ o_norm, int* __restrict__ nonfinite,
               const float* __restrict__ found_inf) {
    hl_pass1<false>(desc, chunk_tensor, n_chunks, chunk_size, hp, mode, partials, tickets, ratio,
                    w_norm, o_norm, nonfinite, found_inf);
}

// Pass 1, mode LAMB_FUSED (the `mode` argument is ignored). More registers per thread (the IEEE
// divisions of u), hence the smaller block limit.
extern "C" __global__ void __launch_bounds__(HL_MAX_THREADS_LAMB)
hl_lamb_pass1(const long long* __restrict__ desc, const int* __restrict__ chunk_tensor,
              int n_chunks, int chunk_size, const float* __restrict__ hp, int mode,
              float2* __restrict__ partials, unsigned int* __restrict__ tickets,
              float* __restrict__ ratio, float* __restrict__ w_norm,
              float* __restrict__ o_norm, int* __restrict__ nonfinite,
              const float* __restrict__ found_inf) {
    hl_pass1<true>(desc, chunk_tensor, n_chunks, chunk_size, hp, mode, partials, tickets, ratio,
                   w_norm, o_norm, nonfinite, found_inf);
}

// ---------------------------------------------------------------------------------------------
// Pass 2: multi-tensor updates with the ratios of pass 1
// ---------------------------------------------------------------------------------------------

// Both norms of tensor t (from pass 1) finite: the layer is updated; else it is left as it was.
__device__ __forceinline__ bool hl_layer_finite(int t, const float* w_norm, const float* o_norm) {
    return hl_isfinite(w_norm[t]) && hl_isfinite(o_norm[t]);
}

extern "C" __global__ void __launch_bounds__(HL_MAX_THREADS)
hl_lars_apply(const long long* __restrict__ desc, const int* __restrict__ chunk_tensor,
              int n_chunks, int chunk_size, const float* __restrict__ hp,
              const float* __restrict__ ratio, const float* __restrict__ w_norm,
              const float* __restrict__ o_norm, const float* __restrict__ found_inf) {
    if (hl_skip(found_inf)) return;   // the whole step skipped: nothing written
    for (int c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const int t = chunk_tensor[c];
        if (!hl_layer_finite(t, w_norm, o_norm)) continue;   // leave w and m untouched
        const long long* d = desc + (long long)t * HL_DESC_WORDS;
        const long long numel = d[HL_D_NUMEL];
        const long long begin = (long long)(c - d[HL_D_FIRST]) * chunk_size;
        const long long end = hl_min_ll(begin + chunk_size, numel);
        const float* h = hp + d[HL_D_ROW] * HL_HP_WORDS;
        const bool adapt = ((d[HL_D_META] >> 8) & 1) != 0;
        HlLarsApply op;
        op.step = __fmul_rn(h[HL_HP_LR], ratio[t]);
        op.wd = adapt ? h[HL_HP_WD] : 0.0f;
        op.momentum = h[HL_HP_BETA1];
        const int dtype = (int)(d[HL_D_META] & 0xff);
        if (dtype == HL_F16) hl_chunk<HL_F16>(d, begin, end, op);
        else if (dtype == HL_BF16) hl_chunk<HL_BF16>(d, begin, end, op);
        else hl_chunk<HL_F32>(d, begin, end, op);
    }
}

extern "C" __global__ void __launch_bounds__(HL_MAX_THREADS_LAMB)
hl_lamb_apply(const long long* __restrict__ desc, const int* __restrict__ chunk_tensor,
              int n_chunks, int chunk_size, const float* __restrict__ hp,
              const float* __restrict__ ratio, const float* __restrict__ w_norm,
              const float* __restrict__ o_norm, const float* __restrict__ found_inf) {
    if (hl_skip(found_inf)) return;   // the whole step skipped: nothing written
    for (int c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const int t = chunk_tensor[c];
        if (!hl_layer_finite(t, w_norm, o_norm)) continue;   // leave w, m and v untouched
        const long long* d = desc + (long long)t * HL_DESC_WORDS;
        const long long numel = d[HL_D_NUMEL];
        const long long begin = (long long)(c - d[HL_D_FIRST]) * chunk_size;
        const long long end = hl_min_ll(begin + chunk_size, numel);
        const float* h = hp + d[HL_D_ROW] * HL_HP_WORDS;
        const HlLambHp p = hl_lamb_hp(h, ((d[HL_D_META] >> 8) & 1) != 0);
        const float step = __fmul_rn(h[HL_HP_LR], ratio[t]);
        const int dtype = (int)(d[HL_D_META] & 0xff);
        if (dtype == HL_F16) hl_chunk<HL_F16>(d, begin, end, HlLambApply<HL_F16>{p, step});
        else if (dtype == HL_BF16) hl_chunk<HL_BF16>(d, begin, end, HlLambApply<HL_BF16>{p, step});
        else hl_chunk<HL_F32>(d, begin, end, HlLambApply<HL_F32>{p, step});
    }
}
