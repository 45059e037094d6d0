"""The engine thread: FIFO order, cancellation, errors as values, shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from server.engine.types import EngineError, FinishEvent, GenerationRequest, TokenEvent, Usage
from server.engine.worker import EngineWorker
from tenancy.tenants import make_tenant
from tests.server.scripted_engine import ScriptedEngine

TENANT = make_tenant(b"s" * 32, "t1")


def _request(request_id: str) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, tenant=TENANT, session_id=None, messages=())


async def _drain(channel) -> list:
    return [event async for event in channel.events()]


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_engine_is_built_and_run_on_the_engine_thread() -> None:
    engine = ScriptedEngine()
    built_on: list[str] = []

    def factory() -> ScriptedEngine:
        built_on.append(threading.current_thread().name)
        return engine

    async def main() -> list:
        worker = EngineWorker(factory, name="engine-x")
        assert await worker.start() is engine
        events = await _drain(worker.submit(_request("r1")))
        stats = await worker.call(lambda e: e.cache_stats(None))
        await asyncio.to_thread(worker.stop)
        return [events, stats]

    events, stats = _run(main())
    assert built_on == ["engine-x"]
    assert engine.threads == {"engine-x"}
    assert stats == {"thread": "engine-x"}
    assert events == [TokenEvent("a", 0), TokenEvent("b", 1), TokenEvent("c", 2),
                      FinishEvent("length", Usage(3, 3, 1))]


def test_requests_are_served_in_arrival_order() -> None:
    engine = ScriptedEngine()

    async def main() -> list[list]:
        worker = EngineWorker(lambda: engine)
        await worker.start()
        channels = [worker.submit(_request(f"r{i}")) for i in range(5)]
        results = await asyncio.gather(*(_drain(c) for c in reversed(channels)))
        await asyncio.to_thread(worker.stop)
        return results

    results = _run(main())
    assert engine.served == ["r0", "r1", "r2", "r3", "r4"]
    assert all(r[-1] == FinishEvent("length", Usage(3, 3, 1)) for r in results)


def test_cancel_stops_the_running_request() -> None:
    engine = ScriptedEngine()

    async def main() -> list:
        worker = EngineWorker(lambda: engine)
        await worker.start()
        channel = worker.submit(_request("gate-1"))
        await asyncio.to_thread(engine.gate_entered.wait, 10)
        channel.cancel()
        engine.release.set()
        events = await _drain(channel)
        await asyncio.to_thread(worker.stop)
        return events

    assert _run(main()) == [FinishEvent("cancelled", Usage(3, 0, 0))]


def test_request_cancelled_while_queued_is_skipped() -> None:
    engine = ScriptedEngine()

    async def main() -> list:
        worker = EngineWorker(lambda: engine)
        await worker.start()
        first = worker.submit(_request("gate-1"))
        queued = worker.submit(_request("queued"))
        queued.cancel()
        engine.release.set()
        await _drain(first)
        events = await _drain(queued)
        await asyncio.to_thread(worker.stop)
        return events

    assert _run(main()) == [FinishEvent("cancelled", Usage(0, 0, 0))]
    assert engine.served == ["gate-1"]


@pytest.mark.parametrize(("request_id", "status", "code"), [
    ("raise-1", 500, "engine_error"),
    ("silent-1", 500, "engine_error"),
    ("error-1", 400, "context_length_exceeded"),
])
def test_failures_arrive_as_values_and_the_thread_survives(request_id: str, status: int, code: str) -> None:
    engine = ScriptedEngine()

    async def main() -> tuple[list, list]:
        worker = EngineWorker(lambda: engine)
        await worker.start()
        failed = await _drain(worker.submit(_request(request_id)))
        after = await _drain(worker.submit(_request("ok")))
        await asyncio.to_thread(worker.stop)
        return failed, after

    failed, after = _run(main())
    assert len(failed) == 1 and isinstance(failed[0], EngineError)
    assert (failed[0].status, failed[0].code) == (status, code)
    assert after[-1] == FinishEvent("length", Usage(3, 3, 1))


def test_call_propagates_exceptions() -> None:
    async def main() -> None:
        worker = EngineWorker(ScriptedEngine)
        await worker.start()
        with pytest.raises(KeyError, match="nope"):
            await worker.call(lambda e: {}["nope"])
        assert await worker.call(lambda e: e.model_id) == "scripted"
        await asyncio.to_thread(worker.stop)

    _run(main())


def test_factory_failure_is_raised_by_start() -> None:
    def factory() -> ScriptedEngine:
        raise FileNotFoundError("no model at /nowhere")

    async def main() -> EngineWorker:
        worker = EngineWorker(factory)
        with pytest.raises(FileNotFoundError, match="/nowhere"):
            await worker.start()
        return worker

    worker = _run(main())
    assert not worker.alive


def test_stop_cancels_running_and_answers_queued_with_503() -> None:
    engine = ScriptedEngine()

    async def main() -> tuple[list, list, list]:
        worker = EngineWorker(lambda: engine)
        await worker.start()
        running = worker.submit(_request("gate-1"))
        queued = worker.submit(_request("queued"))
        await asyncio.to_thread(engine.gate_entered.wait, 10)
        stopper = asyncio.create_task(asyncio.to_thread(worker.stop))
        while worker.alive:
            await asyncio.sleep(0.01)
        engine.release.set()
        await stopper
        late = await _drain(worker.submit(_request("late")))
        return await _drain(running), await _drain(queued), late

    running, queued, late = _run(main())
    assert running == [FinishEvent("cancelled", Usage(3, 0, 0))]
    assert [(e.status, e.code) for e in queued] == [(503, "shutting_down")]
    assert [(e.status, e.code) for e in late] == [(503, "shutting_down")]
    assert engine.served == ["gate-1"]
