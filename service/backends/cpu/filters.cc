// min_p floor, exact top-k / top-p cuts and their radix select.
#include "service/backends/cpu/filters.h"

#include <cmath>
#include <limits>

namespace flashsampler {
namespace cpu {

uint128 CeilScaled(float p, uint128 z) {
  int exponent = 0;
  const float fraction = std::frexp(p, &exponent);  // p = fraction * 2^exponent
  const uint64_t mantissa = static_cast<uint64_t>(std::ldexp(fraction, 24));
  const int shift = 24 - exponent;  // p = mantissa * 2^-shift, shift >= 24
  const uint128 product = static_cast<uint128>(mantissa) * z;
  if (shift >= 128) return product != 0 ? 1 : 0;
  const uint128 quotient = product >> shift;
  const uint128 remainder = product & ((static_cast<uint128>(1) << shift) - 1);
  return quotient + (remainder != 0 ? 1 : 0);
}

float SmallestKept(float x_max, float min_p) {
  const double log_min_p = std::log(static_cast<double>(min_p));
  auto kept = [&](float f) {
    return static_cast<double>(f) - static_cast<double>(x_max) >= log_min_p;
  };
  float f = static_cast<float>(static_cast<double>(x_max) + log_min_p);
  if (!kept(f)) {
    while (!kept(f))
      f = std::nextafter(f, std::numeric_limits<float>::infinity());
    return f;
  }
  while (true) {
    const float lower = std::nextafter(f, kNegInf);
    if (lower == kNegInf || !kept(lower)) return f;
    f = lower;
  }
}

Cutoff Cutoff::UpTo(const Entry& last) {
  Cutoff c;
  c.active = true;
  c.v = last.x;
  c.ties = Ties::kUpToId;
  c.max_id = last.id;
  return c;
}

Cutoff Cutoff::AtLeast(float v) {
  Cutoff c;
  c.active = true;
  c.v = v;
  c.ties = Ties::kAll;
  return c;
}

bool TopPCutOfList(const std::vector<Entry>& sorted, float top_p, float x_max,
                   Cutoff* cut) {
  uint128 total = 0;
  for (const Entry& e : sorted) total += FixedMass(e.x, x_max);
  const uint128 target = CeilScaled(top_p, total);
  uint128 cum = 0;
  for (const Entry& e : sorted) {
    cum += FixedMass(e.x, x_max);
    if (cum >= target) {
      *cut = Cutoff::UpTo(e);
      return true;
    }
  }
  return false;
}

bool TopPCutOfPrefix(const std::vector<Entry>& sorted, const Cutoff& cut_k,
                     uint128 target, float x_max, Cutoff* cut) {
  CutoffCursor cursor;
  cursor.Start(cut_k, -1);
  uint128 cum = 0;
  for (const Entry& e : sorted) {
    if (!cursor.Keep(e.x, e.id)) return false;  // past top-k: the rest too
    cum += FixedMass(e.x, x_max);
    if (cum >= target) {
      *cut = Cutoff::UpTo(e);
      return true;
    }
  }
  return false;
}

void RadixSelect::StartLevel(int new_level) {
  level = new_level;
  count.assign(size_t{1} << kRadixBits[level], 0);
  mass.assign(by_mass ? count.size() : 0, 0);
}

int64_t RadixSelect::FindBin(uint128* above_bin) const {
  uint128 cum = above;
  for (int64_t b = static_cast<int64_t>(count.size()) - 1; b >= 0; --b) {
    const uint128 value = by_mass ? mass[b] : count[b];
    if (cum + value >= target) {
      *above_bin = cum;
      return b;
    }
    cum += value;
  }
  *above_bin = cum;
  return -1;
}

}  // namespace cpu
}  // namespace flashsampler
