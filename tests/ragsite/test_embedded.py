"""The embedded services are the real thing: PostgreSQL 18 with pgvector, and redis-server."""

import psycopg
import redis
from django.conf import settings
from django.db import connection

from ragsite.embedded import EmbeddedPostgres, EmbeddedRedis


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


def test_a_process_holds_more_than_a_hundred_redis_connections_at_once():
    """redis-py 8 caps a pool at 100 connections and raises beyond: a web process holding a
    hundred answer streams (a blocking read each) would refuse the next one. The clients of
    ragsite.redis open up to REDIS_MAX_CONNECTIONS, sync and async alike."""
    import asyncio

    from ragsite.redis import Role, redis_async_client, redis_client

    pool = redis_client(Role.BROKER).connection_pool
    held = [pool.get_connection() for _ in range(150)]
    try:
        assert pool.max_connections == settings.REDIS_MAX_CONNECTIONS
        assert {connection.send_command("PING") or connection.read_response() for connection in held} == {b"PONG"}
    finally:
        for connection in held:
            pool.release(connection)

    async def hold_async() -> int:
        client = redis_async_client(Role.BROKER)
        # 150 blocking reads at once, each on its own connection, as 150 open streams are.
        reads = [client.xread({"test:empty-stream": "$"}, block=300) for _ in range(150)]
        results = await asyncio.gather(*reads)
        await client.aclose()
        return len(results)

    assert asyncio.run(hold_async()) == 150


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


def test_embedded_postgres_is_tuned_once_and_again_when_what_is_wanted_changes(tmp_path):
    """Sized for what ``up`` holds at once (300 connections, not initdb's 100); an install
    tuned by an older version is tuned again, with a restart, and keeps its data."""
    server = EmbeddedPostgres(tmp_path / "pgdata", database="kept")
    marker = tmp_path / "pgdata" / "ragsite-tuned"
    try:
        url = server.ensure_running()
        with psycopg.connect(url, autocommit=True) as conn:
            assert conn.execute("SHOW max_connections").fetchone() == ("300",)
            conn.execute("CREATE TABLE kept (v text)")
            conn.execute("INSERT INTO kept VALUES ('yes')")
        pid = server._postmaster_pid()
        assert server.ensure_running() == url and server._postmaster_pid() == pid  # tuned: no restart

        # What an older version left: its marker and settings without max_connections.
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM RESET max_connections")
        older = [line for line in marker.read_text().splitlines(keepends=True) if not line.startswith("max_")]
        marker.write_text("".join(older) + "max_wal_size = 2GB\n")
        assert server.stop() is True
        url = server.ensure_running()
        with psycopg.connect(url) as conn:
            assert conn.execute("SHOW max_connections").fetchone() == ("300",)
            assert conn.execute("SELECT v FROM kept").fetchall() == [("yes",)]
        assert "max_connections = 300\n" in marker.read_text()
    finally:
        server.stop()
