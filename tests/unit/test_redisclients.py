"""redis_url's forms: a single server passes to redis-py as it is; a cluster URL lists
its seeds, and every malformed one is refused with what is wrong, at settings load."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.asyncio.cluster import RedisCluster

from sitsmesh import config, redisclients
from sitsmesh.app import tls
from sitsmesh.errors import ConfigError


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://r.example:6380/2",
                                 "unix:///run/redis.sock?db=1"])
def test_a_single_server_url_is_redis_pys_own(url: str) -> None:
    target = redisclients.parse(url)
    assert target == redisclients.Target(url) and not target.cluster


def test_a_cluster_url_lists_every_seed() -> None:
    target = redisclients.parse(
        "redis+cluster://:s%40cret@r0.example:7000,r1.example,[::1]:7002/0?health_check_interval=5")
    assert target.cluster
    assert target.seeds == (("r0.example", 7000), ("r1.example", 6379), ("::1", 7002))
    assert target.url == "redis://:s%40cret@r0.example:7000/0?health_check_interval=5"


def test_a_tls_cluster_url_keeps_tls_and_a_v6_first_seed_its_brackets() -> None:
    target = redisclients.parse("rediss+cluster://user:pw@[fd00::1]:7000")
    assert target.url == "rediss://user:pw@[fd00::1]:7000/0"
    assert target.seeds == (("fd00::1", 7000),)


@pytest.mark.parametrize(("url", "error"), [
    ("http://r:6379", "expected a redis://"),
    ("redis+cluster://", "expected host:port"),
    ("redis+cluster://a:7000,,b:7001", "expected host:port"),
    ("redis+cluster://a:7000/3", "only database 0"),
    ("redis+cluster://a:port", "is not a number"),
    ("redis+cluster://a:70000", "out of range"),
    ("redis+cluster://:7000", "no host"),
    ("redis+cluster://" + ",".join(f"h{i}:7000" for i in range(65)), "at most 64"),
])
def test_a_malformed_url_is_refused_with_what_is_wrong(url: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        redisclients.parse(url)


def test_settings_take_a_cluster_url_and_refuse_a_bad_one() -> None:
    url = "redis+cluster://10.0.0.1:7000,10.0.0.2:7000"
    assert config.load_settings(env={"SITSMESH_REDIS_URL": url}).redis_url == url
    with pytest.raises(ConfigError, match=r"SITSMESH_REDIS_URL.*only database 0"):
        config.load_settings(env={"SITSMESH_REDIS_URL": "redis+cluster://a:7000/1"})


async def test_connect_builds_a_cluster_client_with_every_seed() -> None:
    client = redisclients.connect("redis+cluster://127.0.0.1:1,127.0.0.1:2", protocol=2)
    try:
        assert isinstance(client, RedisCluster)
        assert {(n.host, n.port) for n in client.startup_nodes} == {
            ("127.0.0.1", 1), ("127.0.0.1", 2)}
    finally:
        await client.aclose()


def test_the_password_file_reaches_a_cluster_url(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cr@t\n")
    settings = config.load_settings(env={
        "SITSMESH_REDIS_URL": "rediss+cluster://r0:7000,r1:7000",
        "SITSMESH_REDIS_PASSWORD_FILE": str(secret)})
    target = redisclients.parse(tls.redis_url(settings))
    assert target.url == "rediss://:s3cr%40t@r0:7000/0"
    assert target.seeds == (("r0", 7000), ("r1", 7000))
