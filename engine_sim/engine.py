"""The scheduler: continuous batching with a bounded running set and a FIFO waiting queue.

Each request's handler drives its own decode loop; the engine decides when it may run
(admission), how long prefill and each decode step take (a memory-bandwidth model: every
running sequence shares the same bandwidth, so per-sequence speed falls as the batch
grows), tracks KV-cache blocks and the prefix cache, and keeps the metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque

from engine_sim.cli import Config
from engine_sim.metrics import Metrics


class QueueFull(Exception):
    """More requests waiting than --max-num-queued-reqs allows."""


class EngineDead(Exception):
    """The (simulated) engine core died; requests fail with 500."""


class Sequence:
    """One request inside the engine: its sizes, timestamps and how far it got."""

    __slots__ = ("prompt_tokens", "cached_tokens", "arrival", "scheduled", "first_token",
                 "last_token", "generated", "blocks", "admitted", "finish_reason")

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.arrival = time.monotonic()
        self.scheduled = 0.0
        self.first_token = 0.0
        self.last_token = 0.0
        self.generated = 0
        self.blocks = 0
        self.admitted = False
        self.finish_reason = "rejected"  # until admitted; never counted as a finished request


class Engine:
    """Admission, timing and accounting for all sequences of one simulated vLLM engine."""

    def __init__(self, cfg: Config) -> None:
        s = cfg.sim
        self.cfg = cfg
        self.max_running = cfg.max_num_seqs
        self.block_size = cfg.block_size
        kv_tokens = s.sim_kv_cache_tokens or cfg.max_num_seqs * cfg.max_model_len
        self.total_blocks = max(1, kv_tokens // cfg.block_size)
        self.used_blocks = 0
        self.running = 0
        self.waiting: deque[tuple[asyncio.Future, Sequence]] = deque()
        self.metrics = Metrics(cfg.served_names[0], cfg.max_model_len)
        self.ttft_s = s.sim_ttft_ms / 1000
        self.ttft_per_tok_s = s.sim_ttft_per_token_ms / 1000
        self.first_delay_s = s.sim_first_request_delay_ms / 1000
        self.decode_tps = s.sim_decode_tps
        self.alpha = s.sim_bandwidth_alpha
        self.prefix: OrderedDict[int, None] = OrderedDict()
        self.finished = 0
        self.dead = False
        self.hung = False
        self._hang_forever: asyncio.Future | None = None

    # --- admission -------------------------------------------------------------------

    def _fits(self, seq: Sequence) -> bool:
        need = -(-(seq.prompt_tokens + 1) // self.block_size)
        return self.running < self.max_running and self.used_blocks + need <= self.total_blocks

    def _start(self, seq: Sequence) -> None:
        seq.blocks = -(-(seq.prompt_tokens + 1) // self.block_size)
        self.used_blocks += seq.blocks
        self.running += 1
        seq.admitted = True
        seq.scheduled = time.monotonic()
        self.metrics.queue.observe(seq.scheduled - seq.arrival)

    async def admit(self, seq: Sequence) -> None:
        """Wait (FIFO) until the sequence may run; raises QueueFull or EngineDead."""
        if self.dead:
            raise EngineDead()
        if not self.waiting and (self._fits(seq) or self.running == 0):
            self._start(seq)
            return
        limit = self.cfg.max_num_queued
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFull()
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((fut, seq))
        try:
            await fut
        except asyncio.CancelledError:
            # Disconnected while waiting: leave the queue. If the slot was granted in the
            # same tick, the caller's release() gives it back.
            if not seq.admitted:
                self.waiting.remove((fut, seq))
            seq.finish_reason = "abort"
            raise
        if self.dead:
            raise EngineDead()

    def release(self, seq: Sequence) -> None:
        """The sequence left the batch (finished, aborted or failed): free its slot."""
        if not seq.admitted:
            return
        seq.admitted = False
        self.running -= 1
        self.used_blocks -= seq.blocks
        self._wake()

    def _wake(self) -> None:
        while self.waiting:
            fut, seq = self.waiting[0]
            if not (self._fits(seq) or self.running == 0):
                return
            self.waiting.popleft()
            self._start(seq)
            fut.set_result(None)

    # --- prefix cache ------------------------------------------------------------------

    def lookup_prefix(self, ids: list[int]) -> int:
        """Cached prompt tokens (whole blocks seen before), and remember this prompt's blocks."""
        if not self.cfg.prefix_caching:
            return 0
        bs = self.block_size
        full = (len(ids) - 1) // bs  # the last token is always computed, as in vLLM
        h = 0
        hits = 0
        missed = False
        for i in range(full):
            h = hash((h, tuple(ids[i * bs:(i + 1) * bs])))
            if not missed and h in self.prefix:
                self.prefix.move_to_end(h)
                hits += 1
            else:
                missed = True
                self.prefix[h] = None
        while len(self.prefix) > self.total_blocks:
            self.prefix.popitem(last=False)
        m = self.metrics
        m.prefix_cache_queries += len(ids)
        m.prefix_cache_hits += hits * bs
        return hits * bs

    # --- timing ------------------------------------------------------------------------

    def prefill_delay(self, seq: Sequence) -> float:
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

    # --- accounting --------------------------------------------------------------------

    def on_first_token(self, seq: Sequence) -> None:
        now = time.monotonic()
        seq.first_token = seq.last_token = now
        self.metrics.ttft.observe(now - seq.arrival)
        self.metrics.prompt_tokens += seq.prompt_tokens
        self.metrics.prompt_tokens_cached += seq.cached_tokens

    def on_token(self, seq: Sequence) -> None:
        """Count one generated token; grow the KV allocation every block_size tokens."""
        seq.generated += 1
        self.metrics.generation_tokens += 1
        if seq.generated > 1:
            now = time.monotonic()
            self.metrics.itl.observe(now - seq.last_token)
            seq.last_token = now
        if (seq.prompt_tokens + seq.generated) % self.block_size == 1 and seq.generated > 1:
            if self.used_blocks >= self.total_blocks:
                self.metrics.preemptions += 1  # vLLM would preempt; we only count it
            else:
                self.used_blocks += 1
                seq.blocks += 1

    def on_finish(self, seq: Sequence) -> None:
        m = self.metrics
        m.success[seq.finish_reason] = m.success.get(seq.finish_reason, 0) + 1
        m.e2e.observe(time.monotonic() - seq.arrival)
        m.req_prompt.observe(seq.prompt_tokens)
        m.req_gen.observe(seq.generated)
        if seq.finish_reason in ("stop", "length"):
            self.finished += 1

    def kv_usage(self) -> float:
        return min(1.0, self.used_blocks / self.total_blocks)

    def render_metrics(self) -> str:
        return self.metrics.render(self.running, len(self.waiting), self.kv_usage())

    def kill(self) -> None:
        """The engine core died: waiting requests fail now, running ones at their next step."""
        self.dead = True
        while self.waiting:
            fut, _ = self.waiting.popleft()
            if not fut.done():
                fut.set_result(None)  # admit() re-checks `dead` and raises
