// Host-side packer for the controlled sampler: turns each row's plain control
// lists (bias, bans, prompt and output ids, bitmask) into the merged,
// id-sorted per-token entries and ControlledRow array the kernel reads, or
// leaves a row's lists as they come for the device's merge
// (LaunchMergePendingEntries), laid out in one byte buffer so a batch costs
// one host-to-device copy. Header-only; knows nothing of the service's types.
#ifndef FLASHSAMPLER_KERNELS_CONTROLS_CONTROLLED_PLAN_H_
#define FLASHSAMPLER_KERNELS_CONTROLS_CONTROLLED_PLAN_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/controls/controlled_math.h"
#include "kernels/controls/controlled_types.h"

namespace flashsampler {

// One row's controls as plain arrays (pointers may be null when the count
// is 0). Defaults are "off", as in SamplingParams.
struct ControlledRowInput {
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  const int32_t* bias_ids = nullptr;  // logit_bias, in request order
  const float* bias_values = nullptr;
  size_t num_bias = 0;
  const int32_t* banned_ids = nullptr;
  size_t num_banned = 0;
  const int32_t* prompt_ids = nullptr;
  size_t num_prompt = 0;
  const int32_t* output_ids = nullptr;  // output_token_counts
  const int32_t* output_counts = nullptr;
  size_t num_output = 0;
  const uint32_t* allowed_bitmask = nullptr;  // ceil(V / 32) words, or null
  size_t bitmask_words = 0;
  int32_t n = 1;
  int32_t top_n = 0;
  uint32_t logprob_flags = 0;  // kLogprob* bits
  uint64_t seed = 0;
  uint64_t step = 0;
};

// A batch's packed controls. AddRow (or RepeatLastRow) in batch order, then
// copy bytes() to the device (one buffer of bytes().size(), 256-byte
// aligned), run LaunchMergePendingEntries on it where pending_merges() is
// not empty (AddRows), and BindInputs.
// AddRow copies every list but the bitmask: a row's bitmask words (19 KB at
// V = 151936) are read where ControlledRowInput::allowed_bitmask points,
// by WriteBytes and bytes(), so that array must outlive their last call.
// Copying them into the plan too took half of the engine's packing of a
// bitmask batch (0.44 of 0.87 ms for 256 rows on a development host), and
// one caller of 256 rows with bitmasks and raw logprobs waited for it:
// batch execution 1.00-1.02 against 1.37 ms (H100, two alternating
// rounds).
class ControlledPlan {
 public:
  // Merges the row's lists exactly as the CPU sampler's PlanRow does: the
  // bias of an id is the fp32 sum of its entries in list order; prompt ids
  // and positive output counts mark it repeated when the repetition penalty
  // is not 1; its count is the sum of its positive output counts.
  void AddRow(const ControlledRowInput& in) {
    AddRows({RowToAdd{&in}}, InOrder{});
  }

  // One row of AddRows: its controls, or null for the row before it again
  // with this row's noise key (RepeatLastRow).
  struct RowToAdd {
    const ControlledRowInput* in = nullptr;
    uint64_t seed = 0;
    uint64_t step = 0;
  };

