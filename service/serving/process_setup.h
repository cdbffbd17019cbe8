// Process-wide settings of a serving daemon (flashsamplerd and the
// null-engine benchmark daemon), applied once at the top of main().
#ifndef FLASHSAMPLER_SERVICE_SERVING_PROCESS_SETUP_H_
#define FLASHSAMPLER_SERVICE_SERVING_PROCESS_SETUP_H_

namespace flashsampler {

// Turns off Abseil's Mutex deadlock detection and keeps freed request
// buffers in the allocator instead of returning them to the kernel (see
// process_setup.cc for the numbers). Call before any thread starts.
void SetUpServingProcess();

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_SERVING_PROCESS_SETUP_H_
