# Type stub of fastcomms._c10d (python/src/c10d_backend.cpp; written by hand, it is small).
from typing import Any

class ForwardingBackend:
    """A torch c10d Backend whose methods call ``impl``'s methods of the same names."""

    @property
    def impl(self) -> Any: ...
    def get_comm(self) -> Any: ...

def make_backend(rank: int, size: int, impl: Any) -> ForwardingBackend: ...