  // AddRow and RepeatLastRow for each of `rows`, in order, with the rows'
  // merges run by for_each(n, fn), which must call fn(i) once for every i
  // in [0, n), on any threads: each row merges into a region of the
  // entries sized for its keys, and the regions are then closed up in row
  // order, so that the plan holds the same bytes as row after row. 256 rows
  // each with 64 bias entries and 128 penalized ids merge in about 1 ms on
  // one core of a development host (SortKeysById).
  // A row with 1 .. `pending_max_keys` keys (at most kPendingMaxKeys) is
  // not merged here: its list entries are written as they come, its region
  // stays whole and empty (special_end = special_begin), and
  // LaunchMergePendingEntries, run on the device copy of bytes(), merges
  // it there into what this would have written (pending_merges()). Its ids
  // must be below kPendingMaxVocab (a key is id << 13 | place, 32 bits).
  template <typename ForEach>
  void AddRows(const std::vector<RowToAdd>& rows, ForEach&& for_each,
               size_t pending_max_keys = 0) {
    pending_max_keys =
        std::min(pending_max_keys, static_cast<size_t>(kPendingMaxKeys));
    const size_t first = special_ids_.size();
    region_begin_.resize(rows.size());
    region_entries_.resize(rows.size());
    pending_begin_.resize(rows.size());
    size_t end = first;
    size_t pending_end = pending_entries_.size();
    for (size_t i = 0; i < rows.size(); ++i) {
      region_begin_[i] = end;
      pending_begin_[i] = kNotPending;
      if (rows[i].in == nullptr) continue;
      const size_t keys = KeyCount(*rows[i].in);
      end += keys;
      if (keys > 0 && keys <= pending_max_keys) {
        pending_begin_[i] = pending_end;
        pending_end += keys;
      }
    }
    ResizeEntries(end);
    pending_entries_.resize(pending_end);
    for_each(static_cast<int64_t>(rows.size()), [&](int64_t i) {
      const size_t r = static_cast<size_t>(i);
      const RowToAdd& row = rows[r];
      if (row.in == nullptr) return;
      if (pending_begin_[r] != kNotPending) {
        region_entries_[r] = WritePendingEntries(*row.in, pending_begin_[r]);
        return;
      }
      thread_local std::vector<uint64_t> keys;
      region_entries_[r] = MergeEntries(*row.in, region_begin_[r], &keys);
    });
    size_t at = first;
    for (size_t i = 0; i < rows.size(); ++i) {
      if (rows[i].in == nullptr) {
        RepeatLastRow(rows[i].seed, rows[i].step);
        continue;
      }
      const size_t from = region_begin_[i];
      const size_t count = region_entries_[i];
      if (pending_begin_[i] != kNotPending && count > 0) {
        // The device writes up to `count` entries from `at` on: the region
        // keeps its whole size.
        PendingMergeRow merge;
        merge.first_row = static_cast<int32_t>(rows_.size());
        merge.key_count = static_cast<int32_t>(count);
        merge.key_begin = static_cast<int64_t>(pending_begin_[i]);
        pending_merges_.push_back(merge);
        max_pending_keys_ = std::max(max_pending_keys_, count);
        AppendRow(*rows[i].in, at, at);
        last_row_pending_ = true;
        at += count;
        continue;
      }
      if (from != at) {
        // Down to `at` < `from`: a forward copy of overlapping ranges.
        auto move_down = [from, count, at](auto& entries) {
          std::copy(entries.begin() + from, entries.begin() + from + count,
                    entries.begin() + at);
        };
        move_down(special_ids_);
        move_down(special_flags_);
        move_down(special_bias_);
        move_down(special_count_);
      }
      AppendRow(*rows[i].in, at, at + count);
      last_row_pending_ = false;
      at += count;
    }
    ResizeEntries(at);
  }

  // Adds a row with the last row's controls and its own noise key: it reads
  // the last row's entries and bitmask, packed once. The rows of a
  // request's broadcast params: 256 rows with a bitmask at V = 151936 pack
  // and copy 19 KB instead of 4.9 MB, and 64 bias entries, 4 bans and 64
  // prompt and output ids are merged once instead of 256 times (0.68 ms on
  // a development host). Needs a row before it.
  void RepeatLastRow(uint64_t seed, uint64_t step) {
    ControlledRow row = rows_.back();
    row.seed = seed;
    row.step = step;
    rows_.push_back(row);
    if (last_row_pending_) ++pending_merges_.back().rows;
  }

  int rows() const { return static_cast<int>(rows_.size()); }
  // The rows left for LaunchMergePendingEntries (AddRows' pending_max_keys),
  // one record per row and the rows repeating it.
  const std::vector<PendingMergeRow>& pending_merges() const {
    return pending_merges_;
  }
  const std::vector<PendingListEntry>& pending_entries() const {
    return pending_entries_;
  }
  // The bitmasks bytes() holds: one per row added with a bitmask (repeated
  // rows share theirs).
  size_t packed_bitmasks() const { return bitmask_rows_.size(); }
  const std::vector<ControlledRow>& row_controls() const { return rows_; }
  const std::vector<int32_t>& special_ids() const { return special_ids_; }
  const std::vector<uint8_t>& special_flags() const { return special_flags_; }
  const std::vector<float>& special_bias() const { return special_bias_; }
  const std::vector<int32_t>& special_count() const { return special_count_; }
  // The rows' bitmask words as bytes() lays them out (a copy).
  std::vector<uint32_t> bitmask() const {
    std::vector<uint32_t> words;
    words.reserve(bitmask_words_);
    for (const BitmaskRow& b : bitmask_rows_)
      words.insert(words.end(), b.words, b.words + b.count);
    return words;
  }
  // Output capacities the batch needs (max n, max top_n; top_n beyond V is
  // listed as V, so min(max_top_n(), V) also suffices).
  int max_samples() const { return max_samples_; }
  int max_top_n() const { return max_top_n_; }

