// Pure layout arithmetic of tensor parallelism (no CUDA): which vocabulary
// rows each rank holds, and where each rank's stage-1 candidates land in the
// reducing rank's buffer. Kept free of device code so that the layouts of 2, 4
// and 8 ranks are tested on every CI machine, GPU or not.
#ifndef FLASHSAMPLER_KERNELS_TP_TP_LAYOUT_H_
#define FLASHSAMPLER_KERNELS_TP_TP_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

namespace flashsampler {

// The vocabulary slice one rank holds and its tiles' place in the reducing
// rank's candidate buffer.
struct TpShard {
  int64_t vocab_offset = 0;  // global token id of the shard's first row
  int64_t vocab_rows = 0;    // rows of W this rank holds (>= 1)
  int64_t tile_offset = 0;   // first tile of this rank in the reducing buffer
  int64_t num_tiles = 0;     // ceil(vocab_rows / tile_rows)
};

// W [V, D] split by vocabulary rows into contiguous shards, rank r holding
// rows [vocab_offset, vocab_offset + vocab_rows). The reducing rank's buffer
// is [total_tiles][num_samples][batch] Candidates: rank r's stage 1 writes its
// own [num_tiles][num_samples][batch] block starting at tile tile_offset, so
// the ranks' blocks tile the buffer without gaps or overlap and stage 2 sees
// one ordinary candidate array.
struct TpLayout {
  int64_t vocab_size = 0;  // V
  int tile_rows = 0;       // vocabulary rows per stage-1 tile
  std::vector<TpShard> shards;
  int64_t total_tiles = 0;  // sum of the shards' num_tiles

  int num_ranks() const { return static_cast<int>(shards.size()); }

  // Candidate index (not bytes) where `rank`'s block begins for a step of
  // `batch` rows and `num_samples` samples. Worked number: V = 128256 over 2
  // ranks with 128-row tiles gives 501 tiles each, so at B = 256, n = 1 rank
  // 1 starts at candidate 501 * 256 = 128256.
  int64_t CandidateOffset(int rank, int num_samples, int batch) const {
    return shards[rank].tile_offset * num_samples * batch;
  }

  // Candidates in the whole buffer for one step.
  int64_t CandidateCount(int num_samples, int batch) const {
    return total_tiles * num_samples * batch;
  }

