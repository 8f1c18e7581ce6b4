"""The step plan's transport: a TCP connection from process 0 to each follower. Process 0
listens on the coordinator's host at a port the system picks, and publishes it in
jax.distributed's key-value store, where the followers read it (a fixed port next to the
coordinator's can be taken: gloo opens many).

Why a socket and not `multihost_utils.broadcast_one_to_all`: a broadcast is a device collective,
so a dead follower leaves process 0 blocked inside it with nothing to time out, and it needs
fixed shapes (every call padded to the largest). Over a socket a dead follower's connection
closes at once, a silent one misses its heartbeats, and a stuck one leaves a call unacknowledged:
each is found within `timeout_s` by a thread that never waits on the devices.

Frames: kind (1 byte), length (4 bytes), payload. Process 0 sends CALL (a `Call`), BEAT when idle
and STOP; a follower sends HELLO (its process id) once, then BEAT every second and ACK after
each call it ran.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily

from moejax.serving.step_plan import Call

CALL, BEAT, STOP, HELLO, ACK = range(5)
_FRAME = struct.Struct("<BI")
BEAT_S = 1.0
TIMEOUT_S = 30.0  # a follower silent, or a call unacknowledged, this long is lost


KEY = "moejax/step_plan_address"


def _store():
    """jax.distributed's key-value store client (there is no public accessor in jax 0.10)."""
    from jax._src import distributed

    return distributed.global_state.client


def _send(sock: socket.socket, kind: int, payload: bytes = b"") -> None:
    sock.sendall(_FRAME.pack(kind, len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        piece = sock.recv(n - len(data))
        if not piece:
            raise ConnectionError("connection closed")
        data += piece
    return bytes(data)


def _recv(sock: socket.socket) -> tuple[int, bytes]:
    kind, n = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    return kind, _recv_exact(sock, n)


class Lost(Exception):
    """The other side of the step plan is gone."""


class Leader:
    """Process 0's end: `listen` before the warm-up, `accept` after it, then `send` every call."""

    def __init__(self, coordinator: str, followers: int, timeout_s: float = TIMEOUT_S):
        self.followers, self.timeout_s = followers, timeout_s
        self.server = socket.create_server((coordinator.rsplit(":", 1)[0], 0))
        _store().key_value_set(KEY, "{}:{}".format(*self.server.getsockname()[:2]))
        self.conns: dict[int, socket.socket] = {}
        self.heard: dict[int, float] = {}  # follower -> when it last sent anything
        self.acked: dict[int, int] = {}  # follower -> calls it has run
        self.sent_at: dict[int, float] = {}  # call index -> when it went out (until all acked)
        self.calls = self.bytes = 0  # calls sent and their bytes (to each follower)
        self.lost: str | None = None
        self.on_lost: Callable[[str], None] = lambda why: None
        self._lock, self._lost_lock = threading.Lock(), threading.Lock()

    def accept(self) -> None:
        """Waits for every follower's HELLO (each finished its warm-up), then starts watching them."""
        self.server.settimeout(max(self.timeout_s, 600.0))  # a follower's warm-up may lag process 0's
        while len(self.conns) < self.followers:
            sock, _ = self.server.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            kind, payload = _recv(sock)
            pid = int(payload)
            self.conns[pid], self.heard[pid], self.acked[pid] = sock, time.monotonic(), 0
        self.server.close()
        for pid in self.conns:
            threading.Thread(target=self._read, args=(pid,), name=f"moejax-follower-{pid}", daemon=True).start()
        threading.Thread(target=self._watch, name="moejax-followers", daemon=True).start()

    def send(self, call: Call) -> None:
        payload = call.to_bytes()
        with self._lock:
            if self.lost:
                raise Lost(self.lost)
            self.sent_at[self.calls] = time.monotonic()
            self.calls += 1
            self.bytes += len(payload)
            for pid, sock in self.conns.items():
                try:
                    _send(sock, CALL, payload)
                except OSError as e:
                    self._lose(pid, f"sending failed ({e})")
                    raise Lost(self.lost) from e

    def stop(self) -> None:
        """Every follower stops (after the calls sent so far) and exits."""
        with self._lock:
            for sock in self.conns.values():
                try:
                    _send(sock, STOP)
                except OSError:
                    pass

    def collect(self):
        """/metrics: the step plan's calls and bytes sent to each follower."""
        yield CounterMetricFamily("moejax_step_plan_calls", "program calls sent to each follower", value=self.calls)
        yield CounterMetricFamily("moejax_step_plan_bytes", "step plan bytes sent to each follower", value=self.bytes)

    def _lose(self, pid: int, why: str) -> None:
        """The first loss is the one reported (`on_lost`, once); the rest follow from it."""
        with self._lost_lock:
            if self.lost is not None:
                return
            self.lost = f"lost process {pid}: {why}"
        self.on_lost(self.lost)

    def _read(self, pid: int) -> None:
        sock = self.conns[pid]
        try:
            while True:
                kind, payload = _recv(sock)
                self.heard[pid] = time.monotonic()
                if kind == ACK:
                    self.acked[pid] = int(payload)
        except OSError as e:
            self._lose(pid, f"its connection closed ({e})")

    def _watch(self) -> None:
        while self.lost is None:
            time.sleep(BEAT_S / 2)
            now = time.monotonic()
            with self._lock:
                for pid in self.conns:
                    oldest = self.sent_at.get(self.acked[pid])
                    if now - self.heard[pid] > self.timeout_s:
                        self._lose(pid, f"silent for {self.timeout_s:.0f} s")
                    elif oldest is not None and now - oldest > self.timeout_s:
                        self._lose(pid, f"call {self.acked[pid]} unfinished after {self.timeout_s:.0f} s")
                for i in [i for i in self.sent_at if i < min(self.acked.values())]:
                    del self.sent_at[i]
                for pid, sock in self.conns.items():
                    try:
                        _send(sock, BEAT)
                    except OSError as e:
                        self._lose(pid, f"sending failed ({e})")


class FollowerLink:
    """A follower's end: connects, says HELLO, beats."""

    def __init__(self, process_id: int, timeout_s: float = TIMEOUT_S):
        self.timeout_s, self.done = timeout_s, 0
        host, port = (
            _store().blocking_key_value_get(KEY, 600_000).rsplit(":", 1)
        )  # process 0 listens before its warm-up
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except OSError as e:
            raise Lost(f"process 0's step plans at {host}:{port} did not answer ({e})") from e
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()
        with self._lock:
            _send(self.sock, HELLO, str(process_id).encode())
        threading.Thread(target=self._beat, name="moejax-beat", daemon=True).start()

    def calls(self):
        """Yields each call process 0 sends until STOP; raises Lost when it goes away or falls silent."""
        while True:
            try:
                kind, payload = _recv(self.sock)
            except (OSError, ConnectionError) as e:
                raise Lost(f"process 0 is gone ({e})") from e
            if kind == STOP:
                return
            if kind == CALL:
                yield Call.from_bytes(payload)

    def ack(self) -> None:
        self.done += 1
        with self._lock:
            _send(self.sock, ACK, str(self.done).encode())

    def _beat(self) -> None:
        while True:
            time.sleep(BEAT_S)
            try:
                with self._lock:
                    _send(self.sock, BEAT)
            except OSError:
                print("moejax serve: follower lost its connection to process 0", file=sys.stderr, flush=True)
                return