  // Forgets every row but keeps the arrays' capacity, so a caller packing
  // batch after batch into one plan stops allocating once it has seen its
  // largest batch.
  void Clear() {
    rows_.clear();
    special_ids_.clear();
    special_flags_.clear();
    special_bias_.clear();
    special_count_.clear();
    bitmask_rows_.clear();
    pending_merges_.clear();
    pending_entries_.clear();
    max_pending_keys_ = 0;
    last_row_pending_ = false;
    bitmask_words_ = 0;
    max_samples_ = 1;
    max_top_n_ = 0;
  }

  // Size of bytes(): every array at a 256-byte aligned offset.
  size_t byte_size() const { return MakeLayout().total; }

  // Writes bytes() into `out` (byte_size() bytes, e.g. pinned staging)
  // without building a vector; padding bytes are zero.
  void WriteBytes(void* out) const { WriteBytes(out, InOrder{}); }

  // WriteBytes with the bitmasks copied by for_each(n, fn), as AddRows'
  // (one bitmask each): a batch of 256 rows each with its own bitmask writes
  // 4.9 MB of them at V = 151936.
  template <typename ForEach>
  void WriteBytes(void* out, ForEach&& for_each) const {
    const Layout layout = MakeLayout();
    WriteRowsAndEntries(out);
    unsigned char* bitmasks = static_cast<unsigned char*>(out) + layout.bitmask;
    for_each(static_cast<int64_t>(bitmask_rows_.size()), [&](int64_t i) {
      const BitmaskRow& b = bitmask_rows_[static_cast<size_t>(i)];
      std::memcpy(bitmasks + 4 * b.offset, b.words, 4 * b.count);
    });
    const size_t end = layout.bitmask + 4 * bitmask_words_;
    std::memset(static_cast<unsigned char*>(out) + end, 0, layout.total - end);
  }

  // Every input array in one buffer, each at a 256-byte aligned offset.
  std::vector<unsigned char> bytes() const {
    std::vector<unsigned char> out(byte_size());
    WriteBytes(out.data());
    return out;
  }

  // Points `params`' inputs into a device copy of bytes() and sets rows,
  // vocab and the output capacities; logits and outputs are the caller's.
  void BindInputs(const void* device_bytes, int64_t vocab,
                  ControlledSampleParams* params) const {
    const Layout layout = MakeLayout();
    const unsigned char* base = static_cast<const unsigned char*>(device_bytes);
    params->rows = rows();
    params->vocab = vocab;
    params->row_controls =
        reinterpret_cast<const ControlledRow*>(base + layout.rows);
    params->special_ids = reinterpret_cast<const int32_t*>(base + layout.ids);
    params->special_flags = base + layout.flags;
    params->special_bias = reinterpret_cast<const float*>(base + layout.bias);
    params->special_count =
        reinterpret_cast<const int32_t*>(base + layout.count);
    params->bitmask =
        bitmask_words_ == 0
            ? nullptr
            : reinterpret_cast<const uint32_t*>(base + layout.bitmask);
    params->max_samples = std::max(1, max_samples_);
    params->max_top_n = static_cast<int>(std::min<int64_t>(
        std::max(0, max_top_n_), std::max<int64_t>(vocab, 0)));
  }

