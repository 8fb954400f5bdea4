"""The embedded services are the real thing: PostgreSQL 18 with pgvector, and redis-server."""

import redis
from django.conf import settings
from django.db import connection

from ragsite.embedded import EmbeddedRedis


def test_vector_extension_is_installed_at_0_8_or_newer(db):
    with connection.cursor() as cursor:
        cursor.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
        (version,) = cursor.fetchone()
        cursor.execute("SHOW server_version_num")
        (server_version,) = cursor.fetchone()
        # A real pgvector operator, not just a catalog row: cosine distance of two vectors.
        cursor.execute("SELECT '[1,0,0]'::vector <=> '[0,1,0]'::vector, '[1,2]'::vector <-> '[4,6]'::vector")
        cosine, euclid = cursor.fetchone()
    assert tuple(int(part) for part in version.split(".")[:2]) >= (0, 8)
    assert int(server_version) >= 180000
    assert cosine == 1.0
    assert euclid == 5.0


def test_redis_is_a_real_server():
    client = redis.Redis.from_url(settings.REDIS_URL)
    info = client.info("server")
    assert info["redis_version"].startswith("6.") or int(info["redis_version"].split(".")[0]) >= 6
    assert info["tcp_port"] == int(settings.REDIS_URL.rsplit(":", 1)[1].split("/")[0])
    # Streams are what token streaming relies on.
    stream = "test:stream"
    client.delete(stream)
    first = client.xadd(stream, {"delta": "Hel"})
    client.xadd(stream, {"delta": "lo"})
    assert [fields[b"delta"] for _, fields in client.xrange(stream)] == [b"Hel", b"lo"]
    assert client.xrange(stream, min=first, max=first)[0][0] == first


def test_embedded_redis_keeps_data_across_a_restart(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.ensure_running()
    try:
        assert server.ensure_running() == url  # a second start reuses the running server
        client = redis.Redis.from_url(url)
        client.set("kept", "yes")
        client.rpush("queue", "a", "b")
        assert server.stop() is True
        assert server.running_port() is None
        url_again = server.ensure_running()
        client = redis.Redis.from_url(url_again)
        assert client.get("kept") == b"yes"
        assert client.lrange("queue", 0, -1) == [b"a", b"b"]
        assert client.config_get("bind")["bind"] == "127.0.0.1"
    finally:
        server.stop()
    assert server.stop() is False
