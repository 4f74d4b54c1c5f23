# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""A developer probe (not a test), one GPU, no communicator: how much a copy that needs no SM
slows a chain of bf16 GEMMs running beside it. It asks whether the overlap target of the Ulysses
all-to-all (issue 13: 85% of an async zero-SM call hidden under GEMMs) is reachable at all when
the call's bytes must cross this GPU's memory while the GEMMs run.

The all-to-all of (1, 18900, 40, 128) bf16 at world 2 moves, per GPU, 92.3 MiB out over NVLink,
92.3 MiB in, and copies its own 92.3 MiB share locally: 184.6 MiB read and 184.6 MiB written in
this GPU's HBM. A local device-to-device copy of 184.6 MiB has the same HBM traffic (not the
same rate: NVLink is slower than local HBM). Variants of the side work, on a high-priority
stream beside the GEMM chain on the default stream:

  ce    cudaMemcpyAsync device to device (the copy engines; torch copy_ of contiguous bytes)
  sm    the same bytes through an elementwise kernel (SMs)
  plain, stream   (with --kernels: built here by torch's cpp_extension) a 16-byte-vector SM copy
        with ordinary loads and stores, and the same with streaming cache hints (__ldcs /
        __stcs: read once, evict first) that keep the copied bytes from displacing the GEMMs'
        operands in L2

Per variant: gemm alone, side alone and both (interleaved rounds, medians); hidden =
(gemm + side - both) / side; the GEMM chain's own time inside "both". Then sustained phases of
about a second each (GEMMs alone, GEMMs with copies beside, copies alone) while nvidia-smi
samples SM clock and power (read-only), to tell a memory-contention slowdown from a clock one.

Usage: python3 tools/gpu/probe_overlap.py [--gemms 4 16] [--mib 92 185 369] [--rounds 9]
       [--kernels] [--no-phases]
"""

import argparse
import statistics
import subprocess
import threading
import time

import torch


def _chain(a, b, n):
    for _ in range(n):
        torch.mm(a, b)


_KERNELS = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
template <bool kStream>
__global__ void copy16(const uint4* __restrict__ s, uint4* __restrict__ d, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    if constexpr (kStream) __stcs(d + i, __ldcs(s + i)); else d[i] = s[i];
  }
}
void copy(torch::Tensor s, torch::Tensor d, bool streaming) {
  int64_t n = s.numel() / 16;
  auto st = c10::cuda::getCurrentCUDAStream();
  int blocks = 132 * 4;
  if (streaming)
    copy16<true><<<blocks, 512, 0, st>>>((const uint4*)s.data_ptr(), (uint4*)d.data_ptr(), n);
  else
    copy16<false><<<blocks, 512, 0, st>>>((const uint4*)s.data_ptr(), (uint4*)d.data_ptr(), n);
}
"""
_ext = None


def _build_kernels():
    global _ext
    from torch.utils.cpp_extension import load_inline

    _ext = load_inline(
        "probe_overlap_kernels",
        cpp_sources="void copy(torch::Tensor s, torch::Tensor d, bool streaming);",
        cuda_sources=_KERNELS,
        functions=["copy"],
        extra_cuda_cflags=["-O3"],
    )


def _side_fn(kind, src, dst, n_bytes):
    s, d = src[:n_bytes], dst[:n_bytes]
    if kind == "ce":
        return lambda: d.copy_(s, non_blocking=True)
    if kind in ("plain", "stream"):
        return lambda: _ext.copy(s, d, kind == "stream")
    s64, d64 = s.view(torch.int64), d.view(torch.int64)
    return lambda: torch.bitwise_not(s64, out=d64)  # an SM kernel over the same bytes


def _ms(a, b):
    return a.elapsed_time(b) * 1e3  # µs


def _round(a, b, n_gemm, side, side_stream):
    main = torch.cuda.current_stream()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(8)]
    out = {}
    # gemm alone
    ev[0].record(main)
    _chain(a, b, n_gemm)
    ev[1].record(main)
    # side alone (on its stream, ordered after the gemm chain)
    side_stream.wait_event(ev[1])
    with torch.cuda.stream(side_stream):
        ev[2].record(side_stream)
        side()
        ev[3].record(side_stream)
    main.wait_event(ev[3])
    # both: the side work starts with the chain
    ev[4].record(main)
    side_stream.wait_event(ev[4])
    with torch.cuda.stream(side_stream):
        side()
        ev[5].record(side_stream)
    _chain(a, b, n_gemm)
    ev[6].record(main)
    main.wait_event(ev[5])
    ev[7].record(main)
    ev[7].synchronize()
    out["gemm"] = _ms(ev[0], ev[1])
    out["side"] = _ms(ev[2], ev[3])
    out["both"] = _ms(ev[4], ev[7])
    out["gemm in both"] = _ms(ev[4], ev[6])
    out["side in both"] = _ms(ev[4], ev[5])
    return out


