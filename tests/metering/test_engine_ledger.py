"""The bill checked against the engine's own counters (metering/engine_ledger.py).

End to end with the simulator engine (a process of its own, so its counters are this test's
alone) behind the real gateway: requests of every API, cut streams and 429s are billed
exactly what the engine counted; usage events lost on the way show as drift and raise the
alert; an engine restart is recorded as such, not as drift. The same on the real vLLM:
tests/vllm/test_engine_ledger.py. The rules on their own: the tests at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal

import anthropic
import httpx
import openai
import pytest
from django.utils import timezone

from alerts import services as alert_services
from alerts.choices import Event
from alerts.models import Notice
from core.keyspace import engine_ledger_lock_key, engine_own_key, usage_stream
from core.redis import get_redis
from deployments import fleet
from deployments import services as deployment_services
from deployments.models import Deployment, Replica
from metering import engine_ledger, ingest
from metering import services as metering_services
from metering.engine_ledger import KINDS, Mark, State, Stretch
from metering.models import EngineLedger, UsageEvent
from tenants import services as tenant_services
from tests.alerts.conftest import Receiver, eager_tasks, receiver  # noqa: F401
from tests.gateway.conftest import (  # noqa: F401 - one real gateway, its Redis prefix
    METRICS_TOKEN,
    ROOT,
    Engine,
    deploy,
    gateway_url,
    make_model,
    redis_namespace,
    start_engine,
    stop,
    wait_listening,
    wait_until_served,
)

pytestmark = pytest.mark.django_db(transaction=True)
NAME = "ledger-sim"
HELLO = [{"role": "user", "content": "Count my tokens, engine and bill alike."}]


@dataclass
class Stack:
    url: str
    engine: Engine
    deployment: Deployment
    replica: Replica
    key: str
    key_tight: str  # one request a minute

    def openai(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or self.key, max_retries=0)


@pytest.fixture
def engine() -> Iterator[tuple[Engine, object]]:
    """A simulator engine of this test's own: its counters count only this test's requests.
    Streams pause after 10 tokens, so a client hanging up there has exactly 10."""
    started = start_engine((NAME,), "--sim-ttft-ms", "2", "--sim-decode-tps", "2000")
    yield started
    stop(started[1])


@pytest.fixture
def stack(gateway_url: str, engine: tuple[Engine, object], tenant_a: object) -> Stack:
    node = deployment_services.register_node(
        None, name="ledger-node", docker_url="unix:///x", engine_host="127.0.0.1"
    )
    model = make_model(NAME)
    deployment = deploy(model, node, engine[0].port)
    metering_services.set_price(None, model, Decimal("1"), Decimal("0.5"), Decimal("2"))
    key = tenant_services.issue_api_key(None, tenant_a, name="ledger").plaintext
    tight = tenant_services.issue_api_key(
        None, tenant_a, name="tight", requests_per_minute=1
    ).plaintext
    Replica.objects.filter(deployment=deployment).update(started_at=timezone.now())
    wait_until_served(gateway_url, key, NAME)
    replica = Replica.objects.get(deployment=deployment)
    return Stack(gateway_url, engine[0], deployment, replica, key, tight)


def wait_until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def appended() -> int:
    """Usage events appended so far (the gateway appends one just after its answer ends)."""
    return get_redis().xlen(usage_stream())


@pytest.fixture
def platform_hook(receiver: Receiver, root: object) -> Receiver:
    """The platform's webhook receiver, subscribed to engine drift; it checks signatures."""
    issued = alert_services.create_endpoint(root, None, receiver.url, [Event.ENGINE_DRIFT])
    receiver.secret = issued.secret
    return receiver


def settle(stack: Stack, events: int = 0, timeout: float = 30.0) -> State:
    """Run what beat runs (the scrape, the check) and what the usage service does (ingest)
    until the check has compared everything up to the usage stream's end, once it holds
    ``events`` events: a checkpoint of the engine taken since the call, at or past the last
    event, none waiting."""
    wait_until(lambda: appended() >= events, timeout, f"{events} usage events")
    target, since = fleet.last_usage_id(), time.time()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ingest.drain("ledger-test", 0.2)
        fleet.scrape_all()
        engine_ledger.check_all()
        state = State.load(stack.replica.pk)
        if (
            state.base
            and state.base.at >= since
            and state.pending is None
            and engine_ledger._sid(state.base.stream_id) >= engine_ledger._sid(target)
        ):
            return state
        time.sleep(0.2)
    raise AssertionError(f"the check did not catch up with the usage stream in {timeout} s")