  // Points `merges` into a device copy of bytes() (writable: the merge
  // writes the pending rows' entries and special_end there).
  void BindPendingMerges(void* device_bytes, PendingMerges* merges) const {
    const Layout layout = MakeLayout();
    unsigned char* base = static_cast<unsigned char*>(device_bytes);
    merges->count = static_cast<int>(pending_merges_.size());
    merges->max_keys = static_cast<int>(max_pending_keys_);
    merges->merges =
        reinterpret_cast<const PendingMergeRow*>(base + layout.pending_merges);
    merges->entries = reinterpret_cast<const PendingListEntry*>(
        base + layout.pending_entries);
    merges->row_controls = reinterpret_cast<ControlledRow*>(base + layout.rows);
    merges->special_ids = reinterpret_cast<int32_t*>(base + layout.ids);
    merges->special_flags = base + layout.flags;
    merges->special_bias = reinterpret_cast<float*>(base + layout.bias);
    merges->special_count = reinterpret_cast<int32_t*>(base + layout.count);
  }

 private:
  // bytes() up to the bitmasks: the rows and their entries.
  void WriteRowsAndEntries(void* out) const {
    const Layout layout = MakeLayout();
    unsigned char* base = static_cast<unsigned char*>(out);
    size_t written = 0;
    // Each array, and zeros in the alignment gaps alone.
    auto put = [base, &written](size_t offset, const void* data, size_t size) {
      std::memset(base + written, 0, offset - written);
      if (size > 0) std::memcpy(base + offset, data, size);
      written = offset + size;
    };
    put(layout.rows, rows_.data(), sizeof(ControlledRow) * rows_.size());
    put(layout.ids, special_ids_.data(), 4 * special_ids_.size());
    put(layout.flags, special_flags_.data(), special_flags_.size());
    put(layout.bias, special_bias_.data(), 4 * special_bias_.size());
    put(layout.count, special_count_.data(), 4 * special_count_.size());
    put(layout.pending_merges, pending_merges_.data(),
        sizeof(PendingMergeRow) * pending_merges_.size());
    put(layout.pending_entries, pending_entries_.data(),
        sizeof(PendingListEntry) * pending_entries_.size());
    put(layout.bitmask, nullptr, 0);
  }

  // The for-each of AddRow and WriteBytes(out): every index on the calling
  // thread, in order.
  struct InOrder {
    template <typename Fn>
    void operator()(int64_t n, const Fn& fn) const {
      for (int64_t i = 0; i < n; ++i) fn(i);
    }
  };

  struct Layout {
    size_t rows, ids, flags, bias, count, pending_merges, pending_entries,
        bitmask, total;
  };
  struct BitmaskRow {
    const uint32_t* words;
    size_t count;
    size_t offset;  // in words, from the first bitmask
  };

  // Keys a row's lists give (an upper bound on its merged entries).
  static size_t KeyCount(const ControlledRowInput& in) {
    const bool penalized = in.repetition_penalty != 1.0f;
    return in.num_bias + in.num_banned + (penalized ? in.num_prompt : 0) +
           in.num_output;
  }

  void ResizeEntries(size_t n) {
    special_ids_.resize(n);
    special_flags_.resize(n);
    special_bias_.resize(n);
    special_count_.resize(n);
  }

  // Sorts keys[0, count) as std::sort would, using scratch[0, count). The
  // keys come in (kind, index) order, so a stable sort by id alone (their
  // high 32 bits) gives that order: least-significant-digit radix over the
  // bits the ids use, in passes of at most 9 bits (two for ids below
  // 2^18: V = 151936 and 128256 alike). 256 rows of 64 bias entries, 4 bans and
  // 64 prompt and output ids, random below 151936 (a prompt's are out of
  // order), merged in 0.97-1.35 ms against 2.5-3.2 with std::sort on one
  // core of a development host (0.22-0.35 without sorting; with each list
  // ascending 0.96-1.34 against 1.9-2.5). Few keys take std::sort.
  static void SortKeysById(uint64_t* keys, size_t count, uint64_t* scratch) {
    constexpr size_t kRadixMinKeys = 32;
    constexpr int kMaxDigitBits = 9;
    if (count < kRadixMinKeys) {
      std::sort(keys, keys + count);
      return;
    }
    uint32_t used = 0;  // every id's bits
    for (size_t i = 0; i < count; ++i)
      used |= static_cast<uint32_t>(keys[i] >> 32);
    int bits = 0;
    while (bits < 32 && (used >> bits) != 0u) ++bits;
    const int passes = (bits + kMaxDigitBits - 1) / kMaxDigitBits;
    const int width = passes == 0 ? 0 : (bits + passes - 1) / passes;
    const uint32_t mask = (1u << width) - 1u;
    uint64_t* from = keys;
    uint64_t* to = scratch;
    for (int pass = 0; pass < passes; ++pass) {
      const int shift = 32 + pass * width;
      uint32_t start[1u << kMaxDigitBits];
      std::fill(start, start + mask + 1, 0u);
      for (size_t i = 0; i < count; ++i) ++start[(from[i] >> shift) & mask];
      // Each digit's first place. The running sum stays in a register: a
      // scan through the array chains every step through memory.
      uint32_t sum = 0;
      for (uint32_t d = 0; d <= mask; ++d) {
        const uint32_t n = start[d];
        start[d] = sum;
        sum += n;
      }
      for (size_t i = 0; i < count; ++i)
        to[start[(from[i] >> shift) & mask]++] = from[i];
      std::swap(from, to);
    }
    if (from != keys) std::memcpy(keys, from, sizeof(uint64_t) * count);
  }

