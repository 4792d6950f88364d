"""engine=hf: OpenAI's /v1/completions and /v1/chat/completions (and /v1/models, /v1/steer/presets, /health) on
the HF engine, with FastAPI.

The engine generates on one thread of its own (steer.serve.worker), concurrent requests in one continuous batch
(a request joins it at the next step), each row edited and sampled as if its request were alone. Handlers run on
the event loop; tokens come back to them one by one, so a stream sends text as it is generated. A request whose
client has gone stops generating; on shutdown (Ctrl-C, SIGTERM) every request still running ends at once (503, or an
error event in a stream) and the engine's thread is joined before the process exits.

What is fed, so that a request equals `python -m steer engine=hf` on the same prompt and settings:
- a completion's prompt is encoded as the CLI encodes a prompt (`engine.encode`: raw text, the tokenizer's own
  special tokens such as a BOS), and generated in the engine's batches as `HFEngine.generate_many` generates;
- a chat completion's messages go through the tokenizer's chat template if it has one (with the assistant's
  generation prompt, tokenized without added special tokens, as steer.models.prompt renders a chat prompt), else through
  `protocol.plain_chat_template`: the contents joined by newlines after the tokenizer's leading special tokens, so
  one user message is fed exactly as the CLI feeds that prompt raw. engine=vllm uses the same template.
"""

import asyncio
import json
import logging
import secrets
import time
import uuid
from contextlib import suppress
from typing import Dict, List, Optional, Tuple

from steer.config.schema import GenConf
from steer.serve import requests
from steer.serve.presets import Preset, compose
from steer.serve.protocol import InlinePolicy, RequestError, plain_chat_template, read_body
from steer.serve.worker import EngineWorker, ServerClosing
from steer.edits.tap import Tap

log = logging.getLogger("steer.serve")
DISCONNECT_POLL_S = 0.25  # how often a request waiting for its whole answer asks whether its client is still there


class TextStream:
    """Text of the tokens so far, sent in pieces that always add up to the final text: a piece stops short of
    an incomplete character and of anything that may start a stop string; the text ends before the first stop
    string (OpenAI's `stop`)."""

    def __init__(self, decode, stops: List[str]):
        self.decode, self.stops = decode, stops
        self.ids: List[int] = []
        self.sent = ""
        self.stopped = False

    def push(self, tok: int) -> str:
        self.ids.append(tok)
        text = self.decode(self.ids)
        cut = _first_stop(text, self.stops)
        if cut is not None:
            self.stopped = True
            return self._emit(text[:cut])
        safe = text.rstrip("\ufffd")  # a character whose bytes are not all generated yet
        return self._emit(safe[: len(safe) - _held(safe, self.stops)])

    def text(self) -> str:
        """The final text: up to the first stop string, without a last character whose bytes were not all
        generated (vLLM's detokenizer leaves it out too, so both servers answer alike)."""
        text = self.decode(self.ids)
        cut = _first_stop(text, self.stops)
        return text.rstrip("\ufffd") if cut is None else text[:cut]

    def finish(self) -> str:
        return self._emit(self.text())

    def _emit(self, text: str) -> str:
        if len(text) > len(self.sent) and text.startswith(self.sent):
            delta, self.sent = text[len(self.sent):], text
            return delta
        return ""


