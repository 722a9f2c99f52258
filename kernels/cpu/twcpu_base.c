/* Portable build of the hot loops (any CPU the compiler targets by default). */
#define TW_VARIANT base
#include "twcpu_impl.h"