class _Sampler:
    """nvidia-smi's SM clock (MHz) and power (W), every 50 ms, for this process's GPU."""

    def __init__(self, uuid):
        self.rows, self._mark = [], "start"
        cmd = [
            "nvidia-smi",
            f"--id={uuid}",
            "--query-gpu=clocks.sm,power.draw",
            "--format=csv,noheader,nounits",
            "-lms",
            "50",
        ]
        try:
            self._p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        except OSError as e:
            self._p = None
            print(f"nvidia-smi not usable ({e}): no clock samples")
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self._p.stdout:
            try:
                clk, pw = (float(v) for v in line.split(","))
            except ValueError:
                continue
            self.rows.append((self._mark, clk, pw))

    def mark(self, m):
        self._mark = m

    def summary(self, m):
        r = [(c, p) for k, c, p in self.rows if k == m]
        if not r:
            return "no samples"
        return (
            f"SM clock median {statistics.median(c for c, _ in r):.0f} MHz "
            f"(min {min(c for c, _ in r):.0f}), "
            f"power median {statistics.median(p for _, p in r):.0f} W ({len(r)} samples)"
        )

    def stop(self):
        if self._p:
            self._p.terminate()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gemms", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--mib", type=float, nargs="+", default=[92.3, 184.6, 369.2])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--phase-s", type=float, default=1.5)
    ap.add_argument("--kernels", action="store_true", help="add the plain and streaming copies")
    ap.add_argument("--no-phases", action="store_true", help="skip the sustained phases")
    args = ap.parse_args()
    kinds = ("ce", "sm")
    if args.kernels:
        _build_kernels()
        kinds += ("plain", "stream")

    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    print(f"device {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    top = int(max(args.mib) * (1 << 20)) // 16 * 16
    src = torch.randint(0, 255, (top,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    side_stream = torch.cuda.Stream(device=dev, priority=-1)

    print("\nhidden = (gemm + side - both) / side; µs, medians of interleaved rounds")
    hdr = [
        "GEMMs",
        "side",
        "MiB",
        "gemm",
        "side",
        "both",
        "gemm in both",
        "side in both",
        "hidden %",
    ]
    print(" | ".join(hdr))
    for n_gemm in args.gemms:
        fns = {
            (k, m): _side_fn(k, src, dst, int(m * (1 << 20)) // 16 * 16)
            for k in kinds
            for m in args.mib
        }
        for fn in fns.values():  # warm-up
            _round(a, b, n_gemm, fn, side_stream)
        samples = {key: [] for key in fns}
        for _ in range(args.rounds):
            for key, fn in fns.items():
                samples[key].append(_round(a, b, n_gemm, fn, side_stream))
        for (kind, mib), rs in samples.items():
            med = {c: statistics.median(r[c] for r in rs) for c in rs[0]}
            hidden = 100 * (med["gemm"] + med["side"] - med["both"]) / med["side"]
            cols = ("gemm", "side", "both", "gemm in both", "side in both")
            vals = " | ".join(f"{med[c]:.1f}" for c in cols)
            print(f"{n_gemm} | {kind} | {mib:.1f} | {vals} | {hidden:.1f}")

    if args.no_phases:
        return
    # sustained phases with clock and power samples
    sampler = _Sampler(props.uuid if str(props.uuid).startswith("GPU-") else f"GPU-{props.uuid}")
    n_copy = int(184.6 * (1 << 20)) // 16 * 16
    ce = _side_fn("ce", src, dst, n_copy)

    def phase(name, gemms, copies):
        torch.cuda.synchronize()
        sampler.mark(name)
        t_end = time.monotonic() + args.phase_s
        n = 0
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        while time.monotonic() < t_end:
            if copies:
                side_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side_stream):
                    for _ in range(copies):
                        ce()
            if gemms:
                _chain(a, b, gemms)
            torch.cuda.current_stream().wait_stream(side_stream)
            n += 1
            if n % 8 == 0:
                torch.cuda.synchronize()  # keep the host within a few iterations of the GPU
        stop.record()
        stop.synchronize()
        sampler.mark("between")
        per = _ms(start, stop) / n
        print(f"{name}: {n} iterations, {per:.1f} µs each; {sampler.summary(name)}")

    print("\nsustained phases (16 GEMMs 4096³ per iteration; 2 copies of 184.6 MiB beside)")
    time.sleep(0.3)
    phase("gemms alone", 16, 0)
    phase("gemms + copies", 16, 2)
    phase("copies alone", 0, 2)
    phase("gemms alone again", 16, 0)
    sampler.stop()


if __name__ == "__main__":
    main()