def totals(replica: Replica) -> dict[str, int]:
    rows = EngineLedger.objects.filter(replica_id=replica.pk)
    fields = [
        f.name for f in EngineLedger._meta.fields if f.get_internal_type().endswith("IntegerField")
    ]
    return {
        name: sum(getattr(row, name) for row in rows) for name in fields if name != "replica_id"
    }


def workload(stack: Stack) -> int:
    """Requests of every API the engine serves, a stream cut by its client and a request
    refused by the rate limit; the usage events they make."""
    gw = stack.openai()
    events = 0
    gw.chat.completions.create(model=NAME, messages=HELLO, max_tokens=20)
    stream = gw.chat.completions.create(
        model=NAME,
        messages=HELLO,
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert list(stream)[-1].usage.completion_tokens == 30
    gw.completions.create(model=NAME, prompt="Once upon a time", max_tokens=15)
    first = gw.responses.create(
        model=NAME, input="Remember the word tollgate.", max_output_tokens=12
    )
    gw.responses.create(
        model=NAME, input="Which word?", previous_response_id=first.id, max_output_tokens=8
    )
    ac = anthropic.Anthropic(base_url=stack.url, api_key=stack.key, max_retries=0)
    ac.messages.create(model=NAME, max_tokens=16, messages=HELLO)
    events += 6
    # A stream its client leaves after a few chunks.
    with httpx.stream(
        "POST",
        f"{stack.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {stack.key}"},
        json={"model": NAME, "messages": HELLO, "max_tokens": 3000, "stream": True},
        timeout=30,
    ) as response:
        for n, _ in enumerate(response.iter_lines()):
            if n > 5:
                break
    events += 1
    tight = stack.openai(stack.key_tight)
    tight.chat.completions.create(model=NAME, messages=HELLO, max_tokens=4)
    with pytest.raises(openai.RateLimitError):
        tight.chat.completions.create(model=NAME, messages=HELLO, max_tokens=4)
    return events + 1


def test_the_bill_equals_the_engines_counters_and_lost_events_raise_the_alert(
    stack: Stack, settings: object, platform_hook: Receiver, eager_tasks: None
) -> None:
    settle(stack)  # the first checkpoint: the comparison starts here
    events_before = UsageEvent.objects.count()

    length = appended()
    made = workload(stack)
    settle(stack, length + made)

    assert UsageEvent.objects.count() - events_before == made
    sums = totals(stack.replica)
    print(f"\nthe check after the workload: {sums}")
    assert sums["requests"] == made and sums["checks"] >= 1
    assert (sums["drift_prompt"], sums["drift_cached"], sums["drift_generation"]) == (0, 0, 0)
    assert sums["engine_prompt"] == sums["billed_prompt"] > 0
    assert sums["engine_cached"] == sums["billed_cached"]
    assert sums["cut_requests"] == 1
    # The cut stream: the engine made at most the allowance beyond what its client got.
    assert (
        0
        <= sums["engine_generation"] - sums["billed_generation"]
        == sums["undelivered_generation"]
        <= settings.TOLLGATE_ENGINE_ABORT_ALLOWANCE_TOKENS
    )

    # Usage events lost between the gateway and PostgreSQL: every one, on purpose.
    raised: list[dict] = []

    def on_drift(sender: object, ledger: EngineLedger, stretch: Stretch, **_: object) -> None:
        raised.append({"ledger": ledger, "stretch": stretch})

    engine_ledger.drift_found.connect(on_drift)
    try:
        settings.TOLLGATE_TEST_DROP_USAGE_EVERY = 1
        length = appended()
        lost = stack.openai().chat.completions.create(model=NAME, messages=HELLO, max_tokens=25)
        settle(stack, length + 1)
    finally:
        engine_ledger.drift_found.disconnect(on_drift)
    assert len(raised) == 1, raised
    stretch = raised[0]["stretch"]
    assert stretch.kind == "drift" and stretch.requests == 0
    assert stretch.drift["prompt"] == lost.usage.prompt_tokens
    assert stretch.drift["generation"] == lost.usage.completion_tokens == 25
    assert raised[0]["ledger"].drift_checks == 1
    # The platform admins are told: a console notice and the signed webhook.
    notice = Notice.objects.get(event=Event.ENGINE_DRIFT, tenant=None)
    assert f"{stack.deployment.name} replica 0" in notice.title
    (delivery,) = platform_hook.wait_for(1)
    assert delivery.answered == 200 and not delivery.refused  # the signature checked out
    body = json.loads(delivery.body)
    assert body["data"]["drift_tokens"]["generation"] == 25
    # And Prometheus sees it on the appliance's /metrics.
    page = httpx.get(
        f"{stack.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10
    ).text
    where = f'deployment="{stack.deployment.name}",kind="generation",replica="0"'
    assert f"tollgate_engine_ledger_drift_tokens{{{where}}} 25.0" in page
    counted = sums["engine_generation"] + 25
    assert f"tollgate_engine_ledger_engine_tokens{{{where}}} {counted}.0" in page


