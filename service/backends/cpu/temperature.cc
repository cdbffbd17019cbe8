// The per-row reciprocal temperature.
#include "service/backends/cpu/temperature.h"

namespace flashsampler {
namespace cpu {

float InverseTemperature(const SamplingParams& params) {
  return params.greedy() ? 1.0f : 1.0f / params.temperature;
}

}  // namespace cpu
}  // namespace flashsampler
