"""A bandwidth-throttling TCP forwarder on loopback, put between an S3 client and the S3-protocol server so that
an upload takes seconds, as on a slow link (a checkpoint of a few MB on loopback otherwise goes up in
milliseconds, and nothing can be seen or interrupted mid-transfer).

Bytes from the clients to the server go at ``rate`` bytes/s in all (one budget shared by every connection, as one
link); bytes back (responses, downloads) are not slowed. What a client sends is read at once into the forwarder's
buffer and paced out from there, so a client that closes its connection (it was killed, or gave up) is seen at
once: what it sent and the server has not received yet is dropped, and the server's side of that connection is
reset, so a request cut mid-body never completes on the server -- as when a machine dies with its upload in flight.

    proxy = ThrottledProxy("http://127.0.0.1:5000", rate=800_000)   # AWS_ENDPOINT_URL=proxy.url
"""

from __future__ import annotations

import collections
import socket
import struct
import threading
import time
from urllib.parse import urlsplit

CHUNK = 16 << 10


class _Link:
    """The shared budget: each chunk leaves at ``rate`` bytes/s after the chunks granted before it."""

    def __init__(self, rate: float):
        self.rate = float(rate)
        self._lock = threading.Lock()
        self._free_at = time.monotonic()

    def send_time(self, n: int) -> float:
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + n / self.rate
            return self._free_at


class ThrottledProxy:
    """Listens on 127.0.0.1 (a free port); ``url`` is what to give the client as its endpoint."""

    def __init__(self, upstream: str, rate: float):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.link = _Link(rate)
        self.cut = 0  # connections closed by their client with bytes not yet forwarded (dropped)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, name="throttle-accept", daemon=True).start()

    @property
    def rate(self) -> float:
        return self.link.rate

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            _Conn(self, client, server)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass


class _Conn:
    def __init__(self, proxy: ThrottledProxy, client: socket.socket, server: socket.socket):
        self.proxy, self.client, self.server = proxy, client, server
        self.buf: collections.deque[bytes] = collections.deque()
        self.cond = threading.Condition()
        self.client_gone = False
        self.done = False
        for target, name in ((self._read_client, "up-read"), (self._write_server, "up-write"), (self._down, "down")):
            threading.Thread(target=target, name=f"throttle-{name}", daemon=True).start()

    def _read_client(self) -> None:
        while True:
            try:
                data = self.client.recv(1 << 16)
            except OSError:
                data = b""
            with self.cond:
                if not data:
                    self.client_gone = True
                    if self.buf:
                        self.proxy.cut += 1
                    self.buf.clear()
                    self.cond.notify_all()
                    break
                self.buf.append(data)
                self.cond.notify_all()
        self._reset_server()

    def _write_server(self) -> None:
        while True:
            with self.cond:
                while not self.buf and not self.client_gone and not self.done:
                    self.cond.wait()
                if self.client_gone or self.done:
                    return
                data = self.buf.popleft()
                if len(data) > CHUNK:
                    self.buf.appendleft(data[CHUNK:])
                    data = data[:CHUNK]
            delay = self.proxy.link.send_time(len(data)) - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            with self.cond:
                if self.client_gone:  # the client died while this chunk waited for the link: never sent
                    return
            try:
                self.server.sendall(data)
            except OSError:
                self._close_client()
                return

    def _down(self) -> None:
        while True:
            try:
                data = self.server.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            try:
                self.client.sendall(data)
            except OSError:
                break
        with self.cond:
            self.done = True
            self.cond.notify_all()
        self._close_client()

    def _reset_server(self) -> None:
        try:  # RST, not FIN: the server sees the request cut, not a short body it might accept
            self.server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        try:
            self.server.shutdown(socket.SHUT_RD)  # wakes the reader of responses (sends nothing)
        except OSError:
            pass
        try:
            self.server.close()  # the RST goes once that reader has let go of the socket
        except OSError:
            pass

    def _close_client(self) -> None:
        try:
            self.client.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.client.close()
        except OSError:
            pass
