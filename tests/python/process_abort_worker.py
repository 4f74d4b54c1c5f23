# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""One rank of test_process_abort.py: python process_abort_worker.py BACKEND RANK SIZE STORE
HOOK MARKER SYNC. Rank 0 makes a communicator with abort_process_on_timeout_or_error=True (unless
HOOK is "off") and a 1 s timeout, registers an abort hook (HOOK "write": writes MARKER; "block":
writes MARKER, then blocks forever), and issues an all_reduce that cannot finish in time: on gloo
the other ranks never join it, on a CUDA backend (world 1) the stream is held by a sleep kernel
for 30 s. SYNC "async" issues it with async_op=True and waits on its work. Other ranks make the
communicator and wait, then leave without finalizing."""

import datetime
import os
import sys
import threading
import time


def main():
    backend, rank, size, store_path, hook, marker, sync = sys.argv[1:8]
    rank, size = int(rank), int(size)
    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
    import fastcomms
    import torch
    import torch.distributed as dist

    cuda = backend != "gloo"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    from conftest import meet  # (this file's folder is the script's, first on sys.path)

    store = dist.FileStore(store_path, size)
    meet(store, size)  # the 1 s timeout also bounds new_comm's rendezvous
    comm = fastcomms.new_comm(
        backend,
        dev,
        "abort",
        abort_process_on_timeout_or_error=hook != "off",
        timeout=datetime.timedelta(seconds=1),
        store=store,
    )
    if rank != 0:
        time.sleep(20)  # never joins the op; rank 0 aborts meanwhile
        os._exit(0)

    def on_abort():
        with open(marker, "w") as f:
            f.write(f"abort hook ran on {threading.current_thread().name}\n")
        if hook == "block":
            threading.Event().wait()  # a hook that never returns must not stop the abort

    comm.register_abort_hook(on_abort)
    t = torch.ones(1024, device=dev)
    if cuda:
        torch.cuda._sleep(int(30 * 2e9))  # about 30 s of the stream at 2 GHz
    try:
        if sync == "async":
            comm.all_reduce(t, fastcomms.ReduceOp.SUM, True).wait()
        else:
            comm.all_reduce(t, fastcomms.ReduceOp.SUM, False)
        if cuda:
            torch.cuda.synchronize()
    except TimeoutError as e:
        print(f"raised TimeoutError: {e}", flush=True)
        os._exit(3)
    print("the op returned", flush=True)
    os._exit(4)


if __name__ == "__main__":
    main()
