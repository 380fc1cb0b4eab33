/*
 * crossdevice._arrays._hostsum: the optional compiled kernel of the host all-reduce.
 *
 * One function, cdx_sum, called through ctypes (which releases the GIL around it):
 *
 *     out[i] = ((in[0][i] + in[1][i]) + in[2][i]) + ...      (then / divisor, if given)
 *
 * for i in [0, len). Each input byte is read once and each output byte written once, and
 * the adds for one element happen in input (replica) order, so the result is bitwise the
 * NumPy chain `np.add(x0, x1); np.add(acc, x2, out=acc); ...` that the pure-Python path
 * computes: elements are independent, only the per-element order matters, and this file
 * must never be built with -ffast-math (which would let the compiler reassociate).
 *
 * With `stream` set, vector results are written with non-temporal stores, which skip the
 * read-for-ownership of each output cache line: a 64 MiB result no longer costs 64 MiB of
 * extra reads (measured on the 2-core dev VM, 4 x 64 MiB float32 from two threads:
 * 8.6-11.3 ms streaming vs 9.6-13.5 ms with plain stores, the same window). Only worth it
 * for results far larger than the caches: the caller decides.
 *
 * The vector loop is AVX2 where the CPU has it (chosen at run time by cdx_isas, or forced
 * through cdx_sum's `isa` argument: the tests run every loop), else SSE2 on x86-64, else
 * scalar. AVX2 took 0.79-0.89x the time of SSE2 for the 4 x 64 MiB sum from two threads
 * on the dev VM (AVX-512 measured no better there, so it is not built).
 *
 * Integer sums wrap around like NumPy's (done in unsigned arithmetic: signed overflow is
 * undefined in C). The module itself has no Python-level functions; it exists so that
 * the normal extension build, install and import machinery finds and ships the library.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define CDX_SSE2 1
#endif

/* The AVX2 loop is compiled with a target attribute and chosen at run time, so the
 * library still loads on any x86-64 and needs no -march flag. GCC and Clang only. */
#if defined(CDX_SSE2) && defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define CDX_AVX2 1
#define CDX_TARGET_AVX2 __attribute__((target("avx2")))
#endif

#if defined(_WIN32)
#define CDX_EXPORT __declspec(dllexport)
#else
#define CDX_EXPORT __attribute__((visibility("default")))
#endif

/* dtype codes, mirrored in native.py */
enum { CDX_F32 = 0, CDX_F64 = 1, CDX_U32 = 2, CDX_U64 = 3 };

/* instruction-set flags, mirrored in native.py; cdx_sum takes one (0: the best built and
 * supported by this CPU) */
enum { CDX_ISA_SCALAR = 1, CDX_ISA_SSE2 = 2, CDX_ISA_AVX2 = 4 };

/* Elements [i, len) one at a time: the head before an aligned address, the tail, and the
 * whole range where no vector loop runs. Integer divisors never reach here (refused). */
#define CDX_SCALAR(NAME, T)                                                                \
    static void NAME(const void *const *in, int n, void *out, ptrdiff_t i, ptrdiff_t len, \
                     int divisor)                                                          \
    {                                                                                      \
        for (; i < len; ++i) {                                                             \
            T acc = ((const T *)in[0])[i];                                                 \
            for (int k = 1; k < n; ++k) acc = (T)(acc + ((const T *)in[k])[i]);            \
            if (divisor) acc = (T)(acc / (T)divisor);                                      \
            ((T *)out)[i] = acc;                                                           \
        }                                                                                  \
    }
CDX_SCALAR(scalar_f32, float)
CDX_SCALAR(scalar_f64, double)
CDX_SCALAR(scalar_u32, uint32_t)
CDX_SCALAR(scalar_u64, uint64_t)

/* The vector loop over elements [i, len), two vectors of W elements per step (one 64-byte
 * cache line with AVX2): both accumulators take the inputs in replica order, so each
 * element sees the same adds as in the scalar loop. Returns where it stopped. */
