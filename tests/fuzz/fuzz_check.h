// FUZZ_CHECK for the fuzz targets: an invariant that does not hold prints
// what and where, then aborts, which libFuzzer and the standalone driver both
// report as a crash with the input that caused it.
#ifndef FLASHSAMPLER_TESTS_FUZZ_FUZZ_CHECK_H_
#define FLASHSAMPLER_TESTS_FUZZ_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(condition, ...)                                     \
  do {                                                                 \
    if (!(condition)) {                                                \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK(%s) failed: ", __FILE__, \
                   __LINE__, #condition);                              \
      std::fprintf(stderr, __VA_ARGS__);                               \
      std::fprintf(stderr, "\n");                                      \
      std::abort();                                                    \
    }                                                                  \
  } while (0)

#endif  // FLASHSAMPLER_TESTS_FUZZ_FUZZ_CHECK_H_
