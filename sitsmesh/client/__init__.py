"""A typed Python client of the sitsmesh admin API (sitsmesh.admin.v1.AdminService).

    from sitsmesh.client import Client
    with Client("127.0.0.1:50052", token) as admin:
        for tenant in admin.tenants():
            print(tenant.name)

`AsyncClient` is the same on asyncio. Requests and replies are the generated messages
(`sitsmesh.admin.v1.admin_pb2`, re-exported here as `admin_pb2`); failures raise
`AdminError` with the gRPC `code` and the server's `message`.
"""

from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.client.aio import AsyncClient
from sitsmesh.client.base import DEFAULT_TIMEOUT_S, AdminError, Tls
from sitsmesh.client.sync import Client

__all__ = ["DEFAULT_TIMEOUT_S", "AdminError", "AsyncClient", "Client", "Tls", "admin_pb2"]
