"""The scheduler: continuous batching with a bounded running set and an ordered waiting queue.

Each request's handler drives its own decode loop; the engine decides when it may run
(admission), how long prefill and each decode step take (a memory-bandwidth model: every
running sequence shares the same bandwidth, so per-sequence speed falls as the batch
grows), tracks KV-cache blocks and the prefix cache, and keeps the metrics.

The waiting queue is ordered by (priority, arrival); with `--scheduling-policy fcfs` every
priority is 0, so it is FIFO. As in vLLM's V1 scheduler, a waiting request never preempts a
running one to get a slot, whatever its priority: it waits for a sequence to finish (vLLM
0.32's waiting loop stops at `max_num_seqs`; checked on the real CPU engine, where a P0
request waited 6 s for a 1,900-token P2 reply with `--scheduling-policy priority`).
Preemption happens only when a running sequence needs a new KV block and none is free: the
victim is the worst running sequence by (priority, arrival) under `priority`, the one
scheduled last under `fcfs` (vLLM's recompute preemption): it loses its slot and KV blocks,
re-queues with its original arrival, and when it runs again its decode loop pays prefill for
prompt + generated tokens before it continues where it stopped.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable

from engine_sim.cli import Config
from engine_sim.lora import Adapter, Adapters
from engine_sim.metrics import Metrics


class QueueFull(Exception):
    """More requests waiting than --max-num-queued-reqs allows."""


class EngineDead(Exception):
    """The (simulated) engine core died; requests fail with 500."""


class Sequence:
    """One request inside the engine: its sizes, timestamps and how far it got."""

    __slots__ = (
        "prompt_tokens",
        "lora",
        "deferred",
        "cached_tokens",
        "arrival",
        "scheduled",
        "first_token",
        "last_token",
        "generated",
        "blocks",
        "admitted",
        "finish_reason",
        "priority",
        "key",
        "waiter",
        "preempted",
        "prompt_ids",
        "shared_blocks",
        "block_hashes",
        "created_tokens",
        "release_mark",
        "started",
    )

    _order = itertools.count()

    def __init__(self, prompt_tokens: int, priority: int = 0) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.priority = priority
        self.key = (priority, next(Sequence._order))  # queue order: priority, then arrival
        self.waiter: asyncio.Future | None = None  # set while the sequence is in the queue
        self.release_mark = 0  # --sim-pause-after-tokens: SIGUSR1s before its last token
        self.preempted = False  # lost its slot; the decode loop must re-queue and re-prefill
        self.lora: Adapter | None = None  # the LoRA adapter it runs with (None: the base)
        self.deferred = False  # waiting, passed over for the LoRA budget (--max-loras)
        self.started = 0  # when it last got a slot (an ever-growing count): fcfs preempts the last
        self.arrival = time.monotonic()
        self.scheduled = 0.0
        self.first_token = 0.0
        self.last_token = 0.0
        self.generated = 0
        self.blocks = 0
        self.admitted = False
        self.finish_reason = "rejected"  # until admitted; never counted as a finished request
        # The prompt's token ids, for the prefix cache; None for pooling requests (not cached).
        self.prompt_ids: list[int] | None = None
        self.shared_blocks = 0  # full prompt blocks it shares with the prefix cache while running
        self.block_hashes: list[int] = []  # of its full prompt blocks, once looked up
        # Prompt tokens its prefill wrote into the prefix cache (blocks no one had cached):
        # vLLM's created_cache_tokens / cache_write_tokens / cache_creation_input_tokens.
        self.created_tokens = 0


class Engine:
    """Admission, timing and accounting for all sequences of one simulated vLLM engine."""

    def __init__(self, cfg: Config) -> None:
        s = cfg.sim
        self.cfg = cfg
        self.adapters = Adapters(
            cfg.lora_modules,
            cfg.max_lora_rank,
            cfg.served_names,
            cfg.max_cpu_loras,
            s.sim_lora_load_ms / 1000,
        )
        # Requests on adapters that reached the scheduler and have not finished, by adapter
        # name in the order they came: what vllm:lora_requests_info lists.
        self.lora_requests: dict[str, set[Sequence]] = {}
        self.max_running = cfg.max_num_seqs
        self.block_size = cfg.block_size
        kv_tokens = s.sim_kv_cache_tokens or cfg.max_num_seqs * cfg.max_model_len
        self.total_blocks = max(1, kv_tokens // cfg.block_size)
        self.used_blocks = 0
        self.running = 0
        self.running_seqs: set[Sequence] = set()
        self.waiting: list[Sequence] = []  # sorted by Sequence.key
        self.priority_policy = cfg.scheduling_policy == "priority"
        self.metrics = Metrics(cfg.served_names[0], cfg.max_model_len)
        if cfg.enable_lora:
            self.metrics.max_lora = cfg.max_loras
        self.metrics.cache_info = {
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(cfg.prefix_caching),
            "gpu_memory_utilization": str(getattr(cfg.sim, "gpu_memory_utilization", None) or 0.92),
            "num_cpu_blocks": "0",
            "num_gpu_blocks": str(self.total_blocks),
            "num_gpu_blocks_override": "None",
            "prefix_caching_hash_algo": "sha256",
        }
        self.ttft_s = s.sim_ttft_ms / 1000
        self.ttft_per_tok_s = s.sim_ttft_per_token_ms / 1000
        self.first_delay_s = s.sim_first_request_delay_ms / 1000
        self.decode_tps = s.sim_decode_tps
        self.alpha = s.sim_bandwidth_alpha
        # Prefix cache: hashes of full KV blocks, least recently used first. Blocks held by
        # running sequences for their own generated tokens are not available to it.
        self.prefix: OrderedDict[int, None] = OrderedDict()
        self.shared_blocks = 0  # sum of running sequences' shared_blocks
        self.finished = 0
        self.dead = False
        # The engine dies (the server process sets it to its crash: the process ends too).
        self.on_fatal: Callable[[], None] = self.kill
        self.hung = False
        self._hang_forever: asyncio.Future | None = None
        self.held = bool(s.sim_hold)
        self.load_held = bool(s.sim_hold_load)
        self._released: asyncio.Event | None = None
        self.pause_after: frozenset[int] = s.sim_pause_after_tokens
        self.releases = 0  # SIGUSR1s so far: a paused stream waits for one after its mark
        self._paused: asyncio.Event | None = None

    # --- admission -------------------------------------------------------------------

    def _fits(self, seq: Sequence) -> bool:
        need = self._blocks_for(seq)
        return self.running < self.max_running and self.used_blocks + need <= self.total_blocks

    def _lora_blocked(self, seq: Sequence) -> bool:
        """vLLM's LoRA budget: at most --max-loras different adapters run at once; a request
        on another waits (the base's requests never do)."""
        if seq.lora is None:
            return False
        running = {s.lora.id for s in self.running_seqs if s.lora is not None}
        return seq.lora.id not in running and len(running) >= self.cfg.max_loras

    def _blocks_for(self, seq: Sequence) -> int:
        # A resumed sequence recomputes prompt + generated tokens, so it needs their blocks.
        return -(-(seq.prompt_tokens + seq.generated + 1) // self.block_size)

    def _start(self, seq: Sequence) -> None:
        seq.started = next(Sequence._order)
        seq.deferred = False
        if seq.lora is not None:
            self.lora_requests.setdefault(seq.lora.name, set()).add(seq)
            self._stamp_lora()
        seq.blocks = self._blocks_for(seq)
        self.used_blocks += seq.blocks
        self.running += 1
        self.running_seqs.add(seq)
        seq.admitted = True
        seq.release_mark = self.releases  # a release seen running (in /metrics) comes after
        if not seq.scheduled:  # queue time is measured to the first scheduling only
            seq.scheduled = time.monotonic()
            self.metrics.queue.observe(seq.scheduled - seq.arrival)
            # vLLM looks the prompt up when it schedules it, not when it arrives: a twin
            # prompt still prefilling has no computed blocks to share yet.
            seq.cached_tokens = self._match_prefix(seq)
        if seq.prompt_ids is not None and self.cfg.prefix_caching:
            seq.shared_blocks = min(seq.blocks, (len(seq.prompt_ids) - 1) // self.block_size)
            self.shared_blocks += seq.shared_blocks

    def _enqueue(self, seq: Sequence) -> asyncio.Future:
        seq.waiter = asyncio.get_running_loop().create_future()
        bisect.insort(self.waiting, seq, key=lambda q: q.key)
        return seq.waiter

    def _dequeue(self, seq: Sequence) -> None:
        if seq.waiter is not None:
            self.waiting.remove(seq)
            seq.waiter = None

    async def _wait_turn(self, seq: Sequence, fut: asyncio.Future) -> None:
        try:
            await fut
        except asyncio.CancelledError:
            # Disconnected while waiting: leave the queue, and give back a slot granted in
            # the same tick.
            self.release(seq)
            seq.finish_reason = "abort"
            raise
        if self.dead:
            raise EngineDead()

    async def admit(self, seq: Sequence) -> None:
        """Wait in (priority, arrival) order until the sequence may run; raises QueueFull or
        EngineDead."""
        if self.dead:
            raise EngineDead()
        if not self.waiting and not self._lora_blocked(seq):
            if self._fits(seq) or self.running == 0:
                self._start(seq)
                return
        limit = self.cfg.max_num_queued
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFull()
        fut = self._enqueue(seq)
        self._wake()  # it may sort ahead of the head
        await self._wait_turn(seq, fut)

    async def resume(self, seq: Sequence) -> None:
        """A preempted sequence waits for a slot again; its caller then re-prefills."""
        if seq.waiter is not None:
            await self._wait_turn(seq, seq.waiter)
        seq.preempted = False

    def release(self, seq: Sequence) -> None:
        """The sequence left the batch (finished, aborted or failed): free its slot."""
        self._dequeue(seq)  # preempted and re-queued, then finished or aborted
        self._lora_done(seq)
        if not seq.admitted:
            return
        self._free(seq)
        self._wake()

    def _lora_done(self, seq: Sequence) -> None:
        if seq.lora is None or seq not in self.lora_requests.get(seq.lora.name, ()):
            return
        requests = self.lora_requests[seq.lora.name]
        requests.discard(seq)
        if not requests:
            del self.lora_requests[seq.lora.name]
        self._stamp_lora()

    def _stamp_lora(self) -> None:
        if self.cfg.enable_lora:
            self.metrics.stamp_lora(",".join(self.lora_requests))

    def activate_lora(self, seq: Sequence) -> float:
        """The worker runs the sequence's adapter (reading it again if it was pushed out of
        the cache: the seconds that delays its first token); its files being gone kills the
        engine, as in vLLM."""
        if seq.lora is None:
            return 0.0
        read = self.adapters.activate(seq.lora)
        if read is None:
            seq.finish_reason = "error"
            self.on_fatal()
            raise EngineDead()
        return read

    def _free(self, seq: Sequence) -> None:
        seq.admitted = False
        self.running -= 1
        self.running_seqs.discard(seq)
        self.used_blocks -= seq.blocks
        seq.blocks = 0
        self.shared_blocks -= seq.shared_blocks
        seq.shared_blocks = 0

    def _victim(self) -> Sequence:
        """The running sequence vLLM preempts when the KV cache is full: the worst by
        (priority, arrival) under ``priority``, the one scheduled last under ``fcfs``."""
        if self.priority_policy:
            return max(self.running_seqs, key=lambda s: s.key)
        return max(self.running_seqs, key=lambda s: s.started)

    def _preempt(self, seq: Sequence) -> None:
        """vLLM's recompute preemption: free the slot and the KV blocks, back to the queue."""
        self._free(seq)
        seq.preempted = True
        self.metrics.preemptions += 1
        self._enqueue(seq)

    def _wake(self) -> None:
        i = 0
        while i < len(self.waiting) and self.running < self.max_running:
            seq = self.waiting[i]
            if self._lora_blocked(seq):
                seq.deferred = True  # vLLM passes it over and looks at the next one
                i += 1
                continue
            if not (self._fits(seq) or self.running == 0):
                return  # it waits for a running sequence to finish (or be preempted)
            self.waiting.pop(i)
            fut, seq.waiter = seq.waiter, None
            self._start(seq)
            if fut is not None and not fut.done():
                fut.set_result(None)

    # --- prefix cache ------------------------------------------------------------------

    def _block_hashes(self, ids: list[int], adapter: Adapter | None = None) -> list[int]:
        """Chained hashes of the prompt's full blocks; the last token is always computed, as
        in vLLM, so a prompt of exactly n blocks caches n - 1 of them. An adapter's blocks
        hash apart from the base's (vLLM keys them with the LoRA too)."""
        bs = self.block_size
        h = hash((adapter.name, adapter.path)) if adapter is not None else 0
        out = []
        for i in range((len(ids) - 1) // bs):
            h = hash((h, tuple(ids[i * bs : (i + 1) * bs])))
            out.append(h)
        return out

    def _match_prefix(self, seq: Sequence) -> int:
        """Prompt tokens already in the cache (leading whole blocks), counted on the prefix-cache
        metrics like vLLM's scheduler does."""
        ids = seq.prompt_ids
        if ids is None or not self.cfg.prefix_caching:
            return 0
        seq.block_hashes = self._block_hashes(ids, seq.lora)
        hit: list[int] = []
        for h in seq.block_hashes:
            if h not in self.prefix:
                break
            hit.append(h)
        self._touch(hit)
        hits = len(hit)
        m = self.metrics
        m.prefix_cache_queries += len(ids)
        m.prefix_cache_hits += hits * self.block_size
        return hits * self.block_size

    def cache_prompt(self, seq: Sequence) -> None:
        """Prefill is done: the prompt's full blocks are computed and shareable from now on."""
        if seq.prompt_ids is None or not self.cfg.prefix_caching:
            return
        hashes = seq.block_hashes
        seq.created_tokens = self.block_size * sum(h not in self.prefix for h in hashes)
        for h in hashes:
            self.prefix[h] = None
        self._touch(hashes)
        self._evict()

    def _touch(self, hashes: list[int]) -> None:
        # Most recently used last, a prompt's tail before its head: like vLLM, which frees a
        # request's blocks tail first, eviction eats a prefix from its end and a later
        # request still finds the head.
        for h in reversed(hashes):
            self.prefix.move_to_end(h)

    def _evict(self) -> None:
        """Drop least recently used blocks beyond what the KV cache can hold: every block not
        held privately by a running sequence (its generated tokens, its last partial block)."""
        room = max(0, self.total_blocks - (self.used_blocks - self.shared_blocks))
        while len(self.prefix) > room:
            self.prefix.popitem(last=False)

    # --- timing ------------------------------------------------------------------------

    def prefill_delay(self, seq: Sequence) -> float:
        if seq.scheduled and seq.generated:  # resumed after preemption: recompute it all
            return self.ttft_s + self.ttft_per_tok_s * (seq.prompt_tokens + seq.generated)
        d = self.ttft_s + self.ttft_per_tok_s * (seq.prompt_tokens - seq.cached_tokens)
        if self.first_delay_s:
            d += self.first_delay_s
            self.first_delay_s = 0.0  # only the first request pays the warm-up
        return d

    def token_delay(self) -> float:
        """Seconds per decode step for one sequence at the current batch size."""
        if self.decode_tps <= 0:
            return 0.0
        return (1 + self.alpha * (self.running - 1)) / self.decode_tps

    async def pause_if_hung(self) -> None:
        if self.hung:
            if self._hang_forever is None:
                self._hang_forever = asyncio.get_running_loop().create_future()
            await self._hang_forever

    async def wait_if_held(self) -> None:
        """--sim-hold: generation waits here until release() (SIGUSR1)."""
        if self.held:
            if self._released is None:
                self._released = asyncio.Event()
            await self._released.wait()

    async def wait_for_release(self, mark: int) -> None:
        """--sim-pause-after-tokens: a stream waits here for a SIGUSR1 later than ``mark``
        (the release count when it sent its last token: a release sent by a client that has
        read that token is never missed)."""
        while self.releases <= mark:
            if self._paused is None:
                self._paused = asyncio.Event()
            await self._paused.wait()

    def release_hold(self) -> None:
        self.held = self.load_held = False
        self.releases += 1
        if self._released is not None:
            self._released.set()
        if self._paused is not None:
            paused, self._paused = self._paused, None
            paused.set()

    # --- accounting --------------------------------------------------------------------

    def on_first_token(self, seq: Sequence) -> None:
        now = time.monotonic()
        seq.first_token = seq.last_token = now
        m = self.metrics
        m.ttft.observe(now - seq.arrival)
        m.prompt_tokens += seq.prompt_tokens
        m.prompt_tokens_cached += seq.cached_tokens
        m.prompt_by_source["local_cache_hit"] += seq.cached_tokens
        m.prompt_by_source["local_compute"] += seq.prompt_tokens - seq.cached_tokens

    def on_token(self, seq: Sequence) -> None:
        """Count one generated token; grow the KV allocation every block_size tokens."""
        seq.generated += 1
        self.metrics.generation_tokens += 1
        if seq.generated > 1:
            now = time.monotonic()
            self.metrics.itl.observe(now - seq.last_token)
            seq.last_token = now
        if (seq.prompt_tokens + seq.generated) % self.block_size == 1 and seq.generated > 1:
            # A sequence alone always runs (vLLM sizes its KV cache for one at max length).
            if self.used_blocks >= self.total_blocks and self.running > 1:
                victim = self._victim()
                self._preempt(victim)
                if victim is not seq:  # else it grows again when it resumes (recomputed)
                    self.used_blocks += 1
                    seq.blocks += 1
                self._wake()  # the freed slot and blocks go to the head of the queue
                return
            self.used_blocks += 1
            seq.blocks += 1

    def on_finish(self, seq: Sequence) -> None:
        if seq.finish_reason == "abort":
            return  # vLLM observes no request-level metric for an aborted request
        m = self.metrics
        m.success[seq.finish_reason] = m.success.get(seq.finish_reason, 0) + 1
        m.e2e.observe(time.monotonic() - seq.arrival)
        m.req_prompt.observe(seq.prompt_tokens)
        m.req_gen.observe(seq.generated)
        m.prefill_computed.observe(seq.prompt_tokens - seq.cached_tokens)
        if seq.finish_reason in ("stop", "length"):
            self.finished += 1

    def kv_usage(self) -> float:
        return min(1.0, self.used_blocks / self.total_blocks)

    def render_metrics(self) -> str:
        if self.running or self.waiting:
            self._stamp_lora()  # vLLM stamps the gauge at every step while it works
        deferred = sum(seq.deferred for seq in self.waiting)
        return self.metrics.render(self.running, len(self.waiting), deferred, self.kv_usage())

    def kill(self) -> None:
        """The engine core died: waiting requests fail now, running ones at their next step."""
        self.dead = True
        while self.waiting:
            seq = self.waiting.pop(0)
            fut, seq.waiter = seq.waiter, None
            if fut is not None and not fut.done():
                fut.set_result(None)  # admit() and resume() re-check `dead` and raise
