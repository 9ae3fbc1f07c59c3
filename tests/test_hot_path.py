"""Per-step work that grew with the number of requests (issue 70, part 8), each shown
gone by counting: finishing a running request no longer scans the waiting queue, and
the server's engine thread finds expired requests in a heap of deadlines instead of
scanning every stream each step."""
from __future__ import annotations

import heapq
from collections import deque
from types import SimpleNamespace

import torch

from minillm.engine import LLMEngine
from minillm.model.loader import load_model
from minillm.sampling import SamplingParams
from minillm.serve.async_engine import AsyncEngine
from minillm.utils import bundled_model_path


class CountingDeque(deque):
    scans = 0

    def __contains__(self, item):
        CountingDeque.scans += 1
        return super().__contains__(item)


def test_a_finished_request_does_not_scan_the_waiting_queue():
    model = load_model(bundled_model_path(), dtype=torch.float32)
    engine = LLMEngine(model, max_num_seqs=2, kv_cache="slots")
    for i in range(300):
        engine.add_request([5, 6, 7 + i % 50], SamplingParams(max_tokens=2))
    engine.scheduler.waiting = CountingDeque(engine.scheduler.waiting)
    finished = 0
    while finished < 10:
        finished += sum(o.finished for o in engine.step())
    assert CountingDeque.scans == 0  # 10 finished, 290 still wait
    rid = next(iter(s.request_id for s in engine.scheduler.waiting))
    engine.abort(rid)  # one that waits: found in the queue, its memory noted
    assert CountingDeque.scans == 1 and rid not in {
        s.request_id for s in engine.scheduler.waiting}


class NoScan(dict):
    def items(self):
        raise AssertionError("every stream scanned")

    values = keys = __iter__ = items


def test_expired_requests_come_from_a_heap_not_a_scan():
    streams = NoScan({f"r{i}": object() for i in range(10_000)})
    dropped = []
    engine = SimpleNamespace(_streams=streams, request_timeout=1.0, _deadlines=[],
                             _drop=lambda rid, error, reason: dropped.append(
                                 (rid, reason)) or dict.pop(streams, rid))
    heapq.heappush(engine._deadlines, (0.0, "r5"))      # past
    heapq.heappush(engine._deadlines, (0.0, "gone"))    # finished before
    heapq.heappush(engine._deadlines, (1e12, "r7"))     # not yet
    AsyncEngine._expire(engine)
    assert dropped == [("r5", "timeout")]
    assert engine._deadlines == [(1e12, "r7")]
