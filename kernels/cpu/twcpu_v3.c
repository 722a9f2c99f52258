/* x86-64-v3 build of the hot loops (AVX2), chosen at run time by twcpu.c. FMA is deliberately
 * not enabled: the format's numerics are separate multiplies and adds. */
#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx,avx2,bmi,bmi2,popcnt,sse4.2"))), apply_to = function)
#else
#pragma GCC target("avx,avx2,bmi,bmi2,popcnt,sse4.2")
#endif
#define TW_VARIANT v3
#define TW_HAVE_AVX2 1
#include "twcpu_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
