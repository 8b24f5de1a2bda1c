"""TinkerServer: the Tinker API over HTTP (aiohttp), as the unchanged ``tinker`` SDK speaks it.

    server = TinkerServer(load_settings(overrides=["model=tiny"])).start()   # a thread of its own
    print(server.base_url, server.api_key)   # TINKER_BASE_URL and TINKER_API_KEY for the SDK
    server.stop()

The SDK submits each operation, gets a ``request_id`` back at once, and polls
``/api/v1/retrieve_future`` for the result (``futures.py``). Training operations of a model run
in their ``seq_id`` order on one thread; sample requests queue and run together, in one vLLM
call, on another (``TinkerService.sample_many``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import secrets
import threading

from aiohttp import web

from hybridlab.errors import UserError
from hybridlab.telemetry.serving import free_port, is_loopback
from hybridlab.tinker import wire
from hybridlab.tinker.futures import FutureStore, Sequencer
from hybridlab.tinker.routes import add_routes
from hybridlab.tinker.service import TinkerService
from hybridlab.tinker.settings import ServiceSettings


class TinkerServer:
    """The HTTP front of a ``TinkerService``: sessions, futures, ordering and batching."""

    def __init__(self, settings: ServiceSettings, service: TinkerService | None = None):
        self.settings = settings.with_key().validate()
        self.api_key = self.settings.api_key
        self.service = service
        self.futures = FutureStore(self.settings.poll_s)
        self.train_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tinker-train")
        self.sample_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tinker-sample")
        self.sequencers: dict[str, Sequencer] = {}
        self.sessions: dict[str, dict] = {}
        self.counter = 0
        self.instance = secrets.token_hex(3)  # this server's part of every id it hands out
        self.loop: asyncio.AbstractEventLoop | None = None
        self.port = self.settings.port
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None  # set in the server's loop: it stops serving
        self._queue: asyncio.Queue | None = None

    @property
    def base_url(self) -> str:
        """The address the SDK's ``base_url`` (or ``TINKER_BASE_URL``) takes."""
        host = "127.0.0.1" if self.settings.host in ("0.0.0.0", "::") else self.settings.host
        return f"http://{host}:{self.port}"

    def new_id(self, prefix: str) -> str:
        """Return a fresh id (``prefix-SERVER-N``), unique across servers too: sessions name the
        training clients, and their ``tinker://`` folders share ``run_dir`` with other servers'."""
        self.counter += 1
        return f"{prefix}-{self.instance}-{self.counter}"

    # ------------------------------------------------------------------ running
    def app(self) -> web.Application:
        """Return the aiohttp application serving every route."""
        app = web.Application(middlewares=[self._auth_and_errors], client_max_size=256 << 20)
        add_routes(app, self)
        return app

    @web.middleware
    async def _auth_and_errors(self, request: web.Request, handler):
        if not hmac.compare_digest(request.headers.get("X-API-Key", ""), self.api_key):
            return web.json_response({"detail": "missing or wrong X-API-Key (the key the server printed at start)"},
                                     status=401)
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except UserError as exc:  # a request that cannot be served: a fatal 4xx with its reason
            return web.json_response({"detail": str(exc)}, status=400)

    async def _serve(self, ready: threading.Event) -> None:
        self.loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        if not self.port:
            self.port = free_port(self.settings.host)
        await web.TCPSite(runner, self.settings.host, self.port).start()
        batcher = asyncio.create_task(self._sample_batches())
        self._stopping = asyncio.Event()
        ready.set()
        await self._stopping.wait()
        batcher.cancel()
        await runner.cleanup()

    def start(self) -> "TinkerServer":
        """Start the service's workers (if not given) and serve in a thread of its own; returns
        self once the port accepts connections."""
        if not is_loopback(self.settings.host):
            print(f"warning: serving the Tinker API on {self.settings.host}: calls carry the API key in clear"
                  " text (plain HTTP); prefer 127.0.0.1 and an SSH tunnel")
        if self.service is None:
            self.service = TinkerService(self.settings).start()
        ready = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(ready),), daemon=True,
                                        name="tinker-server")
        self._thread.start()
        if not ready.wait(60):
            raise RuntimeError("the Tinker server did not start listening within 60 s")
        return self

    def stop(self, close_service: bool = True) -> None:
        """Stop serving and (``close_service``) the workers."""
        if self._thread is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(10)
        self.train_pool.shutdown(wait=False, cancel_futures=True)
        self.sample_pool.shutdown(wait=False, cancel_futures=True)
        if close_service and self.service is not None:
            self.service.close()

    # ------------------------------------------------------------------ operations
    def submit_training(self, model_id: str, seq_id: int | None, work, call: str | None = None) -> str:
        """Queue ``work`` (a blocking call) as training operation ``seq_id`` of ``model_id``;
        returns its request id (the same one again for a repeated ``seq_id``). ``call`` names it
        on the dashboard (None: ``work`` reports itself)."""
        sequencer = self.sequencers.setdefault(model_id, Sequencer())
        if seq_id is not None and seq_id in sequencer.seen:
            return sequencer.seen[seq_id]
        request_id = self.futures.create(self.new_id("req"))

        def timed():
            if call is None:
                return work()
            with self.service.timed(call, model=model_id):
                return work()

        async def run():
            await self.futures.run(request_id, self.loop.run_in_executor(self.train_pool, timed))

        sequencer.add(seq_id, request_id, run)
        return request_id

    def submit_sample(self, body: dict) -> str:
        """Queue a sample request for the next engine batch; returns its request id."""
        request_id = self.futures.create(self.new_id("req"))
        self._queue.put_nowait((request_id, body))
        return request_id

    async def _sample_batches(self) -> None:
        """Run queued sample requests together: everything that arrived while the previous
        batch ran goes into the next one."""
        while True:
            first = await self._queue.get()
            batch = [first]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            bodies = [body for _, body in batch]
            samplers = sorted({str(b.get("sampling_session_id")) for b in bodies})
            try:
                with self.service.timed("sample", requests=len(bodies), samplers=samplers):
                    answers = await self.loop.run_in_executor(self.sample_pool, self.service.sample_many, bodies)
            except Exception as exc:  # the engine failed: every request of the batch fails with it
                answers = [exc] * len(batch)
            for (request_id, _), answer in zip(batch, answers):
                if isinstance(answer, Exception):
                    self.futures.fail(request_id, answer)
                else:
                    self.futures.finish(request_id, wire.sample_response(answer), proto=True)
