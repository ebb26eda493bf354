"""A Unix-domain socket beside the embedded engine's HTTP server, for the one call a colocated push makes.

Why: a mapped push (reflow.engines.weights.mapped) is one call in which the engine copies the trainer's
weights, ~0.6 ms of GPU work for a 0.99 GB model on an H200. Through HTTP (httpx, uvicorn, FastAPI, a
thread-pool hop) the call itself costs ~1 ms on top; a request and answer over a Unix socket to a thread
that waits for them costs ~0.03 ms (measured on this project's CPU machine: `health` 0.65 ms best, a
POST 0.86 ms, the socket 0.019 ms). A trainer on the engine's host uses the socket; anything else, and
any failure to reach it, takes HTTP, with the same answers.

Safe by default: the socket lives in a directory only the engine's user can enter (`mkdtemp`, 0700), is
itself 0600, answers nothing before a connection proves it holds the engine's API key (the same key HTTP
asks for, compared in constant time), and speaks JSON lines (never pickles), a line at most 64 KiB. It
serves only the operations the engine registers (`/reflow/update_weights_from_mapped` today).

Wire: one JSON object per line each way. First {"api_key", "instance"} -> {"success": true} (else an
error and the connection closes); then {"op", "body"} -> {"success": true, ...the operation's answer} or
{"success": false, "status": 400 | 404 | 500, "message"}. /server_info advertises {"path", "instance",
"host"} under LOCAL_CONTROL; a client uses it only on the same host (hostname) where the path exists.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable

LOCAL_CONTROL = "reflow_local_control"  # the /server_info key
MAX_LINE = 64 << 10
log = logging.getLogger(__name__)
Handler = Callable[[dict], dict]


class LocalControlError(RuntimeError):
    """The engine answered a local call with an error (`status`, `message`: what HTTP would have said)."""

    def __init__(self, status: int, message: str):
        self.status, self.message = status, message
        super().__init__(f"{status}: {message}")


def _send(conn: socket.socket, obj: dict) -> None:
    conn.sendall(json.dumps(obj).encode() + b"\n")


def _read(f) -> dict | None:
    """One JSON object line (None at end of stream); ValueError for a line too long or not an object."""
    line = f.readline(MAX_LINE + 1)
    if not line:
        return None
    if len(line) > MAX_LINE:
        raise ValueError(f"line longer than {MAX_LINE} bytes")
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    return obj


class LocalControlServer:
    """Listens on a fresh private socket path; one thread per connection runs `handlers[op](body)`.
    `errors`: exception types answered as 400 (the caller's fault), with the message `describe` makes of
    them: both as the HTTP endpoints answer them."""

    def __init__(self, api_key: str, handlers: dict[str, Handler], errors: tuple[type[BaseException], ...] = (),
                 describe: Callable[[BaseException], str] = str):
        self._key, self.handlers, self.errors, self.describe = api_key, handlers, errors, describe
        self.instance = uuid.uuid4().hex
        self.dir = tempfile.mkdtemp(prefix="reflow-engine-")  # 0700: only this user may even reach the socket
        self.path = os.path.join(self.dir, "control.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        os.chmod(self.path, 0o600)
        self.sock.listen(16)
        self._closed = False
        self._conns: set[socket.socket] = set()  # open connections: close() ends them too
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._accept, name="engine-local-control", daemon=True)
        self.thread.start()

    def info(self) -> dict:
        return {"path": self.path, "instance": self.instance, "host": socket.gethostname()}

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="engine-local-call", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f:
            try:
                hello = _read(f)
                if hello is None:
                    return
                key = hello.get("api_key")
                if not (isinstance(key, str) and hmac.compare_digest(key.encode(), self._key.encode())
                        and hello.get("instance") == self.instance):
                    _send(conn, {"success": False, "status": 401, "message": "wrong API key or engine instance"})
                    return
                _send(conn, {"success": True})
                while (req := _read(f)) is not None:
                    _send(conn, self._answer(req))
            except (OSError, ValueError) as e:  # the peer went away, or sent what is not a JSON-object line
                try:
                    _send(conn, {"success": False, "status": 400, "message": f"bad request line: {e}"})
                except OSError:
                    pass
            finally:
                with self._lock:
                    self._conns.discard(conn)

    def _answer(self, req: dict) -> dict:
        op, body = req.get("op"), req.get("body", {})
        handler = self.handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            return {"success": False, "status": 404, "message": f"unknown operation {op!r}; this engine serves "
                                                                f"{sorted(self.handlers)} here"}
        if not isinstance(body, dict):
            return {"success": False, "status": 400, "message": "body must be a JSON object"}
        try:
            return {"success": True, **handler(body)}
        except self.errors as e:
            return {"success": False, "status": 400, "message": self.describe(e)}
        except Exception as e:  # noqa: BLE001 - answered (and logged) as HTTP's 500 would be
            log.exception("local control %s failed", op)
            return {"success": False, "status": 500, "message": f"{type(e).__name__}: {e}"}

    def close(self) -> None:
        """Stop listening and end every open connection (a stopped engine answers nothing more here)."""
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        for c in [self.sock, *conns]:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class LocalControlClient:
    """One connection to an engine's local socket (`info` from its /server_info), made and proven on first use.
    Calls are serialized; `call` raises LocalControlError for an error answer, OSError when the socket
    cannot be used (the caller then takes HTTP)."""

    def __init__(self, info: dict, api_key: str, timeout: float):
        self.info, self._key, self.timeout = info, api_key, timeout
        self._conn: socket.socket | None = None
        self._file = None
        self.lock = threading.Lock()

    @staticmethod
    def usable(info) -> bool:
        """Whether `info` (a /server_info's LOCAL_CONTROL) names a socket on this host."""
        return (isinstance(info, dict) and info.get("host") == socket.gethostname()
                and isinstance(info.get("path"), str) and os.path.exists(info["path"]))

    def _connect(self) -> None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(self.timeout)
        try:
            conn.connect(self.info["path"])
            self._conn, self._file = conn, conn.makefile("rb")
            self._exchange({"api_key": self._key, "instance": self.info.get("instance")})
        except BaseException:
            self.close()
            raise

    def _exchange(self, obj: dict) -> dict:
        _send(self._conn, obj)
        try:
            answer = _read(self._file)
        except ValueError as e:
            raise OSError(f"unreadable answer from the engine's local socket: {e}") from e
        if answer is None:
            raise OSError("the engine closed its local socket")
        if not answer.get("success", False):
            raise LocalControlError(int(answer.get("status", 500)), str(answer.get("message")))
        return answer

    def call(self, op: str, body: dict) -> dict:
        with self.lock:
            if self._conn is None:
                self._connect()
            try:
                return self._exchange({"op": op, "body": body})
            except OSError:
                self.close()
                raise

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._conn is not None:
            self._conn.close()
        self._conn = self._file = None