def _first_stop(text: str, stops: List[str]) -> Optional[int]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _held(text: str, stops: List[str]) -> int:
    """Characters at the end of `text` that may be the start of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class HFServer:
    def __init__(self, engine, presets: Dict[str, Preset], listing: list, model_name: str, max_steer_scale: float,
                 chat_max_tokens: int, inline_taps: Optional[Dict[int, Tap]] = None, playground: bool = True,
                 recipe=None):
        self.engine, self.presets, self.listing = engine, presets, listing
        # layer -> its residual-stream tap, where a request's steer_vector may be added (serve.inline_layers)
        self.inline_taps = inline_taps or {}
        self.inline = InlinePolicy(engine.spec.hidden, tuple(sorted(self.inline_taps))) if self.inline_taps else None
        self.model_name, self.max_scale, self.chat_max_tokens = model_name, max_steer_scale, chat_max_tokens
        self.worker = EngineWorker(engine)
        self.created = int(time.time())
        tok = engine.tokenizer
        self.chat_template = None if getattr(tok, "chat_template", None) else plain_chat_template(tok)
        self.max_len, self.vocab = engine.max_len, engine.vocab_size
        # The page at / and its routes (steer.serve.playground); `recipe`: how a direction is read from lines
        self.playground, self.recipe = playground, recipe

    # --- requests -> what the engine runs --------------------------------------------------------------

    def _plan(self, req: requests.GenRequest):
        if not req.steer:
            return None
        return compose(self.presets, req.steer.names, req.steer.scale, req.steer.inline, self.inline_taps,
                       req.steer.when)

    def _check(self, req: requests.GenRequest, encoded: List[List[int]]) -> None:
        if req.model != self.model_name:
            raise RequestError("model", f"the model `{req.model}` does not exist; this server serves "
                                        f"`{self.model_name}`", status=404, code="model_not_found")
        for i, ids in enumerate(encoded):
            if len(ids) >= self.max_len:  # too long whatever max_tokens says
                field = "messages" if req.messages is not None else ("prompt" if len(encoded) == 1 else f"prompt[{i}]")
                raise RequestError(field, f"is {len(ids)} tokens; the model has {self.max_len} positions, and "
                                          f"the prompt must leave one to generate")
            if len(ids) + req.max_tokens > self.max_len:
                raise RequestError("max_tokens", f"the prompt's {len(ids)} tokens and max_tokens={req.max_tokens} "
                                                 f"need {len(ids) + req.max_tokens} positions; the model has "
                                                 f"{self.max_len}")
            if len(ids) + req.max_tokens > self.engine.bound.tokens:
                raise RequestError("max_tokens", f"the prompt's {len(ids)} tokens and max_tokens={req.max_tokens} "
                                                 f"need {len(ids) + req.max_tokens} positions; this server's batches "
                                                 f"hold {self.engine.bound.tokens} (hf.batch_tokens)")

    def _encode(self, prompt) -> List[int]:
        if isinstance(prompt, str):
            return list(self.engine.encode(prompt))
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            raise RequestError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab})")
        return list(prompt)

    def chat_ids(self, messages: List[Dict[str, str]]) -> List[int]:
        tok = self.engine.tokenizer
        text = tok.apply_chat_template(messages, chat_template=self.chat_template, add_generation_prompt=True,
                                       tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def _gen(self, req: requests.GenRequest) -> GenConf:
        return GenConf(max_new_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                       seed=req.seed if req.seed is not None else 0)

    def _seed(self, req: requests.GenRequest, i: int) -> int:
        # As the CLI seeds prompt i with gen.seed + i.
        return req.seed + i if req.seed is not None else secrets.randbelow(2 ** 62)

    async def run(self, ids: List[int], plan, req: requests.GenRequest, seed: int, name: str = ""):
        """Generate one continuation: yields (text piece, None) as tokens come, then (last piece, (finish_reason,
        tokens generated)). `name`: the choice's, for the log."""
        job = self.worker.submit(ids, plan, self._gen(req), seed, name)
        stream = TextStream(self.engine.decode, req.stop)
        try:
            async for kind, value in job.events():
                if kind == "token":
                    piece = stream.push(value)
                    if stream.stopped:
                        job.cancelled.set()
                    if piece:
                        yield piece, None
                    if stream.stopped:
                        break
                elif kind == "error":
                    raise value
            piece = stream.finish()
            reason = "stop" if stream.stopped or len(stream.ids) < req.max_tokens else "length"
            yield piece, (reason, len(stream.ids))
        finally:
            job.cancelled.set()  # a client gone, or a stop string met: the engine moves on

    async def generate(self, ids, plan, req, seed, name: str = "") -> Tuple[str, str, int]:
        text, reason, n = "", "length", 0
        async for piece, end in self.run(ids, plan, req, seed, name):
            text += piece
            if end:
                reason, n = end
        return text, reason, n

    # --- endpoints ----------------------------------------------------------------------------------------

    async def completions(self, body):
        """(request, each prompt's ids, plan) of a completion body; RequestError if it cannot be served."""
        req = requests.completion(body, self.presets, self.max_scale, self.inline)
        encoded = [self._encode(p) for p in req.prompts]
        self._check(req, encoded)
        return req, encoded, self._plan(req)

    async def chat(self, body):
        """(request, [the messages' ids], plan) of a chat completion body; RequestError if it cannot be served."""
        req = requests.chat(body, self.presets, self.max_scale, self.chat_max_tokens, self.inline)
        encoded = [self.chat_ids(req.messages)]
        self._check(req, encoded)
        return req, encoded, self._plan(req)


def build_app(server: HFServer):
    """The FastAPI app of `server`: OpenAI's completion endpoints, /v1/models, /v1/steer/presets and /health. It
    has no lifespan: steer.serve.hf_serve stops the engine's thread, at shutdown and once uvicorn has returned."""
    from fastapi import FastAPI

    app = FastAPI(title="steer serve (engine=hf)")
    _generation_routes(app, server)
    _info_routes(app, server)
    if server.playground:
        _playground_routes(app, server)
    _error_shape(app)
    return app


def _error_shape(app) -> None:
    """An unknown route or method answers in OpenAI's error shape, as every other error here does."""
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        body = _error_body(f"{request.method} {request.url.path}: {e.detail}", str(e.status_code),
                           "invalid_request_error")
        return JSONResponse(body, status_code=e.status_code, headers=getattr(e, "headers", None))


