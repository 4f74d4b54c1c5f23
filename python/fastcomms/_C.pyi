"""
fastcomms C++ core (internal; use the fastcomms package)
"""
from __future__ import annotations
import builtins
import collections.abc
import datetime
import torch
import torch._C._distributed_c10d
import torch.distributed.distributed_c10d
import typing
__all__: list[str] = ['AbortedError', 'AllGatherP', 'BackendError', 'Clog', 'Comm', 'FlightRecorder', 'ForwardingBackend', 'NanCheck', 'RedOpType', 'StoreWindow', 'TimeoutError', 'TypeError', 'UlyssesAsync', 'UlyssesTransport', 'UnsupportedError', 'ValueError', 'Window', 'Work', 'WorkStatus', 'arm_device_faults', 'build_info', 'built_backends', 'deregister_local_buffer', 'device_window', 'device_window_layout', 'has_transport', 'host_name', 'is_backend_built', 'make_backend', 'nvlink_decision', 'nvlink_matrix', 'process_group_transport', 'register_local_buffer', 'select_transport', 'store_window', 'ulysses_all_to_all_4d', 'ulysses_all_to_all_4d_fp8', 'ulysses_all_to_all_4d_fp8_out', 'ulysses_all_to_all_4d_out', 'ulysses_geometry', 'ulysses_shapes']
class AbortedError(RuntimeError):
    pass
class BackendError(RuntimeError):
    pass
class UnsupportedError(RuntimeError):
    pass
class RedOpType:
    """
    Members:
    
      SUM
    
      PRODUCT
    
      MIN
    
      MAX
    
      BAND
    
      BOR
    
      BXOR
    
      AVG
    
      PREMUL_SUM
    """
    AVG: typing.ClassVar[RedOpType]
    BAND: typing.ClassVar[RedOpType]
    BOR: typing.ClassVar[RedOpType]
    BXOR: typing.ClassVar[RedOpType]
    MAX: typing.ClassVar[RedOpType]
    MIN: typing.ClassVar[RedOpType]
    PREMUL_SUM: typing.ClassVar[RedOpType]
    PRODUCT: typing.ClassVar[RedOpType]
    SUM: typing.ClassVar[RedOpType]
    __members__: typing.ClassVar[dict[str, RedOpType]]
    def __eq__(self, other: typing.Any) -> bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt) -> None:
        ...
    def __int__(self) -> int:
        ...
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class WorkStatus:
    """
    Members:
    
      NOT_STARTED
    
      INPROGRESS
    
      COMPLETED
    
      TIMEDOUT
    
      ERROR
    """
    COMPLETED: typing.ClassVar[WorkStatus]
    ERROR: typing.ClassVar[WorkStatus]
    INPROGRESS: typing.ClassVar[WorkStatus]
    NOT_STARTED: typing.ClassVar[WorkStatus]
    TIMEDOUT: typing.ClassVar[WorkStatus]
    __members__: typing.ClassVar[dict[str, WorkStatus]]
    def __eq__(self, other: typing.Any) -> bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt) -> None:
        ...
    def __int__(self) -> int:
        ...
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class Work:
    def _set_status(self, arg0: WorkStatus) -> bool:
        ...
    def _tensors_released(self) -> bool:
        ...
    def is_completed(self) -> bool:
        ...
    def status(self) -> WorkStatus:
        ...
    def wait(self) -> None:
        ...
class AllGatherP:
    def freed(self) -> bool:
        ...
    def output(self) -> torch.Tensor:
        ...
    def registered(self) -> bool:
        ...
