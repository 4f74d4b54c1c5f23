# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""GPU tier of fastcomms.moe (issue 53): the collective path on CUDA tensors over NCCL (a
fastcomms nccl communicator and torch's NCCL default group), every result bit-exact against the
same calls on CPU over a torch gloo process group of the same ranks (which test_moe.py holds to a
torch.distributed.all_to_all_single reference): rows, counts, offsets, weights, sources, FP8 rows
and scales (the CUDA quantize kernel against the host code), the combine; async forms;
gradients; the refusals; and the example's training on CUDA against its one-process losses.

One GPU: a world of one (every expert local; the CUDA code of the path). Two or more GPUs: worlds
of 2, 4 and 8 where there are that many (NCCL refuses two ranks on one GPU, so the MPS route of
test_ulysses_gpu.py does not apply to the collective path). Groups over the fastcomms nccl
communicator take the device transport (its ranks share a host); torch's NCCL group keeps the
collective one: both are checked against gloo here. The device transport's own tier (no host
sync, CUDA graphs, MPS ranks on one GPU) is test_moe_device_gpu.py."""

import datetime
import os
import traceback

import pytest
import torch
from conftest import _hang_guard, init_rank, spawn

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the GPU tier runs in scripts/gpu.sh)"
)


def _compare(cpu_ep, gpu_ep, case, rank, size, T, k, dtype, mode, wire=None, async_op=False):
    from test_moe import _expert_fn, _inputs, _same

    E, H = cpu_ep.num_experts, cpu_ep.hidden
    x, idx, w = _inputs(case, rank, T, k, E, H, dtype, mode)
    dev = gpu_ep.device
    got = {}
    for name, ep, d in (("cpu", cpu_ep, "cpu"), ("gpu", gpu_ep, dev)):
        xs, ids, ws = x.to(d), idx.to(d), w.to(d)
        if async_op:
            recv_x, meta, handle = ep.dispatch(xs, ids, ws, wire_dtype=wire, async_op=True).wait()
        else:
            recv_x, meta, handle = ep.dispatch(xs, ids, ws, wire_dtype=wire)
        y = _expert_fn(recv_x.cpu(), meta.offsets.cpu(), list(ep.local_experts), dtype).to(d)
        out = ep.combine(y, handle, async_op=async_op)
        out = out.wait() if async_op else out
        got[name] = [t.cpu() for t in (recv_x, meta.counts, meta.offsets, meta.weights, meta.src)]
        got[name].append(out.cpu())
    n = int(got["cpu"][2][-1])
    where = f"[rank {rank}/{size}] case {case} ({mode}, k={k}, {dtype}, wire={wire})"
    a, b = got["cpu"], got["gpu"]
    assert _same(a[0][:n], b[0][:n]), where
    for i in range(1, 6):
        assert _same(a[i], b[i]), (where, i)
    if wire is not None:  # kept FP8: rows and scales from the CUDA kernel, bit for bit
        fp8 = []
        for ep, d in ((cpu_ep, "cpu"), (gpu_ep, dev)):
            q, meta, _ = ep.dispatch(
                x.to(d), idx.to(d), w.to(d), wire_dtype=wire, return_scales=True
            )
            fp8.append((q.cpu(), meta.scales.cpu()))
        assert _same(fp8[0][0][:n], fp8[1][0][:n]) and _same(fp8[0][1][:n], fp8[1][1][:n]), where
    return 1


def _grads(cpu_ep, gpu_ep, rank):
    """Gradients of x and topk_weights through dispatch, a row-wise expert and combine: CPU and
    CUDA agree (float64)."""
    from test_moe import _inputs

    E, H = cpu_ep.num_experts, cpu_ep.hidden
    x, idx, w = _inputs(5, rank, 6, 2, E, H, torch.float64, "drops")
    out = []
    for ep, d in ((cpu_ep, "cpu"), (gpu_ep, gpu_ep.device)):
        xs = x.detach().to(d).requires_grad_()
        ws = w.detach().to(d).requires_grad_()
        recv_x, meta, handle = ep.dispatch(xs, idx.to(d), ws)
        y = recv_x * (1 + meta.weights).unsqueeze(1).to(recv_x.dtype) * 3
        ep.combine(y, handle).pow(2).sum().backward()
        out.append((xs.grad.cpu(), ws.grad.cpu()))
    for a, b in zip(out[0], out[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    return 1


def _worker(rank, size, path, errq):
    _hang_guard()
    try:
        import fastcomms
        import torch.distributed as dist
        from fastcomms.moe import ExpertParallelGroup

        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        store = init_rank(rank, size, path, "nccl", device_id=dev)
        t = datetime.timedelta(seconds=60)
        nccl = fastcomms.new_comm(
            "nccl", dev, "moe", store=dist.PrefixStore("fc", store), timeout=t
        )
        # torch's own gloo group: the GPU machine's build has no fastcomms gloo backend
        gloo = dist.new_group(backend="gloo")
        E, H, checks = 8, 64, 0
        bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
        for dt in (bf16, f16, f32):
            kw = dict(max_tokens_per_rank=64, dtype=dt)
            cpu_ep = ExpertParallelGroup(gloo, E, H, **kw)
            for gpu_ep in (
                ExpertParallelGroup(nccl, E, H, **kw),
                ExpertParallelGroup(None, E, H, **kw),
            ):
                # the fastcomms nccl communicator of ranks on one host takes the device
                # transport (test_moe_device_gpu.py), torch's NCCL group the collective one
                # (or the collective one where the device all-to-all-v's setup refused: it says so)
                ours = isinstance(gpu_ep.group, fastcomms.TorchComm)
                device_on = os.environ.get("FASTCOMMS_MOE_DEVICE", "1") != "0"  # the default
                want = (
                    "device"
                    if ours and device_on and "refused" not in gpu_ep.transport_reason
                    else "collective"
                )
                assert gpu_ep.device == dev and gpu_ep.transport == want, gpu_ep.transport_reason
                for k, mode in ((1, "uniform"), (2, "skew"), (4, "drops"), (8, "uniform")):
                    T = 0 if (rank == size - 1 and k == 4) else 40 + rank
                    checks += _compare(cpu_ep, gpu_ep, 10 * k, rank, size, T, k, dt, mode)
                checks += _compare(cpu_ep, gpu_ep, 90, rank, size, 33, 2, dt, "skew", async_op=True)
                for wire in (torch.float8_e4m3fn, torch.float8_e5m2):
                    checks += _compare(cpu_ep, gpu_ep, 91, rank, size, 37, 3, dt, "drops", wire)
        kw = dict(max_tokens_per_rank=64, dtype=torch.float64)
        checks += _grads(
            ExpertParallelGroup(gloo, E, H, **kw), ExpertParallelGroup(nccl, E, H, **kw), rank
        )
        # a refusal on CUDA raises on every rank, and the group works after it
        ep = ExpertParallelGroup(None, E, H, max_tokens_per_rank=4, dtype=f32)
        n = 7 if rank == 0 else 4
        with pytest.raises(
            ValueError, match=r"rank 0 dispatches 7 tokens, more than max_tokens_per_rank=4"
        ):
            ep.dispatch(
                torch.ones(n, H, device=dev), torch.zeros(n, 1, dtype=torch.long, device=dev)
            )
        # the device transport: an empty dispatch everywhere, raised by check_errors()
        dev_ep = ExpertParallelGroup(nccl, E, H, max_tokens_per_rank=4, dtype=f32)
        try:
            recv_x, meta, handle = dev_ep.dispatch(
                torch.ones(n, H, device=dev), torch.zeros(n, 1, dtype=torch.long, device=dev)
            )
        except ValueError:
            assert dev_ep.transport == "collective"  # that one raises at the call
        if dev_ep.transport == "device":
            assert int(meta.counts.sum()) == 0
            with pytest.raises(
                ValueError, match=r"rank 0 dispatches 7 tokens, more than max_tokens_per_rank=4"
            ):
                dev_ep.check_errors()
        x = torch.randn(4, H, device=dev)
        recv_x, meta, handle = ep.dispatch(x, torch.zeros(4, 1, dtype=torch.long, device=dev))
        assert torch.equal(ep.combine(recv_x, handle), x)
        # the example on CUDA
        from test_moe import _example

        losses, ref = _example().train(nccl, steps=3, experts=8, topk=2)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-4, atol=1e-5)
        print(f"[rank {rank}/{size}] moe gpu: {checks} checks bit-exact vs gloo; example {losses}")
        nccl.finalize()
        dist.destroy_process_group()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_moe_gpu(size):
    if torch.cuda.device_count() < size:
        pytest.skip(
            f"needs {size} GPUs, {torch.cuda.device_count()} here (NCCL refuses two ranks on one "
            "GPU)"
        )
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    spawn(_worker, size, timeout=300)