  // Writes the row's merged entries from `at` on (room for KeyCount) and
  // returns how many, sorting in `keys`.
  size_t MergeEntries(const ControlledRowInput& in, size_t at,
                      std::vector<uint64_t>* keys) {
    // Each list entry as one key, id << 32 | kind << 30 | index, sorted:
    // ids ascending, and an id's entries in list order (kind, then index),
    // so that its bias entries are summed in request order. One integer
    // sort into a buffer kept across rows, and the merged entries written
    // in place: a stable sort of structs into a vector allocated per row,
    // and an append per entry, took 6.4 us a row with 64 bias entries, 4
    // bans and 64 prompt and output ids against 2.2 us (a development host).
    // An index fits 30 bits: a row's lists fit the engine's 16 MB staging.
    constexpr uint64_t kKindShift = 30;
    constexpr uint64_t kIndexMask = (uint64_t{1} << kKindShift) - 1;
    const bool penalized = in.repetition_penalty != 1.0f;
    // The keys, then as many again for SortKeysById.
    const size_t room = KeyCount(in);
    keys->resize(2 * room);
    uint64_t* next = keys->data();
    ForEachListEntry(in, [&next](int32_t id, uint32_t kind, size_t i) {
      *next++ = uint64_t{static_cast<uint32_t>(id)} << 32 |
                uint64_t{kind} << kKindShift | static_cast<uint64_t>(i);
    });
    const size_t count = static_cast<size_t>(next - keys->data());
    SortKeysById(keys->data(), count, keys->data() + room);
    size_t entries = at;
    for (size_t e = 0; e < count;) {
      const uint64_t* k = keys->data();
      const int32_t id = static_cast<int32_t>(k[e] >> 32);
      uint8_t flags = 0;
      float bias = 0.0f;
      int32_t total = 0;
      for (; e < count && static_cast<int32_t>(k[e] >> 32) == id; ++e) {
        const size_t index = static_cast<size_t>(k[e] & kIndexMask);
        const uint32_t kind = static_cast<uint32_t>(k[e] >> kKindShift) & 3u;
        if (kind == kPendingBias) {
          bias = (flags & controls::kSpecialHasBias)
                     ? bias + in.bias_values[index]
                     : in.bias_values[index];
        } else if (kind == kPendingOutput) {
          total += in.output_counts[index];
        }
        flags |= controls::ListEntryFlag(kind, penalized);
      }
      special_ids_[entries] = id;
      special_flags_[entries] = flags;
      special_bias_[entries] = bias;
      special_count_[entries] = total;
      ++entries;
    }
    return entries - at;
  }

  // Writes the row's list entries from pending_entries_[at] on, in
  // MergeEntries' key order before sorting, and returns how many: at most
  // its KeyCount (outputs of count 0 give none).
  size_t WritePendingEntries(const ControlledRowInput& in, size_t at) {
    PendingListEntry* next = pending_entries_.data() + at;
    ForEachListEntry(in, [&next, &in](int32_t id, uint32_t kind, size_t i) {
      next->id_kind = static_cast<uint32_t>(id) | kind << kPendingKindShift;
      next->value = 0;
      if (kind == kPendingBias) {
        std::memcpy(&next->value, &in.bias_values[i], sizeof(next->value));
      } else if (kind == kPendingOutput) {
        next->value = static_cast<uint32_t>(in.output_counts[i]);
      }
      ++next;
    });
    return static_cast<size_t>(next - (pending_entries_.data() + at));
  }

