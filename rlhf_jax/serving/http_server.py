"""An OpenAI-compatible HTTP server on the rollout engine (standard library `http.server`).

    server = OpenAIServer(served, host="127.0.0.1", port=8000)   # starts the scheduler
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ...
    server.close()

Routes: `GET /v1/models`, `GET /v1/models/<id>`, `GET /health`, `POST /v1/completions`,
`POST /v1/chat/completions`. With `"stream": true` the answer comes as server-sent events,
`data: {chunk}` per batch of new tokens and `data: [DONE]` at the end, as OpenAI sends them.
Every request thread only queues its sequences; the scheduler thread alone runs the engine.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rlhf_jax.serving import openai_api as api
from rlhf_jax.serving.scheduler import Request, Scheduler

log = logging.getLogger(__name__)
MAX_BODY = 16 << 20
REQUEST_TIMEOUT = 600.0  # seconds without an event before a request gives up (504)


class _Choice:
    """The text of one choice, decoded as its tokens arrive (held back while the decoded
    text ends in an incomplete UTF-8 character)."""

    def __init__(self, served):
        self.served, self.ids, self.sent = served, [], ""
        self.finish: str | None = None

    def add(self, ids: list[int]) -> tuple[str, list[int]]:
        self.ids += ids
        text = self.served.decode(self.ids)
        if text.endswith("\ufffd") and self.finish is None:
            return "", ids
        delta, self.sent = text[len(self.sent):], text
        return delta, ids

    def flush(self) -> str:
        text = self.served.decode(self.ids)
        delta, self.sent = text[len(self.sent):], text
        return delta


class OpenAIServer(ThreadingHTTPServer):
    """`ThreadingHTTPServer` that answers OpenAI's API for one `ServedModel`.

    Args:
      served: the model (`rlhf_jax.serving.load_served_model`).
      host, port: where to listen (default loopback; port 0 picks a free one).
      rng: the key of every request's sampling.
      steps_per_call: generate steps between two streamed chunks.
    """

    daemon_threads = True

    def __init__(self, served, *, host: str = "127.0.0.1", port: int = 8000, rng=None,
                 steps_per_call: int = 8):
        self.served = served
        self.scheduler = Scheduler(served.engine, served.params, rng=rng,
                                   steps_per_call=steps_per_call)
        self.ids = itertools.count()
        self._ids_lock = threading.Lock()
        super().__init__((host, port), _Handler)
        self.scheduler.start()

    def close(self) -> None:
        """Stops serving, the scheduler and the socket."""
        self.shutdown()
        self.scheduler.stop()
        self.server_close()

    def request_ids(self, job: api.Job) -> list[int]:
        with self._ids_lock:
            return api.request_ids(job, self.ids)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: OpenAIServer

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        log.info("%s %s", self.address_string(), format % args)

    # ------------------------------------------------------------------------ plumbing

    def _send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, err: api.ApiError) -> None:
        if err.status in (411, 413):  # the body was not read: the connection cannot go on
            self.close_connection = True
        self._send_json(err.status, err.body())

    def _read_body(self):
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise api.ApiError(411, "a Content-Length header is required")
        if int(length) > MAX_BODY:
            raise api.ApiError(413, f"the request body exceeds {MAX_BODY} bytes")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except ValueError as e:
            raise api.ApiError(400, f"the request body is not valid JSON: {e}") from None

    def _model_card(self) -> dict:
        return {"id": self.server.served.name, "object": "model", "created": 0,
                "owned_by": "rlhf_jax"}

    # -------------------------------------------------------------------------- routes

    def do_GET(self):  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0].rstrip("/")
        name = self.server.served.name
        if path == "/health":
            self._send_json(200, {"status": "ok"})
        elif path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [self._model_card()]})
        elif path == f"/v1/models/{name}":
            self._send_json(200, self._model_card())
        elif path.startswith("/v1/models/"):
            self._error(api.ApiError(404, f"The model `{path[11:]}` does not exist", "model",
                                     "model_not_found"))
        else:
            self._error(api.ApiError(404, f"no route GET {path}", code="not_found"))

    def do_POST(self):  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")
        kind = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}.get(path)
        try:
            if kind is None:
                raise api.ApiError(404, f"no route POST {path}", code="not_found")
            job = api.parse(kind, self._read_body(), self.server.served)
            self._answer(job)
        except api.ApiError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # the server keeps serving whatever one request did
            log.exception("request failed")
            self._error(api.ApiError(500, f"{type(e).__name__}: {e}", kind="server_error"))

    # ------------------------------------------------------------------------- answers

    def _submit(self, job: api.Job) -> tuple[list[Request], queue.Queue]:
        events: queue.Queue = queue.Queue()
        rids = self.server.request_ids(job)
        reqs = [Request(prompt=job.prompts[c // job.n], sampling=job.sampling,
                        max_tokens=job.max_tokens, request_id=rid, index=c, events=events)
                for c, rid in enumerate(rids)]
        self.server.scheduler.submit(reqs)
        return reqs, events

    def _events(self, reqs, events):
        """(index, kind, value) of each event until every choice is done."""
        left = len(reqs)
        while left:
            try:
                kind, index, value = events.get(timeout=REQUEST_TIMEOUT)
            except queue.Empty:
                raise api.ApiError(504, f"no tokens for {REQUEST_TIMEOUT:.0f}s",
                                   kind="server_error") from None
            if kind == "error":
                raise api.ApiError(500, value, kind="server_error")
            left -= kind == "done"
            yield index, kind, value

    def _answer(self, job: api.Job) -> None:
        reqs, events = self._submit(job)
        served, model = self.server.served, self.server.served.name
        choices = [_Choice(served) for _ in reqs]
        try:
            if not job.stream:
                for index, kind, value in self._events(reqs, events):
                    if kind == "tokens":
                        choices[index].ids += value
                    else:
                        choices[index].finish = value
                answers = [(served.decode(c.ids), c.ids, c.finish) for c in choices]
                self._send_json(200, api.response(job, model, answers))
                return
            self._stream(job, reqs, events, choices, model)
        finally:
            for r in reqs:  # a client gone mid-answer frees its slots
                r.cancel()

    def _stream(self, job, reqs, events, choices, model) -> None:
        it = self._events(reqs, events)
        first = next(it, None)  # an error before the first token is still a JSON error
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(data: str) -> None:
            raw = f"data: {data}\n\n".encode()
            self.wfile.write(f"{len(raw):X}\r\n".encode() + raw + b"\r\n")
            self.wfile.flush()

        started = set()
        try:
            for index, kind, value in itertools.chain([first] if first else [], it):
                c = choices[index]
                if kind == "tokens":
                    text, ids = c.add(value)
                    finish = None
                else:
                    c.finish = value
                    text, ids, finish = c.flush(), [], value
                entry = api.choice(job, index, text, finish, ids=ids,
                                   first=index not in started, chunk=True)
                started.add(index)
                send(json.dumps(api.chunk(job, model, [entry])))
        except api.ApiError as e:  # after the headers: the error goes as an event
            send(json.dumps(e.body()))
        if job.include_usage:
            total = sum(len(c.ids) for c in choices)
            send(json.dumps(api.chunk(job, model, [], api.usage(job, total))))
        send("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def serve_http(served, *, host: str = "127.0.0.1", port: int = 8000, rng=None
               ) -> OpenAIServer:
    """An `OpenAIServer` listening (in a daemon thread) on host:port; `.close()` ends it."""
    server = OpenAIServer(served, host=host, port=port, rng=rng)
    threading.Thread(target=server.serve_forever, name="rlhf_jax-http", daemon=True).start()
    return server
