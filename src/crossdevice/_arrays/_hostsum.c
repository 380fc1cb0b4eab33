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

#if defined(_WIN32)
#define CDX_EXPORT __declspec(dllexport)
#else
#define CDX_EXPORT __attribute__((visibility("default")))
#endif

/* dtype codes, mirrored in native.py */
enum { CDX_F32 = 0, CDX_F64 = 1, CDX_U32 = 2, CDX_U64 = 3 };

/* The scalar loop for elements [i, len): the head before an aligned address, the tail,
 * and every element where SSE2 is absent. */
#define CDX_SCALAR_LOOP(T, DIVIDE)                                   \
    for (; i < len; ++i) {                                           \
        T acc = ((const T *)in[0])[i];                               \
        for (int k = 1; k < n; ++k) acc = (T)(acc + ((const T *)in[k])[i]); \
        DIVIDE;                                                      \
        ((T *)out)[i] = acc;                                         \
    }

static inline ptrdiff_t head_length(const void *out, ptrdiff_t len, size_t itemsize, int stream)
{
    /* Non-temporal vector stores need 16-byte aligned addresses. */
    if (!stream) return 0;
    uintptr_t misalign = (uintptr_t)out & 15u;
    if (misalign == 0) return 0;
    if (misalign % itemsize != 0) return len; /* cannot ever align: all scalar */
    ptrdiff_t head = (ptrdiff_t)((16u - misalign) / itemsize);
    return head < len ? head : len;
}

#ifdef CDX_SSE2
#define CDX_FLOAT_VECTOR_LOOP(T, STEP, VEC, LOAD, ADD, DIV, SET1, STREAM, STOREU)          \
    {                                                                                      \
        ptrdiff_t head = head_length(out, len, sizeof(T), stream);                        \
        ptrdiff_t stop = len;                                                              \
        len = head;                                                                        \
        CDX_SCALAR_LOOP(T, if (divisor) acc = acc / d)                                     \
        len = stop;                                                                        \
        const VEC vd = SET1(d);                                                            \
        for (; i + STEP <= len; i += STEP) {                                               \
            VEC acc = LOAD((const T *)in[0] + i);                                          \
            for (int k = 1; k < n; ++k) acc = ADD(acc, LOAD((const T *)in[k] + i));        \
            if (divisor) acc = DIV(acc, vd);                                               \
            if (stream)                                                                    \
                STREAM((T *)out + i, acc);                                                 \
            else                                                                           \
                STOREU((T *)out + i, acc);                                                 \
        }                                                                                  \
        if (stream) _mm_sfence();                                                          \
    }
#else
#define CDX_FLOAT_VECTOR_LOOP(T, STEP, VEC, LOAD, ADD, DIV, SET1, STREAM, STOREU) (void)stream;
#endif

#define CDX_FLOAT_SUM(NAME, T, STEP, VEC, LOAD, ADD, DIV, SET1, STREAM, STOREU)            \
    static void NAME(const void *const *in, int n, void *out, ptrdiff_t len, int stream,  \
                     int divisor)                                                          \
    {                                                                                      \
        ptrdiff_t i = 0;                                                                   \
        const T d = (T)divisor;                                                            \
        CDX_FLOAT_VECTOR_LOOP(T, STEP, VEC, LOAD, ADD, DIV, SET1, STREAM, STOREU)          \
        CDX_SCALAR_LOOP(T, if (divisor) acc = acc / d)                                     \
    }
CDX_FLOAT_SUM(sum_f32, float, 4, __m128, _mm_loadu_ps, _mm_add_ps, _mm_div_ps, _mm_set1_ps,
              _mm_stream_ps, _mm_storeu_ps)
CDX_FLOAT_SUM(sum_f64, double, 2, __m128d, _mm_loadu_pd, _mm_add_pd, _mm_div_pd, _mm_set1_pd,
              _mm_stream_pd, _mm_storeu_pd)

#ifdef CDX_SSE2
#define CDX_INT_SUM(NAME, T, STEP, ADD)                                                    \
    static void NAME(const void *const *in, int n, void *out, ptrdiff_t len, int stream)  \
    {                                                                                      \
        ptrdiff_t i = 0;                                                                   \
        ptrdiff_t head = head_length(out, len, sizeof(T), stream);                        \
        {                                                                                  \
            ptrdiff_t stop = len;                                                          \
            len = head;                                                                    \
            CDX_SCALAR_LOOP(T, (void)0)                                                    \
            len = stop;                                                                    \
        }                                                                                  \
        for (; i + STEP <= len; i += STEP) {                                               \
            __m128i acc = _mm_loadu_si128((const __m128i *)((const T *)in[0] + i));        \
            for (int k = 1; k < n; ++k)                                                    \
                acc = ADD(acc, _mm_loadu_si128((const __m128i *)((const T *)in[k] + i)));  \
            if (stream)                                                                    \
                _mm_stream_si128((__m128i *)((T *)out + i), acc);                          \
            else                                                                           \
                _mm_storeu_si128((__m128i *)((T *)out + i), acc);                          \
        }                                                                                  \
        if (stream) _mm_sfence();                                                          \
        CDX_SCALAR_LOOP(T, (void)0)                                                        \
    }
CDX_INT_SUM(sum_u32, uint32_t, 4, _mm_add_epi32)
CDX_INT_SUM(sum_u64, uint64_t, 2, _mm_add_epi64)
#else
#define CDX_INT_SUM(NAME, T)                                                               \
    static void NAME(const void *const *in, int n, void *out, ptrdiff_t len, int stream)  \
    {                                                                                      \
        ptrdiff_t i = 0;                                                                   \
        (void)stream;                                                                      \
        CDX_SCALAR_LOOP(T, (void)0)                                                        \
    }
CDX_INT_SUM(sum_u32, uint32_t)
CDX_INT_SUM(sum_u64, uint64_t)
#endif

/* Returns 0 on success, -1 for an unknown dtype code, -2 for a divisor on integers, -3
 * for a bad count or length. */
CDX_EXPORT int cdx_sum(const void *const *inputs, int n, void *out, ptrdiff_t len, int dtype,
                       int stream, int divisor)
{
    if (n < 1 || len < 0) return -3;
    switch (dtype) {
    case CDX_F32:
        sum_f32(inputs, n, out, len, stream, divisor);
        return 0;
    case CDX_F64:
        sum_f64(inputs, n, out, len, stream, divisor);
        return 0;
    case CDX_U32:
        if (divisor) return -2;
        sum_u32(inputs, n, out, len, stream);
        return 0;
    case CDX_U64:
        if (divisor) return -2;
        sum_u64(inputs, n, out, len, stream);
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
