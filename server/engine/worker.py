"""The engine thread: one thread owns the engine, a FIFO queue feeds it.

All MLX work happens on this thread (MLX streams are thread-local), including building the
engine, which is why the worker takes a factory rather than a built engine. HTTP handlers
submit a ``GenerationRequest`` and get a ``ResponseChannel`` back: the engine thread pushes
events into it with ``loop.call_soon_threadsafe`` and the handler awaits them on its event loop.
Failures travel as ``EngineError`` values; the engine thread itself never dies of a request.

Requests are served one at a time in arrival order (continuous batching comes later).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from server.engine.protocol import Engine
from server.engine.types import EngineError, EngineEvent, FinishEvent, GenerationRequest, Usage

log = logging.getLogger(__name__)

T = TypeVar("T")

SHUTDOWN_ERROR = EngineError(status=503, message="the server is shutting down",
                             type="server_error", code="shutting_down")


class ResponseChannel:
    """Events of one request, from the engine thread to the event loop that submitted it.

    Ends with exactly one terminal event (``FinishEvent`` or ``EngineError``). ``cancel()`` may be
    called from the event loop at any time: the engine sees it through its ``cancelled()``
    callable and stops at the next token; the channel still receives a terminal event.
    """

    __slots__ = ("request_id", "_loop", "_queue", "_cancel", "_terminal_sent", "_terminal_seen")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self._cancel = threading.Event()
        self._terminal_sent = False  # touched by the engine thread only
        self._terminal_seen = False  # touched by the event loop only

    def cancel(self) -> None:
        """Ask the engine to stop this request (client gone, stop string found)."""
        self._cancel.set()

    @property
    def is_cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def finished(self) -> bool:
        """Whether the consumer has received the terminal event."""
        return self._terminal_seen

    def deliver(self, event: EngineEvent) -> None:
        """Push one event (engine thread). Raises RuntimeError after the terminal event."""
        if self._terminal_sent:
            raise RuntimeError(
                f"request {self.request_id}: event {type(event).__name__} after the final event"
            )
        if isinstance(event, (FinishEvent, EngineError)):
            self._terminal_sent = True
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:
            # The submitting loop is closed: nobody will read this channel any more.
            self._cancel.set()

    @property
    def terminal_sent(self) -> bool:
        return self._terminal_sent

    async def get(self) -> EngineEvent:
        """The next event; waits for the engine."""
        event = await self._queue.get()
        if isinstance(event, (FinishEvent, EngineError)):
            self._terminal_seen = True
        return event

    async def events(self) -> AsyncIterator[EngineEvent]:
        """All events up to and including the terminal one."""
        while not self._terminal_seen:
            yield await self.get()


@dataclass(slots=True)
class _GenerateJob:
    request: GenerationRequest
    channel: ResponseChannel


@dataclass(slots=True)
class _CallJob(Generic[T]):
    fn: Callable[[Engine], T]
    future: asyncio.Future[T]
    loop: asyncio.AbstractEventLoop


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        # The loop is closed: the coroutine that waited for this answer no longer exists.
        log.debug("dropped an answer for a closed event loop")


def _resolve(future: asyncio.Future[T], value: T | None, error: BaseException | None) -> None:
    if future.done():  # the awaiting coroutine was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)  # type: ignore[arg-type]


class EngineWorker:
    """Owns the engine thread, its FIFO job queue and the engine built on it.

    Typical life: ``engine = await worker.start()``, many ``worker.submit(request)`` and
    ``await worker.call(fn)``, then ``worker.stop()`` (blocking; run it off the event loop).
    """

    def __init__(self, engine_factory: Callable[[], Engine], *, name: str = "vlmcache-engine") -> None:
        """Args:
            engine_factory: builds the engine; called on the engine thread.
            name: thread name (shows up in logs and stack dumps).
        """
        self._factory = engine_factory
        self._name = name
        self._jobs: queue.Queue[_GenerateJob | _CallJob | None] = queue.Queue()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        """The engine, once ``start`` has returned."""
        if self._engine is None:
            raise RuntimeError("engine worker not started")
        return self._engine

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs and accepts work."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    @property
    def pending(self) -> int:
        """Jobs waiting in the queue (not counting the one running)."""
        return self._jobs.qsize()

    async def start(self) -> Engine:
        """Start the engine thread, build the engine on it and return it.

        Raises:
            Exception: whatever the engine factory raised (the thread has then exited).
        """
        if self._thread is not None:
            raise RuntimeError("engine worker already started")
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[Engine] = loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(loop, ready), name=self._name,
                                        daemon=True)
        self._thread.start()
        return await ready

    def submit(self, request: GenerationRequest) -> ResponseChannel:
        """Queue a generation; call from the event loop that will read the channel."""
        channel = ResponseChannel(request.request_id, asyncio.get_running_loop())
        if not self.alive:
            channel.deliver(SHUTDOWN_ERROR)
            return channel
        self._jobs.put(_GenerateJob(request, channel))
        return channel

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread, in queue order, and return its result.

        Raises:
            RuntimeError: the worker is not running.
            Exception: whatever ``fn`` raised.
        """
        if not self.alive:
            raise RuntimeError("the engine worker is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put(_CallJob(fn, future, loop))
        return await future

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop accepting work, cancel the running request, answer queued ones with 503, join.

        Blocks up to ``timeout`` seconds for the running request to notice its cancellation.
        """
        if self._thread is None:
            return
        self._stopping.set()
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("engine thread did not stop within %s s", timeout)

    # --- engine thread -------------------------------------------------------------------

    def _run(self, loop: asyncio.AbstractEventLoop, ready: asyncio.Future[Engine]) -> None:
        try:
            engine = self._factory()
        except BaseException as exc:  # reported to start()'s caller, which re-raises it
            log.exception("building the engine failed")
            self._stopping.set()
            _post(loop, _resolve, ready, None, exc)
            return
        self._engine = engine
        _post(loop, _resolve, ready, engine, None)
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if isinstance(job, _GenerateJob):
                self._generate(engine, job)
            else:
                self._call(engine, job)
        self._drain()
        close = getattr(engine, "close", None)
        if callable(close):
            # Optional hook (not in the Engine protocol): flush writers, release files.
            close()

    def _drain(self) -> None:
        """Answer jobs that arrived after the stop sentinel."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, _GenerateJob):
                job.channel.deliver(SHUTDOWN_ERROR)
            elif isinstance(job, _CallJob):
                _post(
                    job.loop, _resolve, job.future, None, RuntimeError("the engine worker stopped"))

    def _generate(self, engine: Engine, job: _GenerateJob) -> None:
        channel = job.channel
        if self._stopping.is_set():
            channel.deliver(SHUTDOWN_ERROR)
            return
        if channel.is_cancelled:
            # The client left while the request waited in the queue: skip the work.
            channel.deliver(FinishEvent("cancelled", Usage(0, 0, 0)))
            return
        stopping = self._stopping

        def cancelled() -> bool:
            return channel.is_cancelled or stopping.is_set()

        try:
            engine.generate(job.request, channel.deliver, cancelled)
        except Exception as exc:
            log.exception("engine failed on request %s", job.request.request_id)
            if not channel.terminal_sent:
                channel.deliver(EngineError(
                    status=500, message=f"engine failure: {type(exc).__name__}: {exc}",
                    type="server_error", code="engine_error"))
        if not channel.terminal_sent:
            log.error("engine returned from request %s without a final event",
                      job.request.request_id)
            channel.deliver(EngineError(status=500, message="the engine ended the request "
                                        "without a result", type="server_error",
                                        code="engine_error"))

    def _call(self, engine: Engine, job: _CallJob) -> None:
        try:
            result = job.fn(engine)
        except Exception as exc:
            _post(job.loop, _resolve, job.future, None, exc)
        else:
            _post(job.loop, _resolve, job.future, result, None)
