"""sitsmesh.admin.v1.AdminService on the wire: one servicer per area, joined into one service.

The generated stubs live in `sitsmesh/admin/v1/` (the proto's package path); the
servicers that answer them live here, beside the other wire APIs.
"""

from sitsmesh.transport.admin.service import AdminServicer

__all__ = ["AdminServicer"]
