"""OpenEnv environments (``openenv-core``, the standard of TRL, SkyRL and torchforge) as
``rollout.env``, driven by the built-in agent loop (``env_loop.run_env``).

``rollout.env`` names either
- a running server: its URL (``http://127.0.0.1:8000``), or several, comma-separated, which the
  episodes share;
- or an ``openenv.core.Environment`` subclass (``module:Class``), which each rollout worker
  serves itself on loopback with OpenEnv's ``create_app`` and reaches like any server.

Each episode opens its own session through OpenEnv's ``GenericEnvClient`` (a WebSocket).
Adapters (``rollout.env_adapter``, documented defaults in ``OpenEnvAdapter``) turn the dataset
row into ``reset``'s arguments, the model's text into the action and an observation into the
model's next context. A server allows one session unless its environment declares
``SUPPORTS_CONCURRENT_SESSIONS``: an episode that finds it full waits for a free session.
"""
from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import logging
import threading
import typing
import urllib.parse
from typing import Any

from hybridlab.errors import UserError
from hybridlab.user_code import load_object

INSTALL_HINT = "install the optional extra: pip install 'hybridlab[openenv]' (make install does)"
CONNECT_TIMEOUT_S = 10.0        # OpenEnv's own default, cut to rollout.agent_timeout_s when that is shorter
CAPACITY_CODE = "CAPACITY_REACHED"  # the server's answer when every session is taken
RETRY_S = (0.05, 1.0)           # first and longest wait before asking a full server again


def is_openenv_class(obj: Any) -> bool:
    """Return whether ``obj`` is a subclass of OpenEnv's ``Environment`` (checked by name, so
    that a plain text environment never imports openenv)."""
    return inspect.isclass(obj) and any(c.__name__ == "Environment" and c.__module__.startswith("openenv.")
                                        for c in obj.__mro__[1:])


def server_urls(value: str) -> list[str] | None:
    """Return the server URLs that ``rollout.env`` lists, or None when it names a class; raises
    UserError for a URL without a host."""
    if "://" not in value:
        return None
    urls = [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
    for url in urls:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https", "ws", "wss") or not parsed.hostname:
            raise UserError(f"rollout.env: {url!r} is not a server URL (http://HOST:PORT, or ws://, https://, wss://)")
    return urls


class OpenEnvAdapter:
    """The defaults between hybridlab's rows and text and an OpenEnv environment's types.
    Subclass it and name the subclass in ``rollout.env_adapter`` to change any of them."""

    def reset_kwargs(self, sample: dict) -> dict:
        """Return ``reset``'s keyword arguments for a dataset row: its ``extra_info["env_reset"]``
        (a dict), else none. The ``n`` episodes of a group share them."""
        return dict((sample.get("extra_info") or {}).get("env_reset") or {})

    def action(self, text: str, schema: dict) -> dict:
        """Return the action for the model's ``text``, given the action's JSON schema: the text
        itself when the action has exactly one string field (``metadata`` aside), else the text
        read as a JSON object of the action's fields. Raises ValueError when it is not one."""
        fields = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
        strings = [k for k, v in fields.items()
                   if "string" in [v.get("type"), *(a.get("type") for a in v.get("anyOf", []))]]  # str, Optional[str]
        if len(fields) == 1 and strings:
            return {strings[0]: text}
        start, end = text.find("{"), text.rfind("}")
        try:
            value = json.loads(text[start:end + 1]) if 0 <= start < end else None
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"the action has the fields {sorted(fields)}: the model must answer with a JSON"
                             " object of them (or set rollout.env_adapter)")
        return value

    def observation(self, observation: dict) -> str:
        """Return the model's next context for an observation (its fields without ``reward``,
        ``done`` and ``metadata``): the one field's value as text when there is one field, else
        the fields as JSON."""
        if len(observation) == 1:
            value = next(iter(observation.values()))
            return value if isinstance(value, str) else json.dumps(value)
        return json.dumps(observation, sort_keys=True)