class Comm:
    @staticmethod
    def over_python_backend(arg0: typing.Any, arg1: str, arg2: typing.Any, arg3: str, arg4: typing.SupportsInt, arg5: typing.Any) -> Comm:
        ...
    def __init__(self, arg0: str, arg1: typing.SupportsInt, arg2: typing.SupportsInt, arg3: str, arg4: typing.SupportsInt, arg5: typing.Any, arg6: datetime.timedelta, arg7: bool, arg8: str, arg9: collections.abc.Mapping[str, str]) -> None:
        ...
    def abort(self) -> None:
        ...
    def all_gather(self, arg0: collections.abc.Sequence[torch.Tensor], arg1: torch.Tensor, arg2: bool, arg3: bool, arg4: datetime.timedelta | None, arg5: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def all_gather_p_exec(self, arg0: AllGatherP, arg1: torch.Tensor, arg2: bool, arg3: datetime.timedelta | None, arg4: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def all_gather_p_free(self, arg0: AllGatherP) -> None:
        ...
    def all_gather_p_init(self, arg0: torch.Tensor, arg1: datetime.timedelta | None, arg2: collections.abc.Mapping[str, str] | None) -> AllGatherP:
        ...
    def all_gather_single(self, arg0: torch.Tensor, arg1: torch.Tensor, arg2: bool, arg3: datetime.timedelta | None, arg4: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def all_reduce(self, arg0: torch.Tensor, arg1: RedOpType, arg2: typing.SupportsFloat | torch.Tensor, arg3: bool, arg4: datetime.timedelta | None, arg5: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def all_to_all(self, arg0: collections.abc.Sequence[torch.Tensor], arg1: collections.abc.Sequence[torch.Tensor], arg2: bool, arg3: datetime.timedelta | None, arg4: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def all_to_all_single(self, arg0: torch.Tensor, arg1: torch.Tensor, arg2: bool, arg3: datetime.timedelta | None, arg4: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def all_to_all_v_single(self, arg0: torch.Tensor, arg1: torch.Tensor, arg2: collections.abc.Sequence[typing.SupportsInt], arg3: collections.abc.Sequence[typing.SupportsInt], arg4: bool, arg5: datetime.timedelta | None, arg6: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def backend(self) -> str:
        ...
    def backend_version(self) -> str:
        ...
    def barrier(self, arg0: bool, arg1: datetime.timedelta | None, arg2: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def batch(self, arg0: collections.abc.Sequence[tuple[bool, torch.Tensor, typing.SupportsInt]], arg1: bool, arg2: datetime.timedelta | None, arg3: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def broadcast(self, arg0: torch.Tensor, arg1: typing.SupportsInt, arg2: bool, arg3: datetime.timedelta | None, arg4: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def device_alltoallv_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: torch.Tensor, input_split_sizes: torch.Tensor, async_op: bool) -> typing.Any:
        """
        torchcomms' device_alltoallv_single: split sizes are int64 CUDA tensors (rows of dim 0), never read by the host
        """
    def finalize(self) -> None:
        ...
    def gather(self, arg0: collections.abc.Sequence[torch.Tensor], arg1: torch.Tensor, arg2: typing.SupportsInt, arg3: bool, arg4: datetime.timedelta | None, arg5: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def gather_single(self, arg0: torch.Tensor, arg1: torch.Tensor, arg2: typing.SupportsInt, arg3: bool, arg4: datetime.timedelta | None, arg5: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def get_nccl_comm_ptr(self) -> int:
        ...
    def hints(self) -> dict[str, str]:
        ...
    def is_aborted(self) -> bool:
        ...
    def name(self) -> str:
        ...
    def new_window(self) -> Window:
        ...
    def python_backend(self) -> typing.Any:
        ...
    def rank(self) -> int:
        ...
    def recv(self, arg0: torch.Tensor, arg1: typing.SupportsInt, arg2: bool, arg3: datetime.timedelta | None, arg4: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def reduce(self, arg0: torch.Tensor, arg1: typing.SupportsInt, arg2: RedOpType, arg3: typing.SupportsFloat | torch.Tensor, arg4: bool, arg5: datetime.timedelta | None, arg6: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def reduce_scatter(self, arg0: torch.Tensor, arg1: collections.abc.Sequence[torch.Tensor], arg2: RedOpType, arg3: typing.SupportsFloat | torch.Tensor, arg4: bool, arg5: bool, arg6: datetime.timedelta | None, arg7: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def reduce_scatter_single(self, arg0: torch.Tensor, arg1: torch.Tensor, arg2: RedOpType, arg3: typing.SupportsFloat | torch.Tensor, arg4: bool, arg5: datetime.timedelta | None, arg6: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def register_abort_hook(self, arg0: collections.abc.Callable) -> collections.abc.Callable:
        ...
    def register_post_hook(self, fn: collections.abc.Callable, fast: bool = False) -> collections.abc.Callable:
        """
        fn(name, op_id, async_op), and with `fast` whether it is a fast-path op.
        """
    def register_pre_hook(self, fn: collections.abc.Callable, fast: bool = False) -> collections.abc.Callable:
        """
        fn(name, op_id, async_op), and with `fast` a fast-path op's arguments or None (NOTE [hooks on the fast path]).
        """
    def scatter(self, arg0: torch.Tensor, arg1: collections.abc.Sequence[torch.Tensor], arg2: typing.SupportsInt, arg3: bool, arg4: datetime.timedelta | None, arg5: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def select_transport(self, arg0: str, arg1: bool) -> tuple:
        ...
    def send(self, arg0: torch.Tensor, arg1: typing.SupportsInt, arg2: bool, arg3: datetime.timedelta | None, arg4: collections.abc.Mapping[str, str] | None) -> Work:
        ...
    def set_hints(self, arg0: collections.abc.Mapping[str, str]) -> None:
        ...
    def set_timeout(self, arg0: datetime.timedelta) -> None:
        ...
    def size(self) -> int:
        ...
    def split(self, arg0: collections.abc.Sequence[typing.SupportsInt], arg1: str, arg2: datetime.timedelta | None, arg3: collections.abc.Mapping[str, str] | None) -> Comm | None:
        ...
    def supports_window(self) -> bool:
        ...
    def tensor_deregister(self, arg0: torch.Tensor) -> None:
        ...
    def tensor_register(self, arg0: torch.Tensor) -> None:
        ...
    def timeout(self) -> datetime.timedelta:
        ...
class FlightRecorder:
    """
    NOTE [flight recorder in C++]; fastcomms.hooks wraps it.
    """
    def __init__(self, max_entries: typing.SupportsInt, isolated: bool) -> None:
        ...
    def attach(self, arg0: Comm, arg1: collections.abc.Callable) -> None:
        """
        Records the communicator's ops (and its splits'); dump(rank) at an abort or timeout.
        """
    def detach(self) -> None:
        ...
    def enabled(self) -> bool:
        ...
    def entries(self, arg0: bool) -> list:
        ...
    def groups(self) -> list:
        ...
    def reset(self) -> None:
        ...
    def size(self) -> int:
        ...
class Clog:
    """
    NOTE [clog]; fastcomms.hooks.clog wraps it.
    """
    def __init__(self, path: str, start: bool, end: bool, waited: bool, buffers: bool) -> None:
        ...
    def attach(self, arg0: Comm) -> None:
        """
        Logs the communicator's ops from now on (writes its new_comm line).
        """
    def close(self) -> None:
        ...
    def detach(self) -> None:
        ...
class NanCheck:
    """
    NOTE [NaN check on the device]; fastcomms.hooks.NanCheckHook wraps it.
    """
    def __init__(self, check_inputs: bool, check_outputs: bool) -> None:
        ...
    def attach(self, arg0: Comm) -> None:
        ...
    def check_pending(self) -> None:
        """
        Raises for a NaN a completed device check found.
        """
    def detach(self) -> None:
        ...
    def pending(self) -> int:
        """
        Device checks not read yet.
        """
class Window:
    def bytes(self) -> int:
        ...
    def check_errors(self) -> None:
        ...
    def deregister(self) -> None:
        ...
    def put(self, arg0: torch.Tensor, arg1: typing.SupportsInt, arg2: typing.SupportsInt) -> None:
        ...
    def register_buffer(self, arg0: torch.Tensor) -> None:
        ...
    def remote(self, arg0: typing.SupportsInt, arg1: collections.abc.Sequence[typing.SupportsInt], arg2: torch.Tensor) -> torch.Tensor:
        ...
    def signal(self, arg0: typing.SupportsInt) -> None:
        ...
    def wait_signal(self, arg0: typing.SupportsInt, arg1: typing.SupportsInt) -> None:
        ...
class UlyssesTransport:
    def all_to_all_4d(self, x: torch.Tensor, out: torch.Tensor, mode: typing.SupportsInt, seq: collections.abc.Sequence[typing.SupportsInt] | None, heads: collections.abc.Sequence[typing.SupportsInt] | None, async_op: bool, kv_replicas: typing.SupportsInt = 1) -> Work:
        ...
    def async_lane(self) -> UlyssesTransport:
        ...
    def check_errors(self) -> None:
        ...
    def destroy(self) -> None:
        ...
    def empty_output(self, arg0: collections.abc.Sequence[typing.SupportsInt], arg1: typing.SupportsInt, arg2: torch.Tensor) -> torch.Tensor | None:
        ...
    def max_out_bytes(self, shape: collections.abc.Sequence[typing.SupportsInt], element_size: typing.SupportsInt, mode: typing.SupportsInt, seq: collections.abc.Sequence[typing.SupportsInt] | None, heads: collections.abc.Sequence[typing.SupportsInt] | None, kv_replicas: typing.SupportsInt = 1) -> int:
        ...
    def memory_stats(self) -> tuple:
        ...
    def output_shape(self, shape: collections.abc.Sequence[typing.SupportsInt], element_size: typing.SupportsInt, mode: typing.SupportsInt, seq: collections.abc.Sequence[typing.SupportsInt] | None, heads: collections.abc.Sequence[typing.SupportsInt] | None, kv_replicas: typing.SupportsInt = 1) -> list[int]:
        ...
    def tune(self, arg0: str, arg1: str) -> None:
        ...
    @property
    def kind(self) -> str:
        ...
class UlyssesAsync:
    LEND_RING: typing.ClassVar[int] = 4
    def __init__(self, transport: UlyssesTransport, group: typing.SupportsInt, transport_reason: str) -> None:
        ...
    def call(self, x: torch.Tensor, mode: typing.SupportsInt, out: torch.Tensor | None, seq: collections.abc.Sequence[typing.SupportsInt] | None, heads: collections.abc.Sequence[typing.SupportsInt] | None, kv_replicas: typing.SupportsInt, lend: bool, wire_dtype: torch.dtype | None) -> torch.Tensor:
        ...
    def destroy(self, collective: bool = True) -> None:
        ...
    def side_stream(self) -> typing.Any:
        ...
    def stats(self) -> tuple:
        ...
    def tune(self, knob: str, value: str) -> None:
        ...
class ForwardingBackend(torch._C._distributed_c10d.Backend):
    def get_comm(self) -> typing.Any:
        """
        The fastcomms TorchComm this backend runs on (torchcomms' _BackendWrapper.get_comm).
        """
    @property
    def impl(self) -> typing.Any:
        ...
class StoreWindow:
    def bytes(self) -> int:
        ...
    def check_errors(self) -> None:
        ...
    def deregister(self) -> None:
        ...
    def put(self, arg0: torch.Tensor, arg1: typing.SupportsInt, arg2: typing.SupportsInt) -> None:
        ...
    def register_buffer(self, arg0: torch.Tensor) -> None:
        ...
    def remote(self, arg0: typing.SupportsInt, arg1: collections.abc.Sequence[typing.SupportsInt], arg2: torch.Tensor) -> torch.Tensor:
        ...
    def signal(self, arg0: typing.SupportsInt) -> None:
        ...
    def wait_signal(self, arg0: typing.SupportsInt, arg1: typing.SupportsInt) -> None:
        ...
class ValueError(builtins.ValueError, builtins.RuntimeError):
    pass
class TypeError(builtins.TypeError, builtins.RuntimeError):
    pass
class TimeoutError(builtins.TimeoutError, builtins.RuntimeError):
    pass
def _auth_store_get(arg0: typing.Any, arg1: str, arg2: str) -> bytes:
    ...
def _auth_store_set(arg0: typing.Any, arg1: str, arg2: str, arg3: bytes) -> None:
    ...
def _compiled_fast_calls() -> int:
    """
    Compiled communicator calls comm_call_'s C++ kernel ran itself
    """
def _device_alltoallv_check(comm: typing.Any) -> None:
    """
    Raises what the device all-to-all-v flagged since the last check
    """
def _device_alltoallv_info(comm: typing.Any) -> typing.Any:
    """
    The communicator's device all-to-all-v group, or None before its first call
    """
def _device_alltoallv_prepare(comm: typing.Any, max_output_bytes: typing.SupportsInt) -> None:
    """
    Collective: (re)makes the communicator's device all-to-all-v buffers
    """
def _device_alltoallv_single(comm: typing.Any, output: torch.Tensor, input: torch.Tensor, output_split_sizes: torch.Tensor, input_split_sizes: torch.Tensor, timeout_ms: typing.SupportsInt = 0, input_index: torch.Tensor | None = None) -> None:
    """
    Enqueues device_alltoallv_single on the current stream (fastcomms/_device_a2av.py)
    """
def _fast_calls() -> int:
    """
    Ops the process group fast path issued
    """
def _fp8_dequantize(arg0: torch.Tensor, arg1: torch.Tensor, arg2: torch.Tensor) -> None:
    ...
def _fp8_has_cuda_kernels() -> bool:
    ...
def _fp8_quantize(arg0: torch.Tensor, arg1: torch.Tensor, arg2: torch.Tensor) -> None:
    ...
def _moe_gather_dequant(out: torch.Tensor, src: torch.Tensor, scales: torch.Tensor, index: torch.Tensor, count: torch.Tensor | None = None) -> None:
    """
    out[i] = dequantize(src[index[i]], scales[i]) for i < count (read on the GPU), zeros for index < 0; rows from count on untouched
    """
def _moe_gather_rows(dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor, count: torch.Tensor | None = None, zero_rest: bool = False) -> None:
    """
    dst[i] = src[index[i]] for i < count (read on the GPU), zeros for index < 0; rows from count on zeroed (zero_rest) or untouched
    """
def _moe_has_row_kernels() -> bool:
    ...
def _moe_plan_expert(arg0: torch.Tensor, arg1: typing.SupportsInt, arg2: torch.Tensor, arg3: typing.SupportsInt, arg4: typing.SupportsInt, arg5: typing.SupportsInt, arg6: bool) -> tuple:
    """
    The expert side of the plan from the received metadata: (counts, row_tok, row_slot, row_keep, back_rows, rows_from, row_total, row_w, src, row_scales or None)
    """
def _moe_plan_fits(ranks: typing.SupportsInt, local_experts: typing.SupportsInt) -> bool:
    ...
def _moe_plan_home(arg0: torch.Tensor, arg1: typing.SupportsInt, arg2: typing.SupportsInt, arg3: typing.SupportsInt, arg4: typing.SupportsInt, arg5: typing.SupportsInt, arg6: typing.SupportsInt, arg7: typing.SupportsInt) -> tuple:
    """
    The home side of the routing plan: (head (P, 5), owner, local, send_tok, send_dest)
    """
def _moe_plan_send(arg0: torch.Tensor, arg1: torch.Tensor, arg2: torch.Tensor, arg3: torch.Tensor, arg4: torch.Tensor, arg5: torch.Tensor, arg6: torch.Tensor | None, arg7: torch.Tensor | None, arg8: torch.Tensor, arg9: torch.Tensor, arg10: typing.SupportsInt) -> tuple:
    """
    The plan after the header exchange: (send_splits, recv_splits, back_splits, slot_src, send_total); the metadata written into send[:, row_bytes:]
    """
def _moe_weighted_sum(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor | None, w: torch.Tensor) -> None:
    """
    out[t] = sum_j w[t, j] * src[index[t * k + j]] in float32, slot order, no FMA
    """
def _register_comm_call(arg0: typing.Any) -> None:
    """
    Registers comm_call_'s kernel (NOTE [compiled calls in C++])
    """
def _ulysses_register(arg0: UlyssesTransport) -> int:
    ...
def _ulysses_unregister(arg0: typing.SupportsInt) -> None:
    ...
def arm_device_faults(arg0: typing.Any, arg1: typing.SupportsInt) -> None:
    """
    Tests only: sets the device window's fault bits.
    """
def build_info() -> dict:
    ...
def built_backends() -> list[str]:
    ...
def deregister_local_buffer(arg0: typing.Any, arg1: typing.SupportsInt) -> None:
    """
    Frees a handle from register_local_buffer.
    """
def device_window(arg0: typing.Any, arg1: typing.SupportsInt, arg2: typing.SupportsInt, arg3: typing.SupportsInt) -> int:
    """
    A device pointer to the window's fastcomms::device::DeviceWindow (collective at first).
    """
def device_window_layout() -> dict[str, int]:
    ...
def has_transport(arg0: str) -> bool:
    ...
def host_name() -> str:
    """
    This process's host for the Ulysses transport choice (FASTCOMMS_HOST_ID, tests only, else the host name).
    """
def is_backend_built(arg0: str) -> bool:
    ...
def make_backend(rank: typing.SupportsInt, size: typing.SupportsInt, impl: typing.Any) -> ForwardingBackend:
    """
    A c10d Backend over impl.comm (NOTE [c10d backend over a communicator]); the calls the communicator does not run directly call impl's methods of the same names (allreduce(tensors, opts), send(tensors, dst, tag), _start_coalescing(), _end_coalescing(), ...).
    """
def nvlink_decision(who: collections.abc.Sequence[str], probe: collections.abc.Callable[[collections.abc.Sequence[typing.SupportsInt]], tuple[dict[tuple[int, int], bool] | None, str]]) -> tuple[bool, str]:
    ...
def nvlink_matrix(arg0: collections.abc.Sequence[typing.SupportsInt]) -> tuple[dict[tuple[int, int], bool] | None, str]:
    ...
def process_group_transport(arg0: torch.distributed.distributed_c10d.ProcessGroup, arg1: typing.SupportsInt, arg2: typing.SupportsInt, arg3: typing.SupportsInt) -> UlyssesTransport:
    ...
def register_local_buffer(arg0: typing.Any, arg1: torch.Tensor) -> int:
    """
    A device pointer to a fastcomms::device::RegisteredBuffer over the tensor's bytes.
    """
def select_transport(rank: typing.SupportsInt, size: typing.SupportsInt, device_index: typing.SupportsInt, store: typing.Any, name: str, timeout: datetime.timedelta, transport: str, require_nvlink: bool, who: collections.abc.Sequence[str], gather: typing.Any = None, pg: typing.Any = None) -> tuple:
    ...
def store_window(arg0: typing.SupportsInt, arg1: typing.SupportsInt, arg2: typing.SupportsInt, arg3: str, arg4: str, arg5: typing.SupportsInt) -> StoreWindow:
    """
    Collective: a CUDA IPC window over a FileStore folder, with no communicator.
    """
def ulysses_all_to_all_4d(x: torch.Tensor, group: typing.SupportsInt, mode: typing.SupportsInt, seq: collections.abc.Sequence[typing.SupportsInt] | None, heads: collections.abc.Sequence[typing.SupportsInt] | None, kv_replicas: typing.SupportsInt = 1) -> torch.Tensor:
    ...
def ulysses_all_to_all_4d_fp8(x: torch.Tensor, group: typing.SupportsInt, mode: typing.SupportsInt, seq: collections.abc.Sequence[typing.SupportsInt] | None, heads: collections.abc.Sequence[typing.SupportsInt] | None, kv_replicas: typing.SupportsInt, wire_dtype: torch.dtype | None, return_scales: bool = False, grad_wire_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    ...
def ulysses_all_to_all_4d_fp8_out(x: torch.Tensor, out: torch.Tensor, group: typing.SupportsInt, mode: typing.SupportsInt, seq: collections.abc.Sequence[typing.SupportsInt] | None, heads: collections.abc.Sequence[typing.SupportsInt] | None, kv_replicas: typing.SupportsInt, wire_dtype: torch.dtype | None, return_scales: bool = False, grad_wire_dtype: torch.dtype | None = None) -> torch.Tensor:
    ...
def ulysses_all_to_all_4d_out(x: torch.Tensor, out: torch.Tensor, group: typing.SupportsInt, mode: typing.SupportsInt, seq: collections.abc.Sequence[typing.SupportsInt] | None, heads: collections.abc.Sequence[typing.SupportsInt] | None, kv_replicas: typing.SupportsInt = 1) -> torch.Tensor:
    ...
def ulysses_geometry(shape: collections.abc.Sequence[typing.SupportsInt], element_size: typing.SupportsInt, mode: typing.SupportsInt, seq: collections.abc.Sequence[typing.SupportsInt] | None, heads: collections.abc.Sequence[typing.SupportsInt] | None, rank: typing.SupportsInt, size: typing.SupportsInt, kv_replicas: typing.SupportsInt = 1) -> tuple:
    ...
def ulysses_shapes(arg0: typing.SupportsInt, arg1: collections.abc.Sequence[typing.SupportsInt], arg2: typing.SupportsInt, arg3: typing.SupportsInt, arg4: collections.abc.Sequence[typing.SupportsInt] | None, arg5: collections.abc.Sequence[typing.SupportsInt] | None, arg6: typing.SupportsInt) -> tuple:
    """
    (the exchange's shape, the result's shape) of a call: the plan's rules
    """
__version__: str = '0.1.0'