def test_an_engine_restart_is_recorded_as_one_not_as_drift(
    stack: Stack, engine: tuple[Engine, object]
) -> None:
    settle(stack)
    length = appended()
    stack.openai().chat.completions.create(model=NAME, messages=HELLO, max_tokens=10)
    # The engine dies and a new one takes its place (the worker's restart: a new start time).
    stop(engine[1])
    restarted = _restart_on(stack.engine.port)
    try:
        Replica.objects.filter(pk=stack.replica.pk).update(started_at=timezone.now())
        stack.openai().chat.completions.create(model=NAME, messages=HELLO, max_tokens=10)
        settle(stack, length + 2)
        stack.openai().chat.completions.create(model=NAME, messages=HELLO, max_tokens=12)
        settle(stack, length + 3)
    finally:
        stop(restarted)
    sums = totals(stack.replica)
    assert sums["restarts"] == 1
    assert sums["drift_prompt"] == sums["drift_generation"] == 0
    assert sums["unverified_generation"] >= 10  # billed across the restart: kept, uncompared
    assert sums["billed_generation"] == 12  # compared again once the new engine was quiet


def _restart_on(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "engine_sim", NAME, "--served-model-name", NAME]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096"]
    cmd += ["--sim-ttft-ms", "2", "--sim-decode-tps", "2000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_listening(port, proc)
    return proc


# --- The rules on their own ---------------------------------------------------------------


def mark(at: float, prompt: int, generation: int, **fields: object) -> Mark:
    values = {"incarnation": "c1@1", "cached": 0, "stream_id": "0-0", "quiet": True, "own": {}}
    return Mark(at=at, prompt=prompt, generation=generation, **{**values, **fields})


def stretch(engine: tuple[int, int, int], billed: tuple[int, int, int], cuts: int = 0) -> Stretch:
    return Stretch(
        start=mark(1, 0, 0),
        end=mark(2, engine[0], engine[2]),
        engine=dict(zip(KINDS, engine, strict=True)),
        billed=dict(zip(KINDS, billed, strict=True)),
        own=dict.fromkeys(KINDS, 0),
        requests=3,
        cuts=cuts,
    )


def test_a_checkpoint_needs_two_quiet_scrapes_with_the_same_counters() -> None:
    quiet = mark(1, 100, 50)
    assert engine_ledger._checkpoint(quiet, mark(6, 100, 50))
    assert not engine_ledger._checkpoint(None, quiet)
    assert not engine_ledger._checkpoint(quiet, mark(6, 100, 51))  # it counted meanwhile
    assert not engine_ledger._checkpoint(quiet, mark(6, 100, 50, quiet=False))
    assert not engine_ledger._checkpoint(mark(1, 100, 50, quiet=False), mark(6, 100, 50))
    assert not engine_ledger._checkpoint(quiet, mark(6, 100, 50, incarnation="c2@9"))


def test_a_scrape_is_quiet_only_with_no_request_in_the_engine_or_holding_a_gateway_slot() -> None:
    figures = {
        "scraped_at": 5.0,
        "prompt_tokens_total": 10.0,
        "generation_tokens_total": 4.0,
        "running": 0.0,
        "waiting": 0.0,
        "slot_holders": 0,
        "stream_id": "17-2",
        "incarnation": "c@1",
        "own": {"prompt": 3},
    }
    got = engine_ledger.mark_of(figures)
    assert got.quiet and got.cached is None and got.own == {"prompt": 3}
    assert not engine_ledger.mark_of({**figures, "slot_holders": 1}).quiet
    assert not engine_ledger.mark_of({**figures, "waiting": 1.0}).quiet
    assert engine_ledger.mark_of({"scraped_at": 5.0, "running": 0.0}) is None  # no counters


def test_cut_requests_allow_undelivered_tokens_and_uncounted_prompts_but_no_more(
    settings: object,
) -> None:
    settings.TOLLGATE_ENGINE_ABORT_ALLOWANCE_TOKENS = 8
    exact = stretch((100, 0, 40), (100, 0, 40))
    engine_ledger._judge(exact, 0)
    assert exact.kind == "exact" and exact.undelivered == 0

    cut = stretch((100, 0, 47), (100, 0, 40), cuts=1)
    engine_ledger._judge(cut, 0)
    assert (cut.kind, cut.undelivered, cut.drift["generation"]) == ("exact", 7, 0)

    beyond = stretch((100, 0, 50), (100, 0, 40), cuts=1)
    engine_ledger._judge(beyond, 0)
    assert (beyond.kind, beyond.drift["generation"]) == ("drift", 2)

    # A request cut before its first token: the engine may not have counted its prompt.
    unstarted = stretch((70, 0, 40), (100, 0, 40), cuts=1)
    engine_ledger._judge(unstarted, 30)
    assert unstarted.kind == "exact"
    short = stretch((60, 0, 40), (100, 0, 40), cuts=1)
    engine_ledger._judge(short, 30)
    assert short.drift["prompt"] == -10  # billed 10 prompt tokens the engine never saw

    lost = stretch((130, 10, 40), (100, 0, 40))
    engine_ledger._judge(lost, 0)
    assert lost.drift == {"prompt": 30, "cached": 10, "generation": 0}


def test_an_engine_without_token_counters_says_so(stack: Stack) -> None:
    figures = {"scraped_at": time.time(), "running": 0.0, "waiting": 0.0, "slot_holders": 0}
    assert engine_ledger.observe(stack.replica, figures) is None
    assert engine_ledger.replica_status(stack.replica)["counters"] is False


def test_tollgates_own_check_request_is_not_drift(stack: Stack) -> None:
    """The worker's own request to the engine (its abort check) is subtracted, not billed."""
    from deployments.abort_check import engine_drops_abandoned

    settle(stack)
    verdict = engine_drops_abandoned(stack.engine.url, NAME, replica_id=stack.replica.pk)
    assert verdict is True  # the simulator drops a request whose client left, as vLLM does
    own = get_redis().hgetall(engine_own_key(stack.replica.pk))
    assert int(own[b"prompt"]) > 0 and b"inexact" not in own
    settle(stack)
    sums = totals(stack.replica)
    assert sums["own_prompt"] == int(own[b"prompt"]) and sums["requests"] == 0
    assert (sums["drift_prompt"], sums["drift_generation"]) == (0, 0)


def test_one_pass_at_a_time(stack: Stack) -> None:
    """Beat's next pass while one still runs leaves the replicas alone (no stretch twice)."""
    get_redis().set(engine_ledger_lock_key(), "another pass", ex=60)
    assert engine_ledger.check_all() == 0
    assert State.load(stack.replica.pk).last is None  # not even scraped
    get_redis().delete(engine_ledger_lock_key())
    engine_ledger.check_all()
    assert State.load(stack.replica.pk).last is not None