def _generic_types(cls: type) -> tuple[type, type]:
    """Return the action and observation classes an Environment subclass declares, from its
    ``Environment[Action, Observation, State]`` base or the annotations of ``step``."""
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if len(args) == 3 and all(inspect.isclass(a) for a in args[:2]):
                return args[0], args[1]
    try:
        hints = typing.get_type_hints(cls.step)
    except Exception:  # an annotation that does not resolve: the types cannot be read from it
        hints = {}
    params = [p for p in inspect.signature(cls.step).parameters if p != "self"]
    found = (hints.get(params[0]), hints.get("return")) if params else (None, None)
    if all(inspect.isclass(t) for t in found):
        return found
    raise UserError(f"rollout.env: cannot tell {cls.__name__}'s action and observation types; declare it as"
                    f" class {cls.__name__}(Environment[MyAction, MyObservation, MyState])")


def _not_a_disconnect(record: logging.LogRecord) -> bool:
    """False for the error OpenEnv's server logs on every session a client ends: it closes a
    WebSocket that the client has already closed (openenv-core 0.3.0 with Starlette)."""
    exc = record.exc_info[1] if record.exc_info else None
    return type(exc).__name__ not in ("WebSocketDisconnect", "ClientDisconnected")


class LocalServer:
    """An Environment subclass served by OpenEnv's ``create_app`` on 127.0.0.1 (a free port), in
    a daemon thread of this process; one per class and process (``serve``)."""

    _served: dict[type, "LocalServer"] = {}
    _lock = threading.Lock()

    def __init__(self, cls: type, max_sessions: int, idle_s: float):
        import uvicorn
        from openenv.core.env_server import ConcurrencyConfig, create_app

        action_cls, observation_cls = _generic_types(cls)
        logging.getLogger("uvicorn.error").addFilter(_not_a_disconnect)
        sessions = max_sessions if getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False) else 1
        # a session idle longer than an episode may last is one whose episode ended (a hung step's):
        # OpenEnv's reaper frees it, or a one-session server would refuse every later episode
        limits = ConcurrencyConfig(max_concurrent_envs=sessions, session_timeout=idle_s or None)
        app = create_app(cls, action_cls, observation_cls, env_name=cls.__name__, concurrency_config=limits)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name=f"openenv-{cls.__name__}", daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise UserError(f"rollout.env: OpenEnv's server for {cls.__name__} did not start (see the log above)")
            self.thread.join(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url, self.sessions = f"http://127.0.0.1:{port}", sessions

    @classmethod
    def serve(cls, env_class: type, max_sessions: int, idle_s: float) -> "LocalServer":
        """Return the running server of ``env_class`` in this process, started on first use
        (``idle_s``: its sessions' idle limit, 0 for none)."""
        with cls._lock:
            if env_class not in cls._served:
                cls._served[env_class] = LocalServer(env_class, max_sessions, idle_s)
            return cls._served[env_class]


class OpenEnvConnector:
    """What ``rollout.env`` names when it is an OpenEnv environment: called once per episode
    (as a text environment class is), it returns that episode's ``OpenEnvSession``."""

    def __init__(self, urls: list[str], name: str, adapter: OpenEnvAdapter, sessions: int | None,
                 timeout_s: float):
        self.urls, self.__name__, self.adapter, self.timeout_s = urls, name, adapter, timeout_s
        self.sessions = sessions            # a local server's capacity; None for a URL (a full one refuses)
        self.schemas: dict[str, dict] = {}  # per URL: the action's JSON schema
        self._next = itertools.count()
        self._gates: dict[tuple[int, str], asyncio.Semaphore] = {}

    def __call__(self) -> "OpenEnvSession":
        return OpenEnvSession(self, self.urls[next(self._next) % len(self.urls)])

    def gate(self, url: str) -> asyncio.Semaphore | None:
        """Return the current event loop's session limit for ``url`` (None: unknown yet)."""
        if self.sessions is None:
            return None
        key = (id(asyncio.get_running_loop()), url)
        if key not in self._gates:
            self._gates = {k: v for k, v in self._gates.items() if k[0] == key[0]}  # an earlier rollout's loop
            self._gates[key] = asyncio.Semaphore(self.sessions)
        return self._gates[key]

    async def schema(self, url: str) -> dict:
        """Return the action's JSON schema from the server's ``/schema``, fetched once per URL."""
        if url not in self.schemas:
            import httpx

            http_url = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
            loopback = urllib.parse.urlparse(http_url).hostname in ("127.0.0.1", "localhost", "::1")
            timeout = min(CONNECT_TIMEOUT_S, self.timeout_s or CONNECT_TIMEOUT_S)
            # a proxy in the environment is not for loopback (OpenEnv's own client bypasses it there)
            async with httpx.AsyncClient(timeout=timeout, trust_env=not loopback) as http:
                answer = await http.get(f"{http_url}/schema")
                answer.raise_for_status()
                self.schemas[url] = answer.json()["action"]
        return self.schemas[url]


class OpenEnvSession:
    """One episode's session on an OpenEnv server, with a text environment's methods."""

    def __init__(self, connector: OpenEnvConnector, url: str):
        self.connector, self.url, self.client, self.slot = connector, url, None, None

    async def _connect(self, sample: dict) -> Any:
        from openenv.core.generic_client import GenericEnvClient
        from websockets.exceptions import ConnectionClosedOK

        timeout = self.connector.timeout_s
        wait = RETRY_S[0]
        while True:
            gate = self.connector.gate(self.url)
            if gate is not None:
                await gate.acquire()
                self.slot = gate  # recorded once taken: a timeout while waiting releases nothing
            connect_s = min(CONNECT_TIMEOUT_S, timeout or CONNECT_TIMEOUT_S)
            self.client = GenericEnvClient(self.url, connect_timeout_s=connect_s, message_timeout_s=timeout or None)
            try:
                return await self.client.reset(**self.connector.adapter.reset_kwargs(sample))
            except ConnectionClosedOK:
                pass  # a full server closes the session it refused, often before the reset is sent
            except RuntimeError as exc:
                if CAPACITY_CODE not in str(exc):
                    raise
            await self.close()  # full: wait for a session to end (the episode's own timeout bounds this)
            await asyncio.sleep(wait)
            wait = min(2 * wait, RETRY_S[1])

    async def reset(self, sample: dict) -> str:
        """Open the session, reset the environment with the row's arguments; returns the first
        observation as text."""
        await self.connector.schema(self.url)
        result = await self._connect(sample)
        return self.connector.adapter.observation(result.observation)

    async def step(self, text: str) -> tuple[str, float, bool]:
        """Send the model's text as an action; returns (observation text, reward, done), the
        reward 0 where the observation has none."""
        action = self.connector.adapter.action(text, self.connector.schemas[self.url])
        result = await self.client.step(action)
        reward = 0.0 if result.reward is None else float(result.reward)
        return self.connector.adapter.observation(result.observation), reward, bool(result.done)

    async def close(self) -> None:
        """End the session (closing its connection) and free its slot."""
        client, slot, self.client, self.slot = self.client, self.slot, None, None
        try:
            if client is not None:
                await asyncio.shield(client.close())  # a timeout cancelling the episode still closes it
        finally:
            if slot is not None:
                slot.release()


def load_openenv(value: str, adapter: str | None, max_in_flight: int, timeout_s: float,
                 serve: bool = True) -> OpenEnvConnector | None:
    """Return the connector for an OpenEnv ``rollout.env`` (a URL list, or an Environment
    subclass, served in this process when ``serve``: without it the connector only stands for
    the checked settings), or None when it names a plain text environment; raises UserError."""
    urls = server_urls(value)
    cls = None if urls else load_object(value, "rollout.env", "class")
    if urls is None and not is_openenv_class(cls):
        if adapter:
            raise UserError("rollout.env_adapter: adapts OpenEnv environments; rollout.env names a text environment")
        return None
    try:
        import openenv.core  # noqa: F401  (present: the optional extra is installed)
    except ImportError:
        raise UserError(f"rollout.env: an OpenEnv environment needs openenv-core; {INSTALL_HINT}") from None
    adapter_obj = OpenEnvAdapter()
    if adapter:
        adapter_cls = load_object(adapter, "rollout.env_adapter", "class")
        if not (inspect.isclass(adapter_cls) and issubclass(adapter_cls, OpenEnvAdapter)):
            raise UserError(f"rollout.env_adapter: {adapter!r} must name a subclass of"
                            " hybridlab.agents.openenv_env.OpenEnvAdapter")
        adapter_obj = adapter_cls()
    if urls:
        return OpenEnvConnector(urls, urls[0] if len(urls) == 1 else f"{len(urls)} servers", adapter_obj, None,
                                timeout_s)
    if not serve:
        _generic_types(cls)
        return OpenEnvConnector([], cls.__name__, adapter_obj, None, timeout_s)
    server = LocalServer.serve(cls, max_in_flight, timeout_s)
    return OpenEnvConnector([server.url], cls.__name__, adapter_obj, server.sessions, timeout_s)