  // Calls fn(id, kind, index) for each entry of the row's lists that gives
  // its id a merged entry, list by list in kind order (kPendingBias ..
  // kPendingOutput) and each list in order: prompt ids only under a
  // repetition penalty, output ids only with a positive count.
  template <typename Fn>
  static void ForEachListEntry(const ControlledRowInput& in, Fn&& fn) {
    for (size_t i = 0; i < in.num_bias; ++i)
      fn(in.bias_ids[i], kPendingBias, i);
    for (size_t i = 0; i < in.num_banned; ++i)
      fn(in.banned_ids[i], kPendingBanned, i);
    if (in.repetition_penalty != 1.0f) {
      for (size_t i = 0; i < in.num_prompt; ++i)
        fn(in.prompt_ids[i], kPendingPrompt, i);
    }
    for (size_t i = 0; i < in.num_output; ++i) {
      if (in.output_counts[i] > 0) fn(in.output_ids[i], kPendingOutput, i);
    }
  }

  // Appends the row's controls, its entries [begin, end) and its bitmask.
  void AppendRow(const ControlledRowInput& in, size_t begin, size_t end) {
    ControlledRow row;
    row.temperature = in.temperature;
    row.top_k = in.top_k;
    row.top_p = in.top_p;
    row.min_p = in.min_p;
    row.log_min_p =
        in.min_p > 0.0f ? std::log(static_cast<double>(in.min_p)) : 0.0;
    row.repetition_penalty = in.repetition_penalty;
    row.frequency_penalty = in.frequency_penalty;
    row.presence_penalty = in.presence_penalty;
    row.seed = in.seed;
    row.step = in.step;
    row.n = in.n;
    row.top_n = in.top_n;
    row.logprob_flags = in.logprob_flags;
    row.special_begin = static_cast<int64_t>(begin);
    row.special_end = static_cast<int64_t>(end);
    if (in.allowed_bitmask != nullptr && in.bitmask_words > 0) {
      row.bitmask_offset = static_cast<int64_t>(bitmask_words_);
      bitmask_rows_.push_back(
          {in.allowed_bitmask, in.bitmask_words, bitmask_words_});
      bitmask_words_ += in.bitmask_words;
    }
    max_samples_ = std::max(max_samples_, in.n);
    max_top_n_ = std::max(max_top_n_, in.top_n);
    rows_.push_back(row);
  }

  Layout MakeLayout() const {
    auto align = [](size_t v) { return (v + 255) / 256 * 256; };
    Layout l;
    size_t at = 0;
    l.rows = at;
    at = align(at + sizeof(ControlledRow) * rows_.size());
    l.ids = at;
    at = align(at + 4 * special_ids_.size());
    l.flags = at;
    at = align(at + special_flags_.size());
    l.bias = at;
    at = align(at + 4 * special_bias_.size());
    l.count = at;
    at = align(at + 4 * special_count_.size());
    l.pending_merges = at;
    at = align(at + sizeof(PendingMergeRow) * pending_merges_.size());
    l.pending_entries = at;
    at = align(at + sizeof(PendingListEntry) * pending_entries_.size());
    l.bitmask = at;
    at = align(at + 4 * bitmask_words_);
    l.total = std::max<size_t>(at, 256);
    return l;
  }

  std::vector<ControlledRow> rows_;
  std::vector<int32_t> special_ids_;
  std::vector<uint8_t> special_flags_;
  std::vector<float> special_bias_;
  std::vector<int32_t> special_count_;
  std::vector<BitmaskRow> bitmask_rows_;  // the callers' arrays, in order
  std::vector<PendingMergeRow> pending_merges_;
  std::vector<PendingListEntry> pending_entries_;
  size_t max_pending_keys_ = 0;
  bool last_row_pending_ = false;  // RepeatLastRow extends its merge
  static constexpr size_t kNotPending = ~size_t{0};
  std::vector<size_t> region_begin_;  // AddRows' scratch, a row each
  std::vector<size_t> region_entries_;
  std::vector<size_t> pending_begin_;
  size_t bitmask_words_ = 0;
  int max_samples_ = 1;
  int max_top_n_ = 0;
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_CONTROLS_CONTROLLED_PLAN_H_