  // Rank holding global token id `token` (0 <= token < V), or -1.
  int RankOfToken(int64_t token) const {
    for (int r = 0; r < num_ranks(); ++r) {
      const TpShard& s = shards[r];
      if (token >= s.vocab_offset && token < s.vocab_offset + s.vocab_rows) {
        return r;
      }
    }
    return -1;
  }
};

inline int64_t TpCeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Splits V rows over ranks in proportion to positive integer `parts` (e.g.
// {1, 1} for halves, {3, 2} for 60/40): rank r gets floor(V * part_r / sum)
// rows, and the rows left over go one each to the lowest ranks. Fails (false,
// `error` says why) when V < number of ranks, a part is not positive, or a
// rank would get no rows.
inline bool MakeTpLayout(int64_t vocab_size, const std::vector<int64_t>& parts,
                         int tile_rows, TpLayout* out, std::string* error) {
  *out = TpLayout{};
  const int ranks = static_cast<int>(parts.size());
  if (ranks < 1) {
    *error = "tensor parallel layout needs at least one rank";
    return false;
  }
  if (tile_rows < 1) {
    *error = "tile_rows must be >= 1, got " + std::to_string(tile_rows);
    return false;
  }
  if (vocab_size < ranks) {
    *error = "vocab_size " + std::to_string(vocab_size) +
             " is smaller than the number of ranks " + std::to_string(ranks);
    return false;
  }
  int64_t total_parts = 0;
  for (int64_t p : parts) {
    if (p < 1) {
      *error = "every split part must be >= 1, got " + std::to_string(p);
      return false;
    }
    total_parts += p;
  }
  std::vector<int64_t> rows(ranks);
  int64_t assigned = 0;
  for (int r = 0; r < ranks; ++r) {
    // V * part fits in int64 for any real vocabulary (< 2^31) and parts (<
    // 2^31); the division rounds down so the sum never exceeds V.
    rows[r] = vocab_size * parts[r] / total_parts;
    assigned += rows[r];
  }
  for (int r = 0; assigned < vocab_size; r = (r + 1) % ranks) {
    ++rows[r];
    ++assigned;
  }
  TpLayout layout;
  layout.vocab_size = vocab_size;
  layout.tile_rows = tile_rows;
  int64_t offset = 0;
  int64_t tiles = 0;
  for (int r = 0; r < ranks; ++r) {
    if (rows[r] < 1) {
      *error = "rank " + std::to_string(r) + " would hold no vocabulary rows";
      return false;
    }
    TpShard s;
    s.vocab_offset = offset;
    s.vocab_rows = rows[r];
    s.tile_offset = tiles;
    s.num_tiles = TpCeilDiv(rows[r], tile_rows);
    offset += rows[r];
    tiles += s.num_tiles;
    layout.shards.push_back(s);
  }
  layout.total_tiles = tiles;
  *out = layout;
  return true;
}

// The default split: equal parts over `ranks` (V = 1001 over 2: 501 + 500).
inline bool MakeEvenTpLayout(int64_t vocab_size, int ranks, int tile_rows,
                             TpLayout* out, std::string* error) {
  if (ranks < 1) {
    *error = "tensor parallel layout needs at least one rank";
    return false;
  }
  return MakeTpLayout(vocab_size, std::vector<int64_t>(ranks, 1), tile_rows,
                      out, error);
}

// Checks every invariant the exchange relies on: shards contiguous from token
// 0 to V, none empty, tiles = ceil(rows / tile_rows), tile blocks contiguous
// from tile 0 to total_tiles. Returns false and says which one broke.
inline bool ValidateTpLayout(const TpLayout& layout, std::string* error) {
  if (layout.shards.empty()) {
    *error = "layout has no ranks";
    return false;
  }
  if (layout.tile_rows < 1) {
    *error = "layout tile_rows < 1";
    return false;
  }
  int64_t offset = 0;
  int64_t tiles = 0;
  for (int r = 0; r < layout.num_ranks(); ++r) {
    const TpShard& s = layout.shards[r];
    const std::string who = "rank " + std::to_string(r) + ": ";
    if (s.vocab_rows < 1) {
      *error = who + "no vocabulary rows";
      return false;
    }
    if (s.vocab_offset != offset) {
      *error = who + "vocab_offset " + std::to_string(s.vocab_offset) +
               ", expected " + std::to_string(offset);
      return false;
    }
    if (s.num_tiles != TpCeilDiv(s.vocab_rows, layout.tile_rows)) {
      *error = who + "num_tiles " + std::to_string(s.num_tiles) +
               " != ceil(rows / tile_rows)";
      return false;
    }
    if (s.tile_offset != tiles) {
      *error = who + "tile_offset " + std::to_string(s.tile_offset) +
               ", expected " + std::to_string(tiles);
      return false;
    }
    offset += s.vocab_rows;
    tiles += s.num_tiles;
  }
  if (offset != layout.vocab_size) {
    *error = "shards cover " + std::to_string(offset) + " rows, V is " +
             std::to_string(layout.vocab_size);
    return false;
  }
  if (tiles != layout.total_tiles) {
    *error = "total_tiles " + std::to_string(layout.total_tiles) +
             ", shards have " + std::to_string(tiles);
    return false;
  }
  return true;
}

// Parses a split such as "1:1", "60:40" or "3:2:2:1" into parts; an empty
// string or "even" means `ranks` equal parts. False on malformed input.
inline bool ParseTpSplit(const std::string& text, int ranks,
                         std::vector<int64_t>* parts, std::string* error) {
  parts->clear();
  if (text.empty() || text == "even") {
    parts->assign(ranks, 1);
    return true;
  }
  int64_t value = 0;
  bool have_digit = false;
  for (size_t i = 0; i <= text.size(); ++i) {
    if (i == text.size() || text[i] == ':') {
      if (!have_digit) {
        *error = "malformed split '" + text + "'";
        return false;
      }
      parts->push_back(value);
      value = 0;
      have_digit = false;
    } else if (text[i] >= '0' && text[i] <= '9' && value < (int64_t{1} << 40)) {
      value = value * 10 + (text[i] - '0');
      have_digit = true;
    } else {
      *error = "malformed split '" + text + "'";
      return false;
    }
  }
  if (static_cast<int>(parts->size()) != ranks) {
    *error = "split '" + text + "' has " + std::to_string(parts->size()) +
             " parts for " + std::to_string(ranks) + " ranks";
    return false;
  }
  return true;
}

}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_TP_TP_LAYOUT_H_