#define CDX_BODY(NAME, TARGET, T, VEC, W, LOAD, ADD, DIVIDE, STREAM, STOREU, FENCE)        \
    TARGET static ptrdiff_t NAME(const void *const *in, int n, void *out, ptrdiff_t i,    \
                                 ptrdiff_t len, int stream, int divisor)                   \
    {                                                                                      \
        for (; i + 2 * (W) <= len; i += 2 * (W)) {                                         \
            const T *p = (const T *)in[0] + i;                                             \
            VEC x0 = LOAD(p), x1 = LOAD(p + (W));                                          \
            for (int k = 1; k < n; ++k) {                                                  \
                p = (const T *)in[k] + i;                                                  \
                x0 = ADD(x0, LOAD(p));                                                     \
                x1 = ADD(x1, LOAD(p + (W)));                                               \
            }                                                                              \
            if (divisor) {                                                                 \
                x0 = DIVIDE(x0, divisor);                                                  \
                x1 = DIVIDE(x1, divisor);                                                  \
            }                                                                              \
            T *q = (T *)out + i;                                                           \
            if (stream) {                                                                  \
                STREAM(q, x0);                                                             \
                STREAM(q + (W), x1);                                                       \
            } else {                                                                       \
                STOREU(q, x0);                                                             \
                STOREU(q + (W), x1);                                                       \
            }                                                                              \
        }                                                                                  \
        if (stream) FENCE();                                                               \
        return i;                                                                          \
    }

#define CDX_NO_TARGET
#define CDX_NO_DIVIDE(x, d) (x)

#ifdef CDX_SSE2
#define CDX_SSE_LDI(p) _mm_loadu_si128((const __m128i *)(p))
#define CDX_SSE_STI(p, x) _mm_stream_si128((__m128i *)(p), x)
#define CDX_SSE_STUI(p, x) _mm_storeu_si128((__m128i *)(p), x)
#define CDX_SSE_DIVS(x, d) _mm_div_ps(x, _mm_set1_ps((float)(d)))
#define CDX_SSE_DIVD(x, d) _mm_div_pd(x, _mm_set1_pd((double)(d)))
CDX_BODY(sse2_f32, CDX_NO_TARGET, float, __m128, 4, _mm_loadu_ps, _mm_add_ps, CDX_SSE_DIVS,
         _mm_stream_ps, _mm_storeu_ps, _mm_sfence)
CDX_BODY(sse2_f64, CDX_NO_TARGET, double, __m128d, 2, _mm_loadu_pd, _mm_add_pd, CDX_SSE_DIVD,
         _mm_stream_pd, _mm_storeu_pd, _mm_sfence)
CDX_BODY(sse2_u32, CDX_NO_TARGET, uint32_t, __m128i, 4, CDX_SSE_LDI, _mm_add_epi32,
         CDX_NO_DIVIDE, CDX_SSE_STI, CDX_SSE_STUI, _mm_sfence)
CDX_BODY(sse2_u64, CDX_NO_TARGET, uint64_t, __m128i, 2, CDX_SSE_LDI, _mm_add_epi64,
         CDX_NO_DIVIDE, CDX_SSE_STI, CDX_SSE_STUI, _mm_sfence)
#endif

#ifdef CDX_AVX2
#define CDX_AVX_LDI(p) _mm256_loadu_si256((const __m256i *)(p))
#define CDX_AVX_STI(p, x) _mm256_stream_si256((__m256i *)(p), x)
#define CDX_AVX_STUI(p, x) _mm256_storeu_si256((__m256i *)(p), x)
#define CDX_AVX_DIVS(x, d) _mm256_div_ps(x, _mm256_set1_ps((float)(d)))
#define CDX_AVX_DIVD(x, d) _mm256_div_pd(x, _mm256_set1_pd((double)(d)))
CDX_BODY(avx2_f32, CDX_TARGET_AVX2, float, __m256, 8, _mm256_loadu_ps, _mm256_add_ps,
         CDX_AVX_DIVS, _mm256_stream_ps, _mm256_storeu_ps, _mm_sfence)
CDX_BODY(avx2_f64, CDX_TARGET_AVX2, double, __m256d, 4, _mm256_loadu_pd, _mm256_add_pd,
         CDX_AVX_DIVD, _mm256_stream_pd, _mm256_storeu_pd, _mm_sfence)
CDX_BODY(avx2_u32, CDX_TARGET_AVX2, uint32_t, __m256i, 8, CDX_AVX_LDI, _mm256_add_epi32,
         CDX_NO_DIVIDE, CDX_AVX_STI, CDX_AVX_STUI, _mm_sfence)
CDX_BODY(avx2_u64, CDX_TARGET_AVX2, uint64_t, __m256i, 4, CDX_AVX_LDI, _mm256_add_epi64,
         CDX_NO_DIVIDE, CDX_AVX_STI, CDX_AVX_STUI, _mm_sfence)
#endif

/* The instruction sets built into this library and supported by this CPU and OS
 * (`__builtin_cpu_supports` checks that the OS saves the AVX registers too). */
