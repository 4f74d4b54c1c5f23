# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""fastcomms: a torchcomms-compatible communicator API and a fast Ulysses all-to-all. Code written
for torchcomms runs after ``import fastcomms as torchcomms`` (docs/status.md). The classes live in
modules named after them (docs/design.md); this file re-exports them.
"""

from __future__ import annotations

from pkgutil import extend_path

import torch  # noqa: F401  (loads libtorch before the extension)

__path__ = extend_path(__path__, __name__)  # the built extension may live in a build tree

from . import _native  # noqa: E402

_native.load()  # NOTE [gloo symbols]: before the extension
from . import (  # noqa: E402,F401
    _C,
    _bootstrap,
    _op_options,  # noqa: E402
)
from . import _hook_types as _ht  # noqa: E402
from ._alias import register_nvlink_name as _register_nvlink_name  # noqa: E402,F401
from ._alias import register_with_torch as _register_with_torch  # noqa: E402
from ._allgather_p import AllGatherPHandle  # noqa: E402
from ._bootstrap import rank_size_override as _rank_size_override  # noqa: E402,F401
from ._C import AbortedError, BackendError, RedOpType, UnsupportedError, WorkStatus  # noqa: E402
from ._comm import TorchComm, _OpaqueBase, new_comm  # noqa: E402,F401
from ._device_api import get_include  # noqa: E402
from ._hook_types import *  # noqa: E402,F401,F403  (OpName, RemovableHandle, the hook arguments)
from ._op_options import *  # noqa: E402,F401,F403  (SendOptions ... AllGatherPExecOptions)
from ._options import CommOptions, ReduceOp, Timeout  # noqa: E402
from ._p2p import BatchP2POptions, BatchSendRecv, P2POp, P2POpType  # noqa: E402
from ._reconfigure import ReconfigureOptions  # noqa: E402
from ._registry import (  # noqa: E402
    TorchCommBackend,
    built_backends,
    get_mem_allocator,
    is_backend_built,
    nvlink_matrix,
    register_backend,
)
from ._window import (  # noqa: E402
    TorchCommWinAccessType,
    TorchCommWindow,
    TorchCommWindowAttr,
    store_window,  # noqa: E402
)
from ._work import TorchWork  # noqa: E402

__version__ = _C.__version__  # the VERSION file (one literal for CMake, pyproject and Python)
__all__ = [
    "new_comm",
    "TorchComm",
    "TorchWork",
    "WorkStatus",
    "ReduceOp",
    "RedOpType",
    "CommOptions",
    "ReconfigureOptions",
    "TorchCommWindow",
    "TorchCommWindowAttr",
    "TorchCommWinAccessType",
    "BatchSendRecv",
    "P2POp",
    "P2POpType",
    "BatchP2POptions",
    "Timeout",
    "register_backend",
    "TorchCommBackend",
    "is_backend_built",
    "built_backends",
    "nvlink_matrix",
    "get_mem_allocator",
    "AbortedError",
    "BackendError",
    "UnsupportedError",
    "AllGatherPHandle",
    "get_include",
    "store_window",
    *_ht.__all__,
    *_op_options.__all__,
]

# torchcomms' "fake" backend (registered by _fake); as after `import torchcomms`, its hooks and
# objcol modules are attributes of the package
from . import _fake, _torchcomms_ops, _waits, hooks, objcol  # noqa: E402,F401

_waits.register()  # NOTE [torchcomms wait ops] (again when the first communicator is made)
_torchcomms_ops.register()  # NOTE [torchcomms method ops] (again with the first communicator)
_register_with_torch()  # NOTE [nvlink as a torch.distributed backend]
