// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fastcomms/plan/reference.hpp"

#include <cstring>

#include "fastcomms/error.hpp"

namespace fastcomms::plan {

RankBuffers reference_all_to_all_4d(int mode, int64_t b, int64_t d, int64_t e,
                                    const std::vector<int64_t>& seq,
                                    const std::vector<int64_t>& heads, const RankBuffers& inputs) {
  const int P = static_cast<int>(seq.size());
  FASTCOMMS_CHECK(static_cast<int>(heads.size()) == P && static_cast<int>(inputs.size()) == P,
                  kInvalidArgument, "reference_all_to_all_4d: ", P, " seq splits, ", heads.size(),
                  " head splits, ", inputs.size(), " inputs");
  std::vector<int64_t> S_off(P + 1, 0), H_off(P + 1, 0);
  for (int i = 0; i < P; ++i) {
    S_off[i + 1] = S_off[i] + seq[i];
    H_off[i + 1] = H_off[i] + heads[i];
  }
  const int64_t S = S_off[P], N = H_off[P];
  auto el = [e](const std::vector<std::byte>& buf, int64_t idx) { return buf.data() + idx * e; };
  auto el_mut = [e](std::vector<std::byte>& buf, int64_t idx) { return buf.data() + idx * e; };

  // Step 1: permute each input into its send buffer and record the all_to_all_single splits
  // (in elements of the flattened buffer).
  RankBuffers send(P);
  std::vector<std::vector<int64_t>> send_split(P, std::vector<int64_t>(P));
  for (int r = 0; r < P; ++r) {
    const int64_t s_r = seq[r], h_r = heads[r];
    if (mode == 0) {
      // x (b, s_r, N, d) -> permute(2, 1, 0, 3) -> (N, s_r, b, d); peer q gets heads H_q..
      send[r].resize(static_cast<size_t>(N * s_r * b * d * e));
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < s_r; ++i)
          for (int64_t bi = 0; bi < b; ++bi)
            for (int64_t k = 0; k < d; ++k)
              std::memcpy(el_mut(send[r], ((n * s_r + i) * b + bi) * d + k),
                          el(inputs[r], ((bi * s_r + i) * N + n) * d + k), e);
      for (int q = 0; q < P; ++q) send_split[r][q] = heads[q] * s_r * b * d;
    } else {
      // x (b, S, h_r, d) -> permute(1, 2, 0, 3) -> (S, h_r, b, d); peer q gets tokens S_q..
      send[r].resize(static_cast<size_t>(S * h_r * b * d * e));
      for (int64_t s = 0; s < S; ++s)
        for (int64_t j = 0; j < h_r; ++j)
          for (int64_t bi = 0; bi < b; ++bi)
            for (int64_t k = 0; k < d; ++k)
              std::memcpy(el_mut(send[r], ((s * h_r + j) * b + bi) * d + k),
                          el(inputs[r], ((bi * S + s) * h_r + j) * d + k), e);
      for (int q = 0; q < P; ++q) send_split[r][q] = seq[q] * h_r * b * d;
    }
  }

  // Step 2: all_to_all_single semantics: rank r's chunk q lands as rank q's chunk r.
  std::vector<std::vector<std::vector<std::byte>>> recv(P, std::vector<std::vector<std::byte>>(P));
  for (int r = 0; r < P; ++r) {
    int64_t off = 0;
    for (int q = 0; q < P; ++q) {
      const auto* begin = send[r].data() + off * e;
      recv[q][r].assign(begin, begin + send_split[r][q] * e);
      off += send_split[r][q];
    }
  }

  // Step 3: permute the received chunks into the output.
  RankBuffers out(P);
  for (int r = 0; r < P; ++r) {
    const int64_t s_r = seq[r], h_r = heads[r];
    if (mode == 0) {
      // chunk from p: (h_r, s_p, b, d) -> (b, s_p, h_r, d), concatenated along dim 1.
      out[r].resize(static_cast<size_t>(b * S * h_r * d * e));
      for (int p = 0; p < P; ++p)
        for (int64_t j = 0; j < h_r; ++j)
          for (int64_t i = 0; i < seq[p]; ++i)
            for (int64_t bi = 0; bi < b; ++bi)
              for (int64_t k = 0; k < d; ++k)
                std::memcpy(el_mut(out[r], ((bi * S + S_off[p] + i) * h_r + j) * d + k),
                            el(recv[r][p], ((j * seq[p] + i) * b + bi) * d + k), e);
    } else {
      // chunk from p: (s_r, h_p, b, d) -> (b, s_r, h_p, d), concatenated along dim 2.
      out[r].resize(static_cast<size_t>(b * s_r * N * d * e));
      for (int p = 0; p < P; ++p)
        for (int64_t i = 0; i < s_r; ++i)
          for (int64_t j = 0; j < heads[p]; ++j)
            for (int64_t bi = 0; bi < b; ++bi)
              for (int64_t k = 0; k < d; ++k)
                std::memcpy(el_mut(out[r], ((bi * s_r + i) * N + H_off[p] + j) * d + k),
                            el(recv[r][p], ((i * heads[p] + j) * b + bi) * d + k), e);
    }
  }
  return out;
}

RankBuffers repeat_interleave_heads(const RankBuffers& inputs, int64_t heads, int64_t d,
                                    int64_t element_size, int64_t R) {
  FASTCOMMS_CHECK(heads >= 0 && d >= 0 && element_size > 0 && R >= 1, kInvalidArgument,
                  "repeat_interleave_heads: bad geometry heads=", heads, " d=", d,
                  " element_size=", element_size, " R=", R);
  const int64_t row = d * element_size;
  RankBuffers out(inputs.size());
  for (size_t r = 0; r < inputs.size(); ++r) {
    const int64_t rows =
        heads * row == 0 ? 0 : static_cast<int64_t>(inputs[r].size()) / (heads * row);
    out[r].resize(inputs[r].size() * static_cast<size_t>(R));
    std::byte* o = out[r].data();
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t k = 0; k < R; ++k, o += row)
          std::memcpy(o, inputs[r].data() + (i * heads + h) * row, static_cast<size_t>(row));
  }
  return out;
}

}  // namespace fastcomms::plan
