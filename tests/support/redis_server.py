"""The loopback redis-server the demo and benchmarks use (``turbowire.serving.redis_server``),
under the import name the tests use (``from support.redis_server import RedisServer``)."""

from turbowire.serving.redis_server import (  # noqa: F401
    RedisServer,
    RedisServerError,
    free_port,
    redis_binary,
    redis_server_fixture,
)
