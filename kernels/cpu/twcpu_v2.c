/* x86-64-v2 build of the hot loops (SSE4.2), chosen at run time by twcpu.c. No FMA. */
#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("sse3,ssse3,sse4.1,sse4.2,popcnt"))), apply_to = function)
#else
#pragma GCC target("sse3,ssse3,sse4.1,sse4.2,popcnt")
#endif
#define TW_VARIANT v2
#include "twcpu_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
