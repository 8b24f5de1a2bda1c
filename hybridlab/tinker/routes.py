"""The Tinker API's routes, as SDK 0.38.0 calls them (``/api/v1/...``).

Session calls answer at once; model, training, checkpoint and sampling calls answer a request
id, and their results come through ``retrieve_future`` (``futures.py``). A route the SDK has
but this server does not serve answers 404 with the SDK's error shape, naming it.
"""
from __future__ import annotations

import functools
from aiohttp import web

from hybridlab.errors import UserError
from hybridlab.tinker import wire
from hybridlab.tinker.losses import REFUSED

API = "/api/v1"
CLIENT_CONFIG = {  # the SDK's feature flags: plain HTTP/1.1 with httpx, no zstd, no server-side custom losses
    "pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False, "custom_loss_server_side": False, "sample_join_sampling_session": False,
    "parallel_fwdbwd_chunks": True}
NOT_SERVED = {  # the SDK's other routes, and why they are not served
    "save_weights_external": "external weights (hub uploads) are not served; sampler weights are saved in PEFT's"
                             " format under the server's run_dir",
    "create_custom_loss": REFUSED["custom"],
    "retrieve_futures": "batched future polling is off (client config sample_use_retrieve_futures=false)",
    "join_sampling_session": "joined sampling sessions are off (client config sample_join_sampling_session=false)",
    "auth/token": "JWT auth is off: the API key is sent as X-API-Key",
}
# the SDK's RestClient (runs, checkpoints, billing, audit): answered by the catch-all below
REST_ONLY = ("audit", "billing", "checkpoints", "copy_weights", "sessions", "training_runs", "weights_info")


