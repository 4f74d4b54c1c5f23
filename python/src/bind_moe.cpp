// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The MoE device transport's row kernels in fastcomms._C (NOTE [moe row kernels] in
// include/fastcomms/core/rows.hpp; used by python/fastcomms/_moe_device.py and moe.py). CUDA
// tensors only: the callers keep torch's ops for CPU tensors. Every check is here, on shapes and
// strides; no value is read on the host.
#include <optional>

#include "binding.hpp"
#include "fastcomms/core/rows.hpp"
#include "tensors.hpp"

#ifdef FASTCOMMS_WITH_CUDA
#include <c10/core/DeviceGuard.h>
#endif

namespace py = pybind11;

namespace fastcomms::python {
namespace {

void check_cuda(const char* what, const char* name, const at::Tensor& t, const at::Tensor& like) {
  FASTCOMMS_CHECK(t.is_cuda() && t.device() == like.device(), kInvalidArgument, what, ": ", name,
                  " must be on ", like.device().str(), ", got ", t.device().str());
}

void check_index(const char* what, const at::Tensor& index, int64_t n, const at::Tensor& like) {
  check_cuda(what, "index", index, like);
  FASTCOMMS_CHECK(index.scalar_type() == at::kLong, kTypeError, what,
                  ": index must be int64, got ", c10::toString(index.scalar_type()));
  FASTCOMMS_CHECK(index.dim() == 1 && index.numel() == n && index.is_contiguous(),
                  kInvalidArgument, what, ": index must be a contiguous (", n,
                  ",) tensor, got shape ", index.sizes());
}

void* stream_of(const at::Tensor& t) {
#ifdef FASTCOMMS_WITH_CUDA
  return current_stream(Device{DeviceType::kCUDA, t.device().index()});
#else
  (void)t;
  throw Error(ErrorCode::kUnsupported, "moe row kernels: this build has no CUDA");
#endif
}

}  // namespace

void bind_moe(py::module_& m) {
  m.def(
      "_moe_gather_rows",
      [](const at::Tensor& dst, const at::Tensor& src, const at::Tensor& index,
         const std::optional<at::Tensor>& count, bool zero_rest) {
        const char* what = "moe gather_rows";
        FASTCOMMS_CHECK(dst.is_cuda(), kInvalidArgument, what, ": dst must be a CUDA tensor, got ",
                        dst.device().str());
        check_cuda(what, "src", src, dst);
        for (const at::Tensor* t : {&dst, &src}) {
          FASTCOMMS_CHECK(t->scalar_type() == at::kByte && t->dim() == 2 && t->stride(1) == 1 &&
                              t->stride(0) >= t->size(1),
                          kInvalidArgument, what,
                          ": dst and src must be uint8 (rows, bytes) with rows of unit stride, got ",
                          c10::toString(t->scalar_type()), " ", t->sizes(), " strides ",
                          t->strides());
        }
        FASTCOMMS_CHECK(dst.size(1) == src.size(1), kInvalidArgument, what, ": rows of ",
                        dst.size(1), " bytes (dst) and ", src.size(1), " bytes (src)");
        check_index(what, index, dst.size(0), dst);
        const int64_t* c = nullptr;
        if (count) {
          check_cuda(what, "count", *count, dst);
          FASTCOMMS_CHECK(count->scalar_type() == at::kLong && count->numel() == 1,
                          kInvalidArgument, what, ": count must be one int64, got ",
                          c10::toString(count->scalar_type()), " ", count->sizes());
          c = count->data_ptr<int64_t>();
        }
#ifdef FASTCOMMS_WITH_CUDA
        c10::DeviceGuard guard(dst.device());
#endif
        gather_rows_device(dst.data_ptr(), dst.stride(0), src.data_ptr(), src.stride(0),
                           src.size(0), dst.size(1), index.data_ptr<int64_t>(), dst.size(0), c,
                           zero_rest, stream_of(dst));
      },
      py::arg("dst"), py::arg("src"), py::arg("index"), py::arg("count") = py::none(),
      py::arg("zero_rest") = false,
      "dst[i] = src[index[i]] for i < count (read on the GPU), zeros for index < 0; rows from count "
      "on zeroed (zero_rest) or untouched");
  m.def(
      "_moe_weighted_sum",
      [](const at::Tensor& out, const at::Tensor& src, const std::optional<at::Tensor>& index,
         const at::Tensor& w) {
        const char* what = "moe weighted_sum";
        FASTCOMMS_CHECK(out.is_cuda(), kInvalidArgument, what, ": out must be a CUDA tensor, got ",
                        out.device().str());
        check_cuda(what, "src", src, out);
        check_cuda(what, "w", w, out);
        FASTCOMMS_CHECK(out.dim() == 2 && out.is_contiguous(), kInvalidArgument, what,
                        ": out must be a contiguous (tokens, d) tensor, got ", out.sizes());
        const int64_t tokens = out.size(0), d = out.size(1);
        FASTCOMMS_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(0) == tokens &&
                            w.is_contiguous(),
                        kInvalidArgument, what, ": w must be contiguous float32 (", tokens,
                        ", k), got ", c10::toString(w.scalar_type()), " ", w.sizes());
        const int64_t k = w.size(1);
        FASTCOMMS_CHECK(src.dim() == 2 && src.size(1) == d && src.stride(1) == 1 &&
                            src.stride(0) >= d,
                        kInvalidArgument, what, ": src must be (rows, ", d,
                        ") with rows of unit stride, got ", src.sizes(), " strides ",
                        src.strides());
        const int64_t* idx = nullptr;
        if (index) {
          check_index(what, *index, tokens * k, out);
          idx = index->data_ptr<int64_t>();
        } else {
          FASTCOMMS_CHECK(src.size(0) == tokens * k, kInvalidArgument, what,
                          ": without an index src must have tokens * k = ", tokens * k,
                          " rows, got ", src.size(0));
        }
#ifdef FASTCOMMS_WITH_CUDA
        c10::DeviceGuard guard(out.device());
#endif
        weighted_sum_rows_device(out.data_ptr(), to_dtype(out.scalar_type()), src.data_ptr(),
                                 to_dtype(src.scalar_type()), src.stride(0) * src.element_size(),
                                 src.size(0), idx, w.data_ptr<float>(), tokens, k, d,
                                 stream_of(out));
      },
      py::arg("out"), py::arg("src"), py::arg("index"), py::arg("w"),
      "out[t] = sum_j w[t, j] * src[index[t * k + j]] in float32, slot order, no FMA");
  m.def("_moe_has_row_kernels", &has_row_kernels);
}

}  // namespace fastcomms::python
