"""Live-stack helper for tests (the implementation lives in apps.coordinator.stack, which the
`chaos_drill` command also uses). See that module's docstring for the API."""
from apps.coordinator.stack import (  # noqa: F401
    PoolHandle,
    Proc,
    RedisServer,
    Stack,
    StackError,
    database_url,
    free_port,
)