async def _json(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError as exc:
        raise UserError(f"{request.path}: the body is not JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise UserError(f"{request.path}: expected a JSON object")
    return body


def add_routes(app: web.Application, server) -> None:
    """Add every route of the Tinker API, served by ``server`` (a ``TinkerServer``: the
    handlers below take it first)."""
    for path, handler in HANDLERS.items():
        app.router.add_post(f"{API}/{path}", functools.partial(handler, server))
    app.router.add_get(f"{API}/get_server_capabilities", functools.partial(capabilities, server))
    app.router.add_get(f"{API}/healthz", lambda _: web.json_response({"status": "ok"}))
    app.router.add_get(API + "/samplers/{sampler_id}", functools.partial(get_sampler, server))
    for path, why in NOT_SERVED.items():
        app.router.add_post(f"{API}/{path}", functools.partial(not_served, path, why))
    app.router.add_route("*", API + "/{tail:.*}", functools.partial(
        not_served, None, "this server serves the training and sampling calls; the RestClient's runs,"
                          " checkpoints and billing listings are not served"))


async def not_served(path: str | None, why: str, request: web.Request) -> web.Response:
    """Answer 404 naming the route and why it is not served."""
    path = path or request.match_info.get("tail", request.path)
    return web.json_response({"detail": f"{path} is not served by hybridlab's Tinker server: {why}"}, status=404)


# ---------------------------------------------------------------------- session calls
async def client_config(server, request):
    return web.json_response(CLIENT_CONFIG)


async def dynamic_config(server, request):
    return web.json_response({"refresh_interval_sec": 300, "sample_cancel_enabled": False})


async def create_session(server, request):
    body = await _json(request)
    session_id = server.new_id("session")
    server.sessions[session_id] = {"tags": body.get("tags", []), "finished": None}
    server.service.telemetry.emit("service", {"call": "create_session", "seconds": 0.0, "session": session_id})
    return web.json_response({"session_id": session_id, "type": "create_session"})


async def heartbeat(server, request):
    body = await _json(request)
    session = server.sessions.get(body.get("session_id"))
    if session is None or session["finished"]:
        return web.json_response({"detail": "session finished or unknown"}, status=410)
    return web.json_response({"type": "session_heartbeat"})


async def finish_session(server, request):
    body = await _json(request)
    session = server.sessions.get(request.match_info["session_id"])
    if session is not None:
        session["finished"] = (body.get("reason") or {}).get("type", "success")
    return web.json_response({})


async def telemetry(server, request):
    return web.json_response({"status": "accepted"})  # accepted and dropped


async def cancel_future(server, request):
    return web.json_response({})


async def capabilities(server, request):
    return web.json_response(server.service.capabilities())


async def retrieve(server, request):
    body = await _json(request)
    return await server.futures.retrieve(str(body.get("request_id")))


# ---------------------------------------------------------------------- models and training
def _model_id(body: dict) -> str:
    return f"{body['session_id']}:train:{body['model_seq_id']}"  # the SDK derives ids this way itself


async def create_model(server, request):
    body = await _json(request)
    model_id = _model_id(body)
    work = functools.partial(server.service.create_model, model_id, body.get("base_model"),
                             body.get("lora_config") or {}, body.get("optimizer_config"))
    return web.json_response({"request_id": server.submit_training(model_id, None, work, "create_model"),
                              "model_id": model_id})


async def get_info(server, request):
    body = await _json(request)
    return web.json_response(server.service.info(body.get("model_id", "")))


async def forward_backward(server, request):
    if request.headers.get("Content-Encoding"):
        raise UserError("compressed forward_backward bodies are off (client config proto_compress_fwdbwd=false)")
    call = wire.parse_forward_backward(await request.read())
    work = functools.partial(server.service.forward_backward, call)
    return web.json_response({"request_id": server.submit_training(call.model_id, call.seq_id, work)})


async def optim_step(server, request):
    body = await _json(request)
    if "adam_params" not in body:
        kind = (body.get("optimizer_params") or {}).get("type")
        raise UserError(f"optimizer {kind!r} is not served; this server steps with Adam (adam_params)")
    work = functools.partial(server.service.optim_step, body["model_id"], body["adam_params"])
    return web.json_response({"request_id": server.submit_training(body["model_id"], body.get("seq_id"), work)})


async def save_weights(server, request):
    body = await _json(request)
    work = functools.partial(server.service.save_state, body["model_id"], str(body.get("path") or "state"),
                             bool(body.get("overwrite")))
    request_id = server.submit_training(body["model_id"], body.get("seq_id"), work, "save")
    return web.json_response({"request_id": request_id})


async def save_for_sampler(server, request):
    body = await _json(request)
    model_id, name = body["model_id"], body.get("path")
    sampler_id = None if name else server.new_id("sampler")

    def work():
        adapter, path = server.service.save_for_sampler(model_id, name)
        if path is not None:
            return {"path": path, "type": "save_weights_for_sampler"}
        server.service.add_sampler(sampler_id, None, None, adapter)
        return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

    return web.json_response({"request_id": server.submit_training(model_id, body.get("seq_id"), work, "save")})


async def load_weights(server, request):
    body = await _json(request)
    optimizer = bool(body.get("optimizer"))
    if "model_id" in body:  # load_state on an existing client
        model_id, session = body["model_id"], None
    else:  # create_training_client_from_state: the model comes with the load
        model_id, session = _model_id(body), (body["session_id"], body["model_seq_id"])
    work = functools.partial(server.service.load_state, model_id, body["path"], optimizer, session)
    seq = body.get("seq_id") if session is None else None
    return web.json_response({"request_id": server.submit_training(model_id, seq, work, "load")})


# ---------------------------------------------------------------------- sampling
async def create_sampling_session(server, request):
    body = await _json(request)
    sampler_id = server.new_id("sampler")
    sampler = await server.loop.run_in_executor(server.sample_pool, server.service.add_sampler, sampler_id,
                                                body.get("base_model"), body.get("model_path"))
    return web.json_response({"sampling_session_id": sampler.sampler_id, "type": "create_sampling_session"})


async def get_sampler(server, request):
    sampler = server.service.samplers.get(request.match_info["sampler_id"])
    if sampler is None:
        raise UserError(f"unknown sampler {request.match_info['sampler_id']!r}")
    return web.json_response({"sampler_id": sampler.sampler_id, "base_model": server.service.base_model,
                              "model_path": sampler.model_path})


async def asample(server, request):
    body = await _json(request)
    request_id = server.submit_sample(body)
    n = int(body.get("num_samples", 1))
    return web.json_response({"request_id": request_id,
                              "sample_sequence_ids": [f"{request_id}-{i}" for i in range(n)]})


HANDLERS = {"client/config": client_config, "client/dynamic_config": dynamic_config,
            "create_session": create_session, "session_heartbeat": heartbeat,
            "sessions/{session_id}/finish": finish_session, "create_model": create_model, "get_info": get_info,
            "forward_backward": forward_backward, "optim_step": optim_step, "save_weights": save_weights,
            "save_weights_for_sampler": save_for_sampler, "load_weights": load_weights,
            "create_sampling_session": create_sampling_session, "asample": asample, "retrieve_future": retrieve,
            "telemetry": telemetry, "cancel_future": cancel_future}
