# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""A ring all-reduce in CUDA C++ with the device window (docs/device_api.md).

``device_window_cuda.cu`` holds the kernel; this script compiles it once with nvcc against
fastcomms' header (``fastcomms.get_include()``; no torch extension, so it takes seconds), loads it
with ctypes, and runs it on ``--nproc`` ranks, checking every call against torch: the sum of
every rank's input computed locally (integer-valued float32, exact in any order).

Run: ``python examples/device_window_cuda.py --nproc 2`` (ranks on GPU ``rank % gpus``; ranks
that share a GPU need MPS, tools/gpu/mps.sh).
"""

import argparse
import ctypes
import datetime
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

import fastcomms
import torch
import torch.multiprocessing as mp

HERE = pathlib.Path(__file__).resolve().parent


def build() -> pathlib.Path:
    """The kernel library, compiled once per source and header (cached under ~/.cache)."""
    src = HERE / "device_window_cuda.cu"
    inc = pathlib.Path(fastcomms.get_include())
    key = hashlib.sha256(src.read_bytes())
    for h in sorted((inc / "fastcomms" / "device").glob("*")):
        key.update(h.read_bytes())
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
    lib = cache / "fastcomms" / "examples" / f"device_window_cuda-{key.hexdigest()[:16]}.so"
    if not lib.exists():
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        major, minor = torch.cuda.get_device_capability()
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(
            [
                nvcc,
                "-std=c++17",
                f"-arch=sm_{major}{minor}",
                "-Xcompiler",
                "-fPIC",
                "-shared",
                f"-I{inc}",
                str(src),
                "-o",
                str(tmp),
            ],
            check=True,
        )
        os.replace(tmp, lib)
    return lib


def inputs(size, numel):
    g = torch.Generator().manual_seed(4321)
    return [torch.randint(-1000, 1000, (numel,), generator=g).float() for _ in range(size)]


def run(rank, size, path, lib_path, numel, calls):
    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    lib = ctypes.CDLL(lib_path)
    lib.ring_all_reduce_launch.argtypes = [ctypes.c_uint64] * 6
    chunk = numel // size
    landing = torch.zeros(2 * size * chunk, dtype=torch.float32, device=dev)
    timeout = datetime.timedelta(seconds=60)
    if size <= torch.cuda.device_count():  # a GPU per rank: an nvlink communicator's window
        store = torch.distributed.FileStore(path, size)
        comm = fastcomms.new_comm("nvlink", dev, "ring", store=store, timeout=timeout)
        win = comm.new_window(landing)  # collective
    else:  # ranks share a GPU (MPS clients), which NCCL refuses: a window over a store folder
        comm = None
        win = fastcomms.store_window(rank, size, dev, path + ".d", "ring", timeout, landing)
    dwin = win.get_device_window(signal_count=2, counter_count=0, barrier_count=1)
    x = torch.empty(size * chunk, dtype=torch.float32, device=dev)
    x_buf = win.register_local_buffer(x)
    every = inputs(size, size * chunk)
    want = torch.stack(every).sum(0)
    for call in range(calls):
        x.copy_(every[rank].to(dev) * (call + 1))
        err = lib.ring_all_reduce_launch(
            dwin, x_buf, x.data_ptr(), chunk, call, torch.cuda.current_stream().cuda_stream
        )
        assert err == 0, f"launch failed: cudaError {err}"
        got = x.cpu()
        assert torch.equal(got, want * (call + 1)), f"rank {rank} call {call}: wrong sum"
    torch.cuda.synchronize()
    win.check_errors()
    win.deregister_local_buffer(x_buf)
    win.tensor_deregister()
    if comm is not None:
        comm.finalize()
    if rank == 0:
        print(
            f"ring all-reduce (CUDA) of {size * chunk} floats on {size} ranks, {calls} calls: "
            "matches torch"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--numel", type=int, default=1 << 16)
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args()
    lib = str(build())
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "store.d"))
        mp.start_processes(
            run,
            args=(a.nproc, os.path.join(d, "store"), lib, a.numel, a.calls),
            nprocs=a.nproc,
            start_method="spawn",
        )


if __name__ == "__main__":
    main()
