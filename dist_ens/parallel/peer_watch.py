"""One line, at once, when a process of a multi-process run dies.

Without this, a survivor learns of a dead peer only where a collective fails (a
traceback of Gloo frames) or, if it is waiting elsewhere (e.g. at a checkpoint's
barrier), when the coordination service misses the peer's heartbeats: JAX then aborts
it with a C++ check failure and every thread's stack, 40-50 lines that do not say
which process was lost nor where to resume.

Every process other than 0 keeps a TCP connection open to process 0 (its port is
published in jax.distributed's key-value store). The kernel closes a process's
sockets however it ends, kill -9 included, so the other end sees it at once. A
process ending normally says 'bye' first (atexit, before jax.distributed's shutdown
barrier), so only an end without it counts as lost. Process 0, on losing process k,
tells the others 'lost k' and each process prints one line (naming k and the newest
intact checkpoint) and exits 1. A peer that hangs without dying is still left to the
heartbeat timeout.
"""

import atexit
import socket
import threading
from collections.abc import Callable

from absl import logging

_KEY = 'dist_ens/peer_watch'
_BYE, _LOST = b'bye\n', b'lost '
# Whoever says the run lost a process first (a watcher thread, or the main thread on a
# failed collective) holds this until the process exits: one line, not two.
_SAYING = threading.Lock()


def say_once_and_exit(line: str, exit_now: Callable[[str], None]) -> None:
  """Prints `line` via `exit_now` (which ends the process) unless another thread
  already is; then this thread waits for that exit."""
  _SAYING.acquire()
  exit_now(line)


def hold_saying() -> None:
  """Keeps the watch's threads from saying a loss (this process is saying an error
  of its own, which ends it)."""
  _SAYING.acquire()


_WATCHES: list['PeerWatch'] = []


def say_bye_now() -> None:
  """Says bye on every started watch: this process is ending on purpose."""
  for watch in _WATCHES:
    watch.say_bye()


class PeerWatch:
  """The watch of one process; start() it right after jax.distributed starts."""

  def __init__(self, client, me: int, count: int, coordinator_host: str,
               on_lost: Callable[[int, str], None], timeout_s: float):
    self._client, self._me, self._count = client, me, count
    self._host, self._on_lost, self._timeout_s = coordinator_host, on_lost, timeout_s
    self._peers: dict[int, socket.socket] = {}
    self._done: set[int] = set()  # Peers that said bye: their end is no loss.
    self._lock = threading.Lock()

  def start(self) -> None:
    """Connects the processes; a failure to (a port blocked) leaves the run unwatched."""
    try:
      if self._me == 0:
        self._listen()
      else:
        self._connect()
    except OSError as e:
      logging.warning('cannot watch the other processes (%s); a lost process will be '
                      'reported by JAX only.', e)
      return
    atexit.register(self.say_bye)
    _WATCHES.append(self)

  def _listen(self) -> None:
    server = socket.create_server(('', 0))
    self._client.key_value_set(_KEY, str(server.getsockname()[1]))
    server.settimeout(self._timeout_s)
    for _ in range(self._count - 1):
      conn, _ = server.accept()
      conn.settimeout(None)
      peer = int(conn.makefile('rb').readline())
      self._peers[peer] = conn
      threading.Thread(target=self._watch, args=(peer, conn), daemon=True).start()
    server.close()

  def _connect(self) -> None:
    port = int(self._client.blocking_key_value_get(_KEY, int(self._timeout_s * 1000)))
    conn = socket.create_connection((self._host, port), timeout=self._timeout_s)
    conn.settimeout(None)
    conn.sendall(f'{self._me}\n'.encode())
    self._peers[0] = conn
    threading.Thread(target=self._watch, args=(0, conn), daemon=True).start()

  def _watch(self, peer: int, conn: socket.socket) -> None:
    """Reads `peer`'s connection until it says bye, reports a loss, or ends."""
    try:
      for message in conn.makefile('rb'):
        if message == _BYE:
          with self._lock:
            self._done.add(peer)
          return
        if message.startswith(_LOST):  # Process 0 lost another one.
          self._on_lost(int(message[len(_LOST):]), 'process 0 saw its connection close')
          return
    except OSError:  # Reset rather than closed: ended all the same.
      pass
    with self._lock:
      if peer in self._done:
        return
    if self._me == 0:
      for other, other_conn in list(self._peers.items()):
        if other != peer:
          try:
            other_conn.sendall(_LOST + f'{peer}\n'.encode())
          except OSError:
            pass  # That one is gone too: its own end reports it.
    self._on_lost(peer, 'its connection closed')

  def say_bye(self) -> None:
    """A normal end: the others must not take this process's closing sockets for a loss."""
    for conn in list(self._peers.values()):
      try:
        conn.sendall(_BYE)
      except OSError:
        pass