CDX_EXPORT int cdx_isas(void)
{
    int isas = CDX_ISA_SCALAR;
#ifdef CDX_SSE2
    isas |= CDX_ISA_SSE2;
#endif
#ifdef CDX_AVX2
    if (__builtin_cpu_supports("avx2")) isas |= CDX_ISA_AVX2;
#endif
    return isas;
}

/* Elements before the first address a vector streaming store may write to (`align`
 * bytes); `len` when no element ever is (an output not aligned to its item size). */
static ptrdiff_t head_length(const void *out, ptrdiff_t len, size_t itemsize, size_t align)
{
    uintptr_t misalign = (uintptr_t)out & (align - 1);
    if (misalign == 0) return 0;
    if (misalign % itemsize != 0) return len;
    ptrdiff_t head = (ptrdiff_t)((align - misalign) / itemsize);
    return head < len ? head : len;
}

/* One dtype: the scalar head (streaming only), the vector loop of the chosen instruction
 * set, the scalar tail. */
#define CDX_SUM(NAME, T, SUFFIX)                                                           \
    static void NAME(const void *const *in, int n, void *out, ptrdiff_t len, int stream,  \
                     int divisor, int isa)                                                 \
    {                                                                                      \
        ptrdiff_t i = 0;                                                                   \
        if (isa != CDX_ISA_SCALAR) {                                                       \
            size_t align = isa == CDX_ISA_AVX2 ? 32 : 16;                                  \
            i = stream ? head_length(out, len, sizeof(T), align) : 0;                      \
            scalar_##SUFFIX(in, n, out, 0, i, divisor);                                    \
            CDX_VECTOR_##SUFFIX                                                            \
        }                                                                                  \
        scalar_##SUFFIX(in, n, out, i, len, divisor);                                      \
    }

#if defined(CDX_AVX2)
#define CDX_DISPATCH(SUFFIX)                                                               \
    i = isa == CDX_ISA_AVX2 ? avx2_##SUFFIX(in, n, out, i, len, stream, divisor)          \
                            : sse2_##SUFFIX(in, n, out, i, len, stream, divisor);
#elif defined(CDX_SSE2)
#define CDX_DISPATCH(SUFFIX) i = sse2_##SUFFIX(in, n, out, i, len, stream, divisor);
#else
#define CDX_DISPATCH(SUFFIX) (void)stream;
#endif
#define CDX_VECTOR_f32 CDX_DISPATCH(f32)
#define CDX_VECTOR_f64 CDX_DISPATCH(f64)
#define CDX_VECTOR_u32 CDX_DISPATCH(u32)
#define CDX_VECTOR_u64 CDX_DISPATCH(u64)
CDX_SUM(sum_f32, float, f32)
CDX_SUM(sum_f64, double, f64)
CDX_SUM(sum_u32, uint32_t, u32)
CDX_SUM(sum_u64, uint64_t, u64)

/* Returns 0 on success, -1 for an unknown dtype code, -2 for a divisor on integers, -3
 * for a bad count or length, -4 for an instruction set not in cdx_isas(). */
CDX_EXPORT int cdx_sum(const void *const *inputs, int n, void *out, ptrdiff_t len, int dtype,
                       int stream, int divisor, int isa)
{
    static int available = 0;
    if (n < 1 || len < 0) return -3;
    if (available == 0) available = cdx_isas(); /* idempotent: a race only repeats it */
    if (isa == 0) {
        isa = (available & CDX_ISA_AVX2)   ? CDX_ISA_AVX2
              : (available & CDX_ISA_SSE2) ? CDX_ISA_SSE2
                                           : CDX_ISA_SCALAR;
    } else if ((isa & available) == 0 || (isa & (isa - 1)) != 0) {
        return -4;
    }
    switch (dtype) {
    case CDX_F32:
        sum_f32(inputs, n, out, len, stream, divisor, isa);
        return 0;
    case CDX_F64:
        sum_f64(inputs, n, out, len, stream, divisor, isa);
        return 0;
    case CDX_U32:
        if (divisor) return -2;
        sum_u32(inputs, n, out, len, stream, 0, isa);
        return 0;
    case CDX_U64:
        if (divisor) return -2;
        sum_u64(inputs, n, out, len, stream, 0, isa);
        return 0;
    default:
        return -1;
    }
}

static struct PyModuleDef hostsum_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_hostsum",
    .m_doc = "The compiled fused n-ary sum of the host all-reduce (called through ctypes: cdx_sum).",
    .m_size = 0,
};

PyMODINIT_FUNC PyInit__hostsum(void) { return PyModule_Create(&hostsum_module); }