def _generation_routes(app, server: HFServer) -> None:
    from fastapi import Request

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(server, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(server, request, chat=True)


def _info_routes(app, server: HFServer) -> None:
    from fastapi.responses import JSONResponse

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "steer", "root": server.engine.spec.source}]}

    @app.get("/v1/steer/presets")
    async def presets():
        return {"object": "list", "data": server.listing}

    @app.get("/health")
    async def health():
        if not server.worker.thread.is_alive():
            return JSONResponse({"status": "engine thread stopped"}, status_code=503)
        return {"status": "ok", "generations": server.worker.jobs}  # running or waiting


def _playground_routes(app, server: HFServer) -> None:
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response

    from steer.runs.extract import Recipe
    from steer.serve import playground

    spec = server.engine.spec

    @app.get(playground.PAGE_PATH)
    async def page():
        return Response(playground.page(), media_type="text/html; charset=utf-8")

    @app.get(playground.INFO_PATH)
    async def info():
        return playground.info(server.model_name, spec.layers, spec.hidden, server.inline, server.max_scale, True)

    @app.post(playground.DIRECTION_PATH)
    async def direction(request: Request):
        try:
            body = await _parse(request)
            return await playground.answer_direction(body, server.inline, server.inline_taps,
                                                     server.recipe or Recipe(), server.worker.call)
        except RequestError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except ServerClosing as e:
            return JSONResponse(_error_body(str(e), "server_shutting_down"), status_code=503)
        except Exception as e:
            return _internal(e)


async def _serve(server: HFServer, request, chat: bool):
    """A completion's (chat: a chat completion's) response: one JSON body, or server-sent events if it streams."""
    from fastapi.responses import JSONResponse, StreamingResponse

    try:
        body = await _parse(request)
        req, encoded, plan = await (server.chat(body) if chat else server.completions(body))
    except RequestError as e:
        return JSONResponse(e.body(), status_code=e.status)
    except Exception as e:
        return _internal(e)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": server.model_name}
    if req.stream:
        return StreamingResponse(_sse(server, req, encoded, plan, dict(head), chat), media_type="text/event-stream")
    answer = asyncio.ensure_future(_choices(server, req, encoded, plan, chat, rid))
    try:
        while not (await asyncio.wait({answer}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():  # nobody will read it: the engine moves on to the next request
                log.info("client gone: %s cancelled", rid)
                return JSONResponse(_error_body("the client disconnected", "client_closed"), status_code=499)
        choices, done = answer.result()
    except ServerClosing as e:
        return JSONResponse(_error_body(str(e), "server_shutting_down"), status_code=503)
    except Exception as e:
        return _internal(e)
    finally:
        if not answer.done():  # a client gone, or this handler cancelled (uvicorn's shutdown)
            answer.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await answer
    return JSONResponse({**head, "choices": choices, "usage": _usage(sum(map(len, encoded)), done)})


async def _choices(server: HFServer, req, encoded, plan, chat: bool, rid: str) -> Tuple[List[dict], int]:
    """Each prompt's choice, generated one after the other, and the tokens generated in all."""
    choices, done = [], 0
    for i, ids in enumerate(encoded):
        text, reason, n = await server.generate(ids, plan, req, server._seed(req, i), f"{rid}#{i}")
        done += n
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": reason})
        else:
            choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": reason})
    return choices, done


async def _parse(request):
    raw = await request.body()
    try:
        return read_body(raw)
    except ValueError as e:
        raise RequestError(None, f"the request body is not valid JSON: {e}") from e


def _internal(e: Exception):
    from fastapi.responses import JSONResponse

    log.exception("request failed")
    return JSONResponse(_internal_body(e), status_code=500)


def _internal_body(e: Exception) -> dict:
    return _error_body(f"{type(e).__name__}: {e}", None, "internal_error")


def _error_body(message: str, code: Optional[str], kind: str = "server_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _sse(server: HFServer, req, encoded, plan, head: dict, chat: bool):
    """Server-sent events: one chunk per text piece, a last chunk per choice with its finish_reason, usage if
    asked (stream_options.include_usage), then `data: [DONE]`."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = dict(head, object=kind)

    def chunk(i: int, piece: Optional[str], reason: Optional[str], first: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": piece} if piece else {})
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": i, "text": piece or "", "logprobs": None, "finish_reason": reason}
        return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

    done = 0
    try:
        for i, ids in enumerate(encoded):
            if chat:
                yield chunk(i, None, None, first=True)
            async for piece, end in server.run(ids, plan, req, server._seed(req, i), f"{head['id']}#{i}"):
                if piece:
                    yield chunk(i, piece, None)
                if end:
                    done += end[1]
                    yield chunk(i, None, end[0])
        if req.include_usage:
            usage = _usage(sum(map(len, encoded)), done)
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
    except ServerClosing as e:  # the stream has started: the error goes in it
        yield f"data: {json.dumps(_error_body(str(e), 'server_shutting_down'))}\n\n"
    except Exception as e:
        log.exception("stream failed")
        yield f"data: {json.dumps(_internal_body(e))}\n\n"
    yield "data: [DONE]\n\n"
