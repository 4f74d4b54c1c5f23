# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""GPU tier: UlyssesGroup on CUDA tensors, bit-exact against torch.distributed's permute +
all_to_all_single + permute (run on CPU copies over gloo, so ranks may share one GPU).

The NVLink transport runs at world 2 and 3 with ranks placed round-robin on the GPUs there are
(several ranks per GPU where there are fewer GPUs than ranks: CUDA IPC allows it). The CUDA
collective path (nccl) needs one GPU per rank and runs only with 2+ GPUs. Skipped, saying why,
without CUDA or without a CUDA build of the extension."""

import os
import random
import shutil
import subprocess
import tempfile
import time

import pytest
import torch
from conftest import _hang_guard, init_rank, spawn

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (the GPU tier runs in scripts/gpu.sh)",
)

needs_cuda_build = pytest.mark.skipif(
    not __import__("fastcomms")._C.has_transport("nvlink"),
    reason="the extension was built without CUDA",
)

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int32,
]


def _rand(shape, dtype, gen):
    """Random bytes of every pattern (NaNs included): the exchange only moves bytes."""
    n = 1
    for v in shape:
        n *= v
    item = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * item,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def _same_bytes(a, b):
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _reference(ref, x, mode, seq, heads):
    """permute + torch.distributed.all_to_all_single + permute on CPU copies over gloo. Gloo has
    no float8 type, so float8 tensors move as their bytes (the exchange only moves bytes)."""
    x = x.detach().cpu()
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return ref.all_to_all_4d(
            x.view(torch.uint8), mode=mode, seq_splits=seq, head_splits=heads
        ).view(x.dtype)
    return ref.all_to_all_4d(x, mode=mode, seq_splits=seq, head_splits=heads)


def _geometry(rng, world, mode, uneven):
    # d * element size a multiple of 16 bytes for every dtype: the peer-to-peer path's rule
    b, d = rng.choice([1, 2]), rng.choice([16, 32, 48, 64])
    if uneven:
        seq = [rng.randint(0, 9) for _ in range(world)]
        heads = [rng.randint(0, 4) for _ in range(world)]
        if sum(seq) == 0:
            seq[0] = 3
        if sum(heads) == 0:
            heads[-1] = 2
    else:
        seq, heads = [rng.randint(1, 9)] * world, [rng.randint(1, 3)] * world
    return b, d, seq, heads


def _input(rank, mode, b, d, seq, heads, dtype, gen, device):
    shape = (b, seq[rank], sum(heads), d) if mode == 0 else (b, sum(seq), heads[rank], d)
    return _rand(shape, dtype, gen).to(device)


def _shared_seed(store, rank, key):
    """FASTCOMMS_SEED or a random seed, rank 0's, through the store: every rank draws the same
    geometries."""
    seed = int(os.environ.get("FASTCOMMS_SEED", "0")) or random.SystemRandom().randrange(1 << 30)
    if rank == 0:
        store.set(key, str(seed))
    store.wait([key])
    return int(store.get(key))


def _spawn(fn, size):
    """Runs fn(store, rank, size) on `size` processes, each with a torch.distributed gloo
    default group (the reference) over one FileStore."""
    spawn(_run, size, fn.__name__, timeout=200)


def _run(rank, size, path, errq, fn_name):
    import traceback

    _hang_guard()
    try:
        import torch.distributed as dist

        store = init_rank(rank, size, path)
        globals()[fn_name](dist.PrefixStore("fc", store), rank, size)
        dist.destroy_process_group()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def _nvlink_worker(store, rank, world):
    from fastcomms.ulysses import UlyssesGroup

    ngpu = torch.cuda.device_count()
    dev = torch.device("cuda", rank % ngpu)
    torch.cuda.set_device(dev)
    seed = _shared_seed(store, rank, "ulysses_gpu_seed")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    # over torch.distributed's default group: the NVLink setup goes through its store
    g = UlyssesGroup(None, device=dev, transport="nvlink")
    assert g.transport == "nvlink", g.transport_reason
    ref = UlyssesGroup(None)  # torch.distributed gloo: permute + all_to_all_single + permute
    assert ref.transport == "collective"
    checks = 0

    def check(out, x, mode, seq, heads, what):
        nonlocal checks
        want = _reference(ref, x, mode, seq, heads)
        assert _same_bytes(out, want), f"seed {seed}: {what} differs from torch.distributed"
        checks += 1

    for mode in (0, 1):
        for uneven in (False, True):
            for dtype in DTYPES:
                b, d, seq, heads = _geometry(rng, world, mode, uneven)
                x = _input(rank, mode, b, d, seq, heads, dtype, gen, dev)
                sp = dict(seq_splits=seq, head_splits=heads) if uneven else {}
                what = f"mode {mode} uneven {uneven} {dtype} b{b} d{d} seq {seq} heads {heads}"
                # out=None
                first = g.all_to_all_4d(x, mode=mode, **sp)
                check(first, x, mode, seq, heads, what + " out=None")
                # out= an ordinary tensor, poisoned first
                out = torch.empty_like(first)
                out.view(torch.uint8).fill_(0xA5)
                assert g.all_to_all_4d(x, mode=mode, out=out, **sp) is out
                check(out, x, mode, seq, heads, what + " out=tensor")
                # out= an empty_output buffer: zero copy, poisoned first
                zc = g.empty_output(x, mode=mode, **sp)
                zc.view(torch.uint8).fill_(0x5A)
                g.all_to_all_4d(x, mode=mode, out=zc, **sp)
                check(zc, x, mode, seq, heads, what + " out=empty_output")
                # async, plain and lent
                w = g.all_to_all_4d_async(x, mode=mode, **sp)
                check(w.wait(), x, mode, seq, heads, what + " async")
                w = g.all_to_all_4d_async(x, mode=mode, lend=True, **sp)
                check(w.wait(), x, mode, seq, heads, what + " async lend")
                # round trip
                back = g.all_to_all_4d(g.all_to_all_4d(x, mode=mode, **sp), mode=1 - mode, **sp)
                assert _same_bytes(back, x), f"seed {seed}: round trip {what}"
                checks += 1
    # 20 rounds on one window, a fresh input every round
    b, d, seq, heads = _geometry(rng, world, 0, False)
    for _ in range(20):
        x = _input(rank, 0, b, d, seq, heads, torch.bfloat16, gen, dev)
        check(g.all_to_all_4d(x), x, 0, seq, heads, "20 rounds")
    # lent buffers: the ring keeps the last LEND_RING results intact
    xs = [_input(rank, 0, b, d, seq, heads, torch.float32, gen, dev) for _ in range(g.LEND_RING)]
    lent = [g.all_to_all_4d_async(x, lend=True).wait() for x in xs]
    for x, out in zip(xs, lent, strict=True):
        check(out, x, 0, seq, heads, "lend ring")
    # a fifth live lent result raises (on every rank alike) instead of overwriting the oldest
    with pytest.raises(RuntimeError, match="windows all back live results"):
        g.all_to_all_4d_async(xs[0], lend=True)
    lent.pop(0)  # released: its window may be lent again, the other three stay intact
    again = g.all_to_all_4d_async(xs[0], lend=True).wait()
    check(again, xs[0], 0, seq, heads, "lend ring reuse")
    for x, out in zip(xs[1:], lent, strict=True):
        check(out, x, 0, seq, heads, "lend ring after reuse")
    del lent, again
    # the first use by an aten op waits like wait() (no host block on CUDA); clone keeps the
    # bytes (the random inputs hold NaN payloads that arithmetic would canonicalize)
    w = g.all_to_all_4d_async(xs[1])
    check(w.clone(), xs[1], 0, seq, heads, "async first use")
    # autograd on CUDA: backward is the other mode with the same splits
    x = _input(rank, 0, b, d, seq, heads, torch.float32, gen, dev).requires_grad_()
    y = g.all_to_all_4d(x)
    gy = torch.randn(y.shape, generator=gen).to(dev)
    (gx,) = torch.autograd.grad(y, x, gy)
    assert _same_bytes(
        gx, ref.all_to_all_4d(gy.cpu(), mode=1, seq_splits=seq, head_splits=heads)
    ), "backward"
    # CUDA graph: a captured call replays bit-exact on fresh data
    x = _input(rank, 0, b, d, seq, heads, torch.bfloat16, gen, dev)
    out = g.empty_output(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.all_to_all_4d(x, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.all_to_all_4d(x, out=out)
    for _ in range(3):
        x.copy_(_input(rank, 0, b, d, seq, heads, torch.bfloat16, gen, dev))
        out.view(torch.uint8).fill_(0xEE)
        graph.replay()
        torch.cuda.synchronize()
        check(out, x, 0, seq, heads, "graph replay")
    del graph
    g.check_errors()
    stats = g.memory_stats()
    assert stats["transport"] == "nvlink" and stats["device_bytes"] > 0, stats
    # validation: raised on every rank before any handshake
    with pytest.raises(ValueError, match="mode must be 0 or 1"):
        g.all_to_all_4d(x, mode=2)
    with pytest.raises(ValueError, match="4-D"):
        g.all_to_all_4d(x[0])
    with pytest.raises(ValueError, match="lend=True"):
        g.all_to_all_4d_async(x, out=out, lend=True)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):  # rows the path cannot push
        g.all_to_all_4d(torch.zeros(1, 2, 2 * world, 8, dtype=torch.uint8, device=dev))
    with pytest.raises(RuntimeError, match="out= is not differentiable"):
        g.all_to_all_4d(x.float().requires_grad_(), out=out)
    # the group still works after the rejections
    check(g.all_to_all_4d(x), x, 0, seq, heads, "after rejections")
    torch.cuda.synchronize()
    g.destroy()
    print(f"[rank {rank}] nvlink world {world}: {checks} checks bit-exact (seed {seed})")


@needs_cuda_build
@pytest.mark.parametrize("size", [2, 3])
def test_ulysses_nvlink_matches_torch_distributed(size):
    _spawn(_nvlink_worker, size)


def _collective_worker(store, rank, world):
    """The CUDA collective path on a nccl TorchComm, one GPU per rank."""
    import datetime

    import fastcomms
    from fastcomms.ulysses import UlyssesGroup

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    nccl = fastcomms.new_comm(
        "nccl", dev, store=store, name="uc", timeout=datetime.timedelta(seconds=60)
    )
    g = UlyssesGroup(nccl, transport="collective")
    ref = UlyssesGroup(None)
    rng = random.Random(1234)
    gen = torch.Generator().manual_seed(rank + 7)
    for mode in (0, 1):
        for uneven in (False, True):
            for dtype in DTYPES:
                b, d, seq, heads = _geometry(rng, world, mode, uneven)
                x = _input(rank, mode, b, d, seq, heads, dtype, gen, dev)
                sp = dict(seq_splits=seq, head_splits=heads) if uneven else {}
                want = _reference(ref, x, mode, seq, heads)
                out = g.all_to_all_4d(x, mode=mode, **sp)
                assert _same_bytes(out, want), (mode, uneven, dtype)
                w = g.all_to_all_4d_async(x, mode=mode, **sp)
                assert _same_bytes(w.wait(), want), ("async", mode, uneven, dtype)
    torch.cuda.synchronize()
    nccl.finalize()
    del g, nccl


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the nccl path needs one GPU per rank")
def test_ulysses_cuda_collective_matches_torch_distributed():
    _spawn(_collective_worker, 2)


def _overlap_worker(store, rank, world):
    """overlapping_barriers: an async call held back on the group's side stream and a sync call
    on the caller's stream are in flight together on unordered streams; they use separate
    windows and barriers, both come out bit-exact, and the sync call finished while the async one
    had not (a liveness check that they really overlapped)."""
    from fastcomms.ulysses import UlyssesGroup

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    g = UlyssesGroup(None, device=dev, transport="nvlink")
    ref = UlyssesGroup(None)
    gen = torch.Generator().manual_seed(rank + 99)
    seq, heads, b, d = [5] * world, [2] * world, 1, 64
    xa = _input(rank, 0, b, d, seq, heads, torch.bfloat16, gen, dev)
    xs = _input(rank, 0, b, d, seq, heads, torch.bfloat16, gen, dev)
    # create both groups and size both windows first: a window that grows synchronizes the
    # device, which would end the overlap before it began
    g.all_to_all_4d_async(xa).wait()
    g.all_to_all_4d(xs)
    torch.cuda.synchronize()
    g._astream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(g._astream):
        torch.cuda._sleep(200_000_000)  # ~100 ms: hold the async call back on its stream
    wa = g.all_to_all_4d_async(xa)  # enqueued behind the sleep on the side stream
    async_done = torch.cuda.Event()
    async_done.record(g._astream)
    ys = g.all_to_all_4d(xs)  # on the caller's stream, not ordered with the side stream
    sync_done = torch.cuda.Event()
    sync_done.record()
    sync_done.synchronize()
    overlapped = not async_done.query()
    ya = wa.wait()
    torch.cuda.synchronize()
    assert overlapped, f"rank {rank}: the async call finished before the sync one (no overlap)"
    assert _same_bytes(ys, _reference(ref, xs, 0, seq, heads)), "sync call next to an async one"
    assert _same_bytes(ya, _reference(ref, xa, 0, seq, heads)), "async call next to a sync one"

    # NOTE [eager-only members] on CUDA: in a compiled function the async form and out= (an
    # empty_output window, zero copy) run eagerly with the real group; the plain call is the op
    def step(t):
        a = g.all_to_all_4d_async(t)
        b = g.all_to_all_4d(t, out=g.empty_output(t))
        return a.wait(), b, g.all_to_all_4d(t) * 1

    want = _reference(ref, xs, 0, seq, heads)
    for got in torch.compile(step)(xs):
        assert _same_bytes(got, want), "compiled: the async form, out= and the op"
    g.destroy()


@needs_cuda_build
def test_ulysses_nvlink_sync_and_async_overlap():
    _spawn(_overlap_worker, 2)


def _subgroup_worker(store, rank, world):
    """subgroup: two groups partitioning the job ({0, 1} and {2, 3}) transfer concurrently, each
    bit-exact, without touching each other's windows."""
    import torch.distributed as dist
    from fastcomms.ulysses import UlyssesGroup

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = halves[rank // 2]
    g = UlyssesGroup(mine, device=dev, transport="nvlink")
    ref = UlyssesGroup(mine)
    sub_rank = dist.get_rank(mine)
    gen = torch.Generator().manual_seed(rank + 7)
    for i in range(10):
        seq, heads = [3 + i % 2, 4], [2, 1 + i % 3]
        x = _input(sub_rank, i % 2, 2, 32, seq, heads, torch.float16, gen, dev)
        y = g.all_to_all_4d(x, mode=i % 2, seq_splits=seq, head_splits=heads)
        assert _same_bytes(y, _reference(ref, x, i % 2, seq, heads)), f"subgroup call {i}"
    torch.cuda.synchronize()
    g.destroy()


@needs_cuda_build
def test_ulysses_nvlink_subgroups():
    _spawn(_subgroup_worker, 4)


def _gqa_worker(store, rank, world):
    """Grouped-query / multi-query calls (kv_replicas) on the NVLink transport (ranks round-robin
    on the GPUs there are) and, with one GPU per rank, the CUDA collective path (nccl): mode 0
    bit-exact against repeat_interleave + the ordinary call over gloo, mode 1 against the
    ordinary call + the replica sum, every engine, copying and zero copy (poisoned), async and
    lent, and the gradient against autograd through repeat_interleave."""
    import datetime

    import fastcomms
    from fastcomms.ulysses import UlyssesGroup

    ngpu = torch.cuda.device_count()
    dev = torch.device("cuda", rank % ngpu)
    torch.cuda.set_device(dev)
    seed = _shared_seed(store, rank, "gqa_seed")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    ref = UlyssesGroup(None)  # gloo on CPU copies
    groups = {"nvlink": UlyssesGroup(None, device=dev, transport="nvlink")}
    nccl = None
    if ngpu >= world:
        nccl = fastcomms.new_comm(
            "nccl", dev, store=store, name="gqa", timeout=datetime.timedelta(seconds=60)
        )
        groups["cuda collective"] = UlyssesGroup(nccl, transport="collective")
    checks = 0
    kvs = [world // h for h in range(1, world + 1) if world % h == 0 and h < world]
    for name, g in groups.items():
        engines = ["auto", "ce", "sm", "hybrid"] if name == "nvlink" else ["auto"]
        for kv in kvs:
            h = world // kv
            for mode in (0, 1):
                for engine in engines:
                    if name == "nvlink":
                        g._tune("engine", engine)
                    dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
                    b, d, s = rng.choice([1, 2]), rng.choice([64, 128]), rng.randint(1, 300)
                    uneven = rng.random() < 0.5
                    seq = [rng.randint(0, 300) for _ in range(world)] if uneven else [s] * world
                    seq[0] += 1 if uneven else 0
                    sp = dict(seq_splits=seq, head_splits=[1] * world) if uneven else {}
                    what = f"seed {seed} {name} {engine} kv {kv} mode {mode} {dtype} seq {seq}"
                    if mode == 0:
                        x = torch.randn(b, seq[rank], h, d, generator=gen).to(dtype)
                        rep = x.repeat_interleave(kv, dim=2)
                        want = ref.all_to_all_4d(
                            rep, mode=0, seq_splits=seq, head_splits=[1] * world
                        )
                    else:
                        x = torch.randn(b, sum(seq), 1, d, generator=gen).to(dtype)
                        full = ref.all_to_all_4d(
                            x, mode=1, seq_splits=seq, head_splits=[1] * world
                        ).to(dev)
                        want = full.unflatten(2, (h, kv)).sum(3)  # summed on the GPU, as ours
                    x = x.to(dev)
                    got = g.all_to_all_4d(x, mode=mode, kv_replicas=kv, **sp)
                    assert _same_bytes(got, want), what
                    out = g.empty_output(x, mode=mode, kv_replicas=kv, **sp)
                    out.view(torch.uint8).fill_(0xA5)
                    g.all_to_all_4d(x, mode=mode, kv_replicas=kv, out=out, **sp)
                    assert _same_bytes(out, want), what + " out=empty_output"
                    w = g.all_to_all_4d_async(x, mode=mode, kv_replicas=kv, **sp)
                    assert _same_bytes(w.wait(), want), what + " async"
                    if mode == 0 and name == "nvlink":
                        w = g.all_to_all_4d_async(x, kv_replicas=kv, lend=True, **sp)
                        assert _same_bytes(w.wait(), want), what + " lend"
                        del w
                    checks += 1
            # the gradient equals autograd through repeat_interleave, bit for bit
            x = torch.randn(2, 64, h, 128, generator=gen).to(dev).requires_grad_()
            y = g.all_to_all_4d(x, kv_replicas=kv)
            gy = torch.randn(y.shape, generator=gen).to(dev)
            (gx,) = torch.autograd.grad(y, x, gy)
            xr = x.detach().clone().requires_grad_()
            (gxr,) = torch.autograd.grad(g.all_to_all_4d(xr.repeat_interleave(kv, dim=2)), xr, gy)
            assert _same_bytes(gx, gxr), f"seed {seed} {name} kv {kv} gradient"
        if name == "nvlink":
            g._tune("engine", "auto")
            g.check_errors()
    torch.cuda.synchronize()
    for g in groups.values():
        g.destroy()
    if nccl is not None:
        nccl.finalize()
    print(f"[rank {rank}] gqa world {world}: {checks} checks bit-exact (seed {seed})")


@needs_cuda_build
@pytest.mark.parametrize("size", [2, 4])
def test_ulysses_gqa_matches_repeat_interleave(size):
    _spawn(_gqa_worker, size)


# -- ranks sharing one GPU as MPS clients (NOTE [shared GPU residency]) --------------------------
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def mps_daemon():
    """A private MPS daemon (tools/gpu/mps.sh) for the ranks this module spawns: its pipe folder
    in os.environ, which spawned ranks inherit, so their CUDA contexts are its clients."""
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("nvidia-cuda-mps-control is not on PATH (no CUDA MPS on this machine)")
    d = tempfile.mkdtemp(prefix="fastcomms-mps-test.")
    proc = subprocess.Popen(
        [os.path.join(REPO, "tools", "gpu", "mps.sh"), "sleep", "100000"],
        env={**os.environ, "FASTCOMMS_MPS_DIR": d},
    )
    env = {
        **os.environ,
        "CUDA_MPS_PIPE_DIRECTORY": os.path.join(d, "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": os.path.join(d, "log"),
    }

    def answers():  # the daemon takes commands on its pipe folder once it is up
        try:
            r = subprocess.run(
                ["nvidia-cuda-mps-control"],
                input="get_server_list\n",
                env=env,
                capture_output=True,
                text=True,
                timeout=5,
            )
        except subprocess.TimeoutExpired:
            return False
        return r.returncode == 0

    deadline = time.monotonic() + 30
    while not answers():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the MPS daemon did not start (mps.sh exit code {proc.poll()})")
        time.sleep(0.2)
    saved = {k: os.environ.get(k) for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")}
    os.environ.update({k: env[k] for k in saved})
    try:
        yield d
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()  # mps.sh ends its clients and the daemon, then removes the folder
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _shared_gpu_worker(store, rank, world):
    """Every rank on GPU 0, as MPS clients running side by side: calls large enough that the
    flagged and the fused kernel would each fill the GPU (one block per SM at 512 threads), plus
    the barrier-kernel path, kv replicas and an async call in flight beside a sync one, each
    bit-exact against torch.distributed. Before the residency cap the first such call hung (2
    ranks) or ended in an illegal address after a peer gave up (4 ranks)."""
    from fastcomms.ulysses import UlyssesGroup

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    seed = _shared_seed(store, rank, "shared_gpu_seed")
    gen = torch.Generator().manual_seed(seed * 17 + rank)
    g = UlyssesGroup(None, device=dev, transport="nvlink")
    assert g.transport == "nvlink", g.transport_reason
    ref = UlyssesGroup(None)
    checks = 0
    # per-peer bytes s * 512 at 2 heads per peer, bf16, d=128: 0.5 MiB (flagged path), 1.5 MiB
    # (fused), 4 MiB (barrier kernel + copies); and one KV head sent to every rank
    cases = [(s, 2 * world, 1) for s in (1024, 3072, 8192)] + [(s, 1, world) for s in (2048, 6144)]
    for s, h, kv in cases:
        x = _rand((1, s, h, 128), torch.bfloat16, gen).to(dev)
        src = x.repeat_interleave(kv, dim=2) if kv > 1 else x
        want = _reference(ref, src, 0, None, None)
        what = f"seed {seed}: (1,{s},{h},128) kv_replicas={kv}"
        got = g.all_to_all_4d(x, kv_replicas=kv)
        assert _same_bytes(got, want), what + " copy"
        z = g.empty_output(x, kv_replicas=kv)
        z.view(torch.uint8).fill_(0xA5)
        g.all_to_all_4d(x, kv_replicas=kv, out=z)
        assert _same_bytes(z, want), what + " zero copy"
        w = g.all_to_all_4d_async(x, kv_replicas=kv)  # in flight while the sync call runs
        again = g.all_to_all_4d(x, kv_replicas=kv)
        assert _same_bytes(w.wait(), want), what + " async beside a sync call"
        assert _same_bytes(again, want), what + " sync beside an async call"
        checks += 4
    torch.cuda.synchronize()
    g.destroy()
    print(f"[rank {rank}] {world} ranks on GPU 0 as MPS clients: {checks} checks bit-exact")


@needs_cuda_build
@pytest.mark.parametrize("size", [2, 4])
def test_ulysses_nvlink_ranks_sharing_a_gpu_as_mps_clients(mps_daemon, size):
    _spawn(_shared_gpu_worker, size)


# -- the hierarchical transport on one GPU (issue 37, NOTE [hierarchical split]) -----------------
def _hierarchical_worker(store, rank, world, hosts_of=None):
    """4 ranks on GPU 0 as MPS clients, split into 2 "hosts" by FASTCOMMS_HOST_ID: each host's
    pair over the NVLink engine, the hosts over torch's gloo group (CUDA tensors through
    alltoall_base). Bit-exact against the flat reference for both modes, even and uneven splits,
    dtypes, kv_replicas, zero copy, async, autograd; then the armed control (the exchange between
    hosts left out) must leave poison in the other host's blocks, every run."""
    from fastcomms.ulysses import UlyssesGroup

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    os.environ["FASTCOMMS_HOST_ID"] = f"gpu-host-{rank // 2}"
    seed = _shared_seed(store, rank, "hier_seed")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    g = UlyssesGroup(None, device=dev)
    assert g.transport == "hierarchical", g.transport_reason
    ref = UlyssesGroup(None)  # torch.distributed gloo on CPU copies: the flat path
    checks = 0
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int8):
        for mode in (0, 1):
            for uneven in (False, True):
                b, d, seq, heads = _geometry(rng, world, mode, uneven)
                x = _input(rank, mode, b, d, seq, heads, dtype, gen, dev)
                kw = {"seq_splits": seq, "head_splits": heads} if uneven else {}
                want = _reference(ref, x, mode, seq if uneven else None, heads if uneven else None)
                what = f"seed {seed} {dtype} mode {mode} b {b} d {d} seq {seq} heads {heads}"
                got = g.all_to_all_4d(x, mode=mode, **kw)
                assert _same_bytes(got, want), what
                z = g.empty_output(x, mode=mode, **kw)
                z.view(torch.uint8).fill_(0xA5)
                g.all_to_all_4d(x, mode=mode, out=z, **kw)
                assert _same_bytes(z, want), what + " zero copy"
                w = g.all_to_all_4d_async(x, mode=mode, **kw)
                again = g.all_to_all_4d(x, mode=mode, **kw)
                assert _same_bytes(w.wait(), want), what + " async beside a sync call"
                assert _same_bytes(again, want), what + " sync beside an async call"
                checks += 4
    # GQA: one KV head per pair of ranks, and the gradient through it
    x = _rand((1, 64, 2, 64), torch.float32, gen).normal_().to(dev)
    want = _reference(ref, x.repeat_interleave(2, dim=2), 0, None, None)
    assert _same_bytes(g.all_to_all_4d(x, kv_replicas=2), want), f"seed {seed} kv_replicas"
    xa = x.clone().requires_grad_()
    wgt = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed)).to(dev)
    (g.all_to_all_4d(xa, kv_replicas=2) * wgt).sum().backward()
    xb = x.cpu().requires_grad_()
    (ref.all_to_all_4d(xb, kv_replicas=2) * wgt.cpu()).sum().backward()
    assert _same_bytes(xa.grad, xb.grad), f"seed {seed} kv_replicas backward"
    checks += 2
    # the armed control
    x = _rand((1, 32, 2 * world, 64), torch.bfloat16, gen).to(dev)
    want = _reference(ref, x, 0, None, None)
    g._tune("fault", "skip_remote")
    out = torch.full(tuple(want.shape), float("nan"), dtype=torch.bfloat16, device=dev)
    g.all_to_all_4d(x, out=out)
    torch.cuda.synchronize()
    g._tune("fault", "none")
    assert not _same_bytes(out, want), "armed control matched: the test could not fail"
    for q in range(world):
        block = out[:, 32 * q : 32 * q + 32].cpu()
        if q // 2 == rank // 2:
            assert _same_bytes(block, want[:, 32 * q : 32 * q + 32]), f"control: local block {q}"
        else:
            assert block.isnan().all(), f"control: block {q} from the other host was written"
    assert _same_bytes(g.all_to_all_4d(x), want), "after the control"
    torch.cuda.synchronize()
    g.destroy()
    print(f"[rank {rank}] hierarchical, 2 hosts x 2 ranks on GPU 0: {checks} checks bit-exact")


@needs_cuda_build
def test_hierarchical_two_hosts_on_one_gpu_as_mps_clients(mps_daemon):
    _spawn(_hierarchical_worker, 4)


# -- FP8 on the wire fused into the NVLink transfer (issue 38, NOTE [fp8 fused push]) ------------
def _fp8_reference(ref, x, wire, mode, seq, heads, kv):
    """quantize (torch reference) -> the flat exchange of the FP8 bytes and of the scales (gloo,
    CPU copies) -> (FP8 rows, scales), for mode 0 with kv replicas or any mode without."""
    import fp8_reference as _fp8

    q, s = _fp8.quantize_reference(x.detach().cpu(), wire)
    kw = {"seq_splits": seq, "head_splits": heads} if seq is not None else {}
    qo = ref.all_to_all_4d(q.view(torch.uint8), mode=mode, kv_replicas=kv, **kw).view(wire)
    so = ref.all_to_all_4d(s.unsqueeze(-1), mode=mode, kv_replicas=kv, **kw)[..., 0]
    return qo, so.contiguous()


def _fp8_fused_worker(store, rank, world):
    """Ranks on GPU 0 as MPS clients over the NVLink transport: all_to_all_4d(x, wire_dtype=...)
    takes the fused path (one call, one epoch: the unfused path makes two) and is bit-exact against
    quantize -> exchange -> dequantize of the torch reference, for float16/bfloat16/float32 x, both
    FP8 formats, both modes, even and uneven splits and kv_replicas, dequantized, into out= and
    with return_scales; then the armed control (a reference scale perturbed) must differ."""
    import fp8_reference as _fp8
    from fastcomms.ulysses import UlyssesGroup

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    seed = _shared_seed(store, rank, "fp8_fused_seed")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    g = UlyssesGroup(None, device=dev, transport="nvlink")
    ref = UlyssesGroup(None)
    checks = 0
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for wire in (torch.float8_e4m3fn, torch.float8_e5m2):
            for mode in (0, 1):
                for uneven in (False, True):
                    b, d, seq, heads = _geometry(rng, world, mode, uneven)
                    d = 16 * rng.randint(1, 8)
                    shape = (
                        (b, seq[rank], sum(heads), d)
                        if mode == 0
                        else (b, sum(seq), heads[rank], d)
                    )
                    scale = 10.0 ** rng.randint(-3, 3)
                    x = (torch.randn(shape, generator=gen) * scale).to(dev, dtype)
                    sp, hp = (seq, heads) if uneven else (None, None)
                    kw = {"seq_splits": seq, "head_splits": heads} if uneven else {}
                    qo, so = _fp8_reference(ref, x, wire, mode, sp, hp, 1)
                    want = _fp8.dequantize_reference(qo, so, dtype)
                    what = f"seed {seed} {dtype} {wire} mode {mode} b {b} d {d} {seq} {heads}"
                    before = g.memory_stats()["calls"]
                    got = g.all_to_all_4d(x, mode=mode, wire_dtype=wire, **kw)
                    assert g.memory_stats()["calls"] - before == 1, what + ": not the fused path"
                    assert _same_bytes(got, want), what
                    out = torch.full(tuple(want.shape), float("nan"), dtype=dtype, device=dev)
                    g.all_to_all_4d(x, mode=mode, wire_dtype=wire, out=out, **kw)
                    assert _same_bytes(out, want), what + " out="
                    gq, gs = g.all_to_all_4d(
                        x, mode=mode, wire_dtype=wire, return_scales=True, **kw
                    )
                    assert _same_bytes(gq, qo) and _same_bytes(gs, so), what + " return_scales"
                    lent = g.all_to_all_4d_async(x, mode=mode, wire_dtype=wire, lend=True, **kw)
                    assert _same_bytes(lent.wait(), want), what + " async, lent"
                    del lent
                    checks += 4
    # GQA: one K/V head to every rank, mode 0
    x = torch.randn((1, 48, 1, 64), generator=gen).to(dev, torch.bfloat16)
    qo, so = _fp8_reference(ref, x, torch.float8_e4m3fn, 0, None, None, world)
    want = _fp8.dequantize_reference(qo, so, torch.bfloat16)
    got = g.all_to_all_4d(x, wire_dtype=torch.float8_e4m3fn, kv_replicas=world)
    assert _same_bytes(got, want), f"seed {seed} kv_replicas={world}"
    # the armed control: one row's scale of the reference doubled must show (one float32 ulp
    # would not: the bfloat16 output rounds it away)
    bad = so.clone()
    bad[0, 0, 0] *= 2
    assert not _same_bytes(
        got, _fp8.dequantize_reference(qo, bad, torch.bfloat16)
    ), "armed control: a perturbed scale went unnoticed"
    checks += 2
    # torch.compile(fullgraph=True): the op of NOTE [fp8 wire exchange], the fused path inside it;
    # forward and the FP8 backward as eager
    x = torch.randn((1, 16, 2 * world, 32), generator=gen).to(dev).requires_grad_(True)
    kw = {"wire_dtype": torch.float8_e4m3fn, "grad_wire_dtype": torch.float8_e5m2}
    compiled = torch.compile(lambda t: g.all_to_all_4d(t, **kw), fullgraph=True)
    got, want = compiled(x), g.all_to_all_4d(x, **kw)
    gy = torch.randn(tuple(want.shape), generator=gen).to(dev)
    assert _same_bytes(got, want), f"seed {seed} compiled"
    (g_got,) = torch.autograd.grad(got, x, gy)
    (g_want,) = torch.autograd.grad(want, x, gy)
    assert _same_bytes(g_got, g_want), f"seed {seed} compiled backward"
    checks += 2
    torch.cuda.synchronize()
    g.destroy()
    print(f"[rank {rank}] fp8 fused, {world} ranks on GPU 0: {checks} checks bit-exact")


@needs_cuda_build
@pytest.mark.parametrize("size", [2, 3])
def test_fp8_wire_fused_into_the_nvlink_transfer(mps_daemon, size):
    _spawn(_fp8_fused_worker, size)
