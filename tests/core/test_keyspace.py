"""Redis names are part of the contract between processes of different versions (a gateway
and a worker mid-upgrade, data already in Redis): they are pinned here, letter for letter."""

from core import keyspace


def test_every_shared_name_under_the_prefix(settings: object) -> None:
    settings.TOLLGATE_REDIS_PREFIX = "tg"
    assert keyspace.rkey("a", 1) == "tg:a:1"
    assert keyspace.rate_keys(5, 9) == (
        "tg:rl:k:5",
        "tg:rl:k:5:t",
        "tg:rl:t:9",
        "tg:rl:t:9:t",
        "tg:cc:k:5",
        "tg:cc:t:9",
    )
    assert keyspace.quota_key(9, "2026-11") == "tg:quota:9:2026-11"
    assert keyspace.open_keys() == ("tg:gw:open", "tg:gw:open:rec", "tg:gw:open:cp")
    assert keyspace.settled_stem() + "req_1" == "tg:settled:req_1"
    assert keyspace.usage_stream() == "tg:usage:events"
    assert keyspace.pool_keys(3) == (
        "tg:adm:3:run",
        "tg:adm:3:q",
        "tg:adm:3:qexp",
        "tg:adm:3:vft",
        "tg:adm:3:ceiling",
        "tg:adm:3:tok",
        "tg:adm:3:hi",
        "tg:adm:3:pre",
        "tg:adm:3:preempted",
    )
    assert keyspace.preempt_verdict_key(3) == "tg:adm:3:pfree"
    assert keyspace.preempt_channel() == "tg:adm:preempt"
    assert keyspace.controller_key(3) == "tg:adm:3:ctl"
    assert keyspace.wait_stats_key(493_000) == "tg:adm:waits:493000"
    assert keyspace.wake_channel() == "tg:adm:wake"
    assert keyspace.engine_metrics_key(12) == "tg:engine:12:metrics"
    assert keyspace.invalidation_channel() == "tg:gateway:invalidate"


def test_cached_names_follow_a_changed_prefix(settings: object) -> None:
    settings.TOLLGATE_REDIS_PREFIX = "one"
    assert keyspace.pool_keys(3)[0] == "one:adm:3:run" and keyspace.open_keys()[0] == "one:gw:open"
    settings.TOLLGATE_REDIS_PREFIX = "two"
    assert keyspace.pool_keys(3)[0] == "two:adm:3:run" and keyspace.open_keys()[0] == "two:gw:open"
