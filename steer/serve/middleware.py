"""engine=vllm: the ASGI middleware in front of vLLM's own OpenAI server that turns a request's steer arguments
into the tap worker's per-request edits, before vLLM parses the body.

vLLM hands `vllm_xargs` to `SamplingParams.extra_args` unchanged (values: strings, numbers or flat lists), and the
tap worker reads `extra_args["steer"]`. So on every JSON body this rewrites `vllm_xargs`: `steer` and
`steer_scale` (checked by steer.serve.protocol) become `steer`, the worker's entries as a JSON string, or nothing
when no edit is left. Bad steer arguments are answered 400 here and never reach vLLM. A body that tries to hand
the worker entries of its own (`extra_args` with a `steer...` key, as vLLM's token-in/token-out /inference/v1/generate
would pass on) is refused too, so the worker only ever sees entries this middleware wrote. The middleware also
answers GET /v1/steer/presets. It imports nothing from vLLM: a request's JSON is the version-robust seam
(vLLM's `--middleware` option installs it).
"""

import json
import os
from typing import Any, Optional

from steer.serve import playground
from steer.serve.protocol import RequestError, parse_steer, read_body
from steer.serve.stages import Translator

TABLE_ENV = "STEER_SERVE_TABLE"  # path of the Translator's JSON, for a middleware vLLM builds by its import path
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")


class SteerMiddleware:
    def __init__(self, app, translator: Optional[Translator] = None):
        self.app = app
        self.translator = translator if translator is not None else Translator.load(os.environ[TABLE_ENV])
        section = self.translator.table.get("playground") or {}
        # The page at / and its routes (steer.serve.playground), where serve.playground is on
        self.playground = playground.FromConf(section, self.translator.inline, self.translator.max_scale) \
            if section.get("enabled") else None

    async def _playground(self, method: str, path: str, receive, send) -> bool:
        """Answer the playground's routes; False for any other request."""
        if method == "GET" and path == playground.PAGE_PATH:
            await _send(send, 200, playground.page(), b"text/html; charset=utf-8")
            return True
        if method == "GET" and path.rstrip("/") == playground.INFO_PATH:
            await _json(send, 200, self.playground.info())
            return True
        if method == "POST" and path.rstrip("/") == playground.DIRECTION_PATH:
            try:
                body = await _read(receive)
                try:
                    data = read_body(body)
                except ValueError as e:
                    raise RequestError(None, f"the request body is not valid JSON: {e}") from e
                await _json(send, 200, await self.playground.direction(data))
            except RequestError as e:
                await _json(send, e.status, e.body())
            except Exception as e:  # noqa: BLE001 - answered as engine=hf answers it
                await _json(send, 500, {"error": {"message": f"{type(e).__name__}: {e}", "type": "internal_error",
                                                  "param": None, "code": None}})
            return True
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        method, path = scope.get("method", "GET"), scope.get("path", "")
        if method == "GET" and path.rstrip("/") == "/v1/steer/presets":
            return await _json(send, 200, {"object": "list", "data": self.translator.listing})
        if self.playground is not None and await self._playground(method, path, receive, send):
            return None
        if method != "POST" or _is_form(scope):
            return await self.app(scope, receive, send)
        body = await _read(receive)
        try:
            new = self.rewrite(path, body)
        except RequestError as e:
            return await _json(send, e.status, e.body())
        if new is not None:
            body = new
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
                         + [(b"content-length", str(len(body)).encode())])
        return await self.app(scope, _replay(body, receive), send)

    def rewrite(self, path: str, body: bytes) -> Optional[bytes]:
        """The body to hand vLLM (None: unchanged), or RequestError for a request to refuse."""
        try:
            data = read_body(body) if body else None
        except ValueError as e:  # also a body that is not UTF-8
            if path.rstrip("/") in OPENAI_PATHS:
                raise RequestError(None, f"the request body is not valid JSON: {e}") from e
            return None  # vLLM answers it
        if path.rstrip("/") in OPENAI_PATHS and not isinstance(data, dict):
            raise RequestError(None, "the request body must be a JSON object")
        changed = self._walk(data, "")
        return json.dumps(data).encode() if changed else None

    def _walk(self, node: Any, where: str, parent: str = "") -> bool:
        """Rewrite the request object `node` and any nested one (a dict with vllm_xargs); True if anything
        changed."""
        changed = False
        if isinstance(node, dict):
            if where == "" or "vllm_xargs" in node:
                changed |= self._request(node, where)
            for key, value in node.items():
                if key == "extra_args" and parent in ("", "sampling_params") and isinstance(value, dict) and any(
                        isinstance(k, str) and k.lower().startswith("steer") for k in value):
                    raise RequestError(f"{where}extra_args", "steer edits are asked for by preset name, in "
                                                             "vllm_xargs (steer, steer_scale, steer_vector, ...)")
                if isinstance(value, (dict, list)) and key != "vllm_xargs":
                    changed |= self._walk(value, f"{where}{key}.", key)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                changed |= self._walk(value, f"{where.rstrip('.')}[{i}].", parent)
        return changed

    def _request(self, req: dict, where: str) -> bool:
        t = self.translator
        args = parse_steer(req, t.presets, t.max_scale, where, t.inline)
        xargs = req.get("vllm_xargs")
        if not isinstance(xargs, dict) or not any(k.startswith("steer") for k in xargs):
            return False
        rest = {k: v for k, v in xargs.items() if not k.startswith("steer")}
        arg = t.steer_arg(args.names, args.scale, args.inline, args.when) if args is not None else None
        if arg is not None:
            rest["steer"] = arg
        if rest:
            req["vllm_xargs"] = rest
        else:
            del req["vllm_xargs"]
        return True


def _is_form(scope) -> bool:
    """A form upload (vLLM's audio endpoints, which a text model does not serve): passed on unread. Every other
    POST body is read as JSON whatever its content type says, so none reaches vLLM unchecked."""
    for k, v in scope.get("headers", []):
        if k.lower() == b"content-type":
            kind = v.split(b";")[0].strip().lower()
            return kind in (b"multipart/form-data", b"application/x-www-form-urlencoded")
    return False


async def _read(receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive that hands the app `body` once, then the client's own messages (a disconnect, for cancelling)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _json(send, status: int, payload: dict) -> None:
    await _send(send, status, json.dumps(payload).encode(), b"application/json")


async def _send(send, status: int, data: bytes, kind: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", kind), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
