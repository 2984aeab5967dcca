"""Stores and strangers: what another user or a careless client can do to a TCPStore
server, a FileStore file and a flight-recorder dump -- and must not.

All traffic stays on 127.0.0.1; no test opens more than 300 connections or sends more
than 64 MiB.  Servers that are measured or starved of descriptors run in a subprocess
(``tests/_store_helpers.py serve``), so that their memory and limits are their own.
"""

from __future__ import annotations

import json
import os
import select
import socket
import stat
import struct
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ROOT = os.path.dirname(HERE)
for _p in (HERE, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from spmd.core import flight_recorder  # noqa: E402
from spmd.core.errors import DistNetworkError, DistStoreError  # noqa: E402
from spmd.store import FileStore, TCPStore  # noqa: E402

pytestmark = pytest.mark.timeout(60)

SLACK = 1.5  # seconds allowed beyond a deadline on a loaded CI machine
TOKEN = "s3cret"
MAGIC = b"spmd-tcpstore-1"  # the protocol's HELLO magic, spoken by hand below
U32 = struct.Struct("!I")


def frame(code: int, *fields: bytes) -> bytes:
    """A protocol message: length, code byte, then length-prefixed fields."""
    body = bytes([code]) + b"".join(U32.pack(len(f)) + f for f in fields)
    return U32.pack(len(body)) + body


def hello(token: str = TOKEN) -> bytes:
    return frame(0, MAGIC, token.encode())


def read_reply(sock: socket.socket) -> tuple[int, list[bytes]]:
    """Read one reply (status, fields) in full."""
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            assert chunk, f"connection closed after {len(buf)} of {n} bytes"
            buf += chunk
        return buf

    (n,) = U32.unpack(exact(4))
    body, fields, off = exact(n), [], 1
    while off < n:
        (size,) = U32.unpack_from(body, off)
        fields.append(body[off + 4 : off + 4 + size])
        off += 4 + size
    return body[0], fields


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server hangs up within `timeout` (any error frame it sends is skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            return False
        try:
            if not sock.recv(4096):
                return True
        except ConnectionResetError:
            return True


class Served:
    """A TCPStore master in a subprocess, driven by commands (see _store_helpers.serve)."""

    def __init__(self, *options: str):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_store_helpers.py"), "serve", "127.0.0.1",
             "--token", TOKEN, *options],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())
        self.stderr = ""

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, f"the server process died on {command!r}: exit {self.proc.wait(10)}"
        return answer.strip()

    def stats(self) -> dict:
        return json.loads(self.ask("stats"))

    def close(self) -> int:
        """End the server; return its exit code (stderr is kept in self.stderr)."""
        try:
            _, self.stderr = self.proc.communicate("", timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, self.stderr = self.proc.communicate()
        return self.proc.returncode


@pytest.fixture
def served(request):
    made = []

    def start(*options: str) -> Served:
        s = Served(*options)
        made.append(s)
        return s

    yield start
    for s in made:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.communicate()


def connect_raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


# ----------------------------------------------------------------------------- TCPStore
def test_unauthenticated_giant_message_refused_without_reading_it(served):
    srv = served()
    # The length alone is refused, with a reason, before a byte of the body is read.
    with connect_raw(srv.port) as raw:
        raw.sendall(U32.pack(1 << 30))
        status, fields = read_reply(raw)
        assert status == 2 and b"handshake message of 1073741824 bytes refused" in fields[0], fields
        assert closed_by_server(raw, 5)
    rss_before = int(srv.ask("rss"))
    # Announce 1 GiB and push 64 MiB: the server must not keep any of it.
    sent = 0
    with connect_raw(srv.port) as raw:
        chunk = b"\0" * (1 << 20)
        try:
            raw.sendall(U32.pack(1 << 30))
            while sent < 64 << 20:
                raw.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # hung up on: what we expect
    grew_kib = int(srv.ask("rss")) - rss_before
    assert grew_kib < 4096, f"the server grew by {grew_kib} KiB after {sent >> 20} MiB from a stranger"
    assert sent < 64 << 20, "the server read 64 MiB from a client that never authenticated"
    assert srv.ask("ping") == "1"
    assert srv.close() == 0, srv.stderr


def test_trickling_client_dropped_at_one_handshake_deadline():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=30,
                      token=TOKEN, handshake_timeout=1.0)
    try:
        message = hello()
        with connect_raw(master.port) as raw:
            t0 = time.monotonic()
            dropped_at = None
            for byte in message[:-1]:  # a byte every 0.2 s: each read is quick, the whole is not
                raw.sendall(bytes([byte]))
                if select.select([raw], [], [], 0.2)[0]:
                    dropped_at = time.monotonic() - t0
                    break
            assert dropped_at is not None, "the server kept a client trickling its handshake"
            status, fields = read_reply(raw)
            assert status == 2 and fields[0] == b"handshake not completed within 1 s"
            assert closed_by_server(raw, 5)
        assert 0.9 <= dropped_at <= 1.0 + SLACK, dropped_at
        client = TCPStore("127.0.0.1", master.port, timeout=5, token=TOKEN)
        client.set("k", b"v")
        assert master.get("k") == b"v"
        assert master._server.joined == 2  # the master and `client`, not the trickler
        client.close()
    finally:
        master.close()


def test_idle_strangers_do_not_lock_out_a_worker(served):
    # 256 descriptors, as where this was found: 250 idle connections held one
    # descriptor and one thread each, and a worker with the token got no descriptor.
    srv = served("--nofile", "256")
    idle = [connect_raw(srv.port) for _ in range(250)]
    try:
        t0 = time.monotonic()
        worker = TCPStore("127.0.0.1", srv.port, timeout=10, token=TOKEN)
        worker.set("k", b"v")
        assert worker.get("k") == b"v"
        took = time.monotonic() - t0
        stats = srv.stats()
        assert stats["pending"] <= 64 and stats["joined"] == 2, stats
        assert stats["fds"] < 120, stats
        assert took < 5, f"the worker took {took:.1f} s to get in"
        # Oldest first: the first idle connection was given back, with the reason.
        status, fields = read_reply(idle[0])
        assert status == 2 and fields[0] == b"too many connections waiting for their handshake"
        assert closed_by_server(idle[0], 5)
        worker.close()
    finally:
        for s in idle:
            s.close()
    assert srv.close() == 0
    assert "file descriptors" not in srv.stderr, srv.stderr


def test_server_survives_running_out_of_descriptors(served):
    srv = served("--nofile", "48")
    assert srv.ask("ping") == "1"
    # Descriptors taken by something else in the process: nothing to give back, so the
    # server waits (a worker cannot get in) and comes back once they are free.
    assert int(srv.ask("hog")) > 0
    with pytest.raises(DistNetworkError, match="handshake with 127.0.0.1"):
        TCPStore("127.0.0.1", srv.port, timeout=1, token=TOKEN)
    assert srv.ask("ping") == "2"  # the master's own client still works
    srv.ask("free")
    worker = TCPStore("127.0.0.1", srv.port, timeout=10, token=TOKEN)
    worker.set("a", b"1")
    # Descriptors taken by strangers' idle connections: the oldest are given back.
    idle = [connect_raw(srv.port) for _ in range(80)]
    try:
        late = TCPStore("127.0.0.1", srv.port, timeout=10, token=TOKEN)
        assert late.get("a") == b"1"
        late.close()
    finally:
        for s in idle:
            s.close()
    again = TCPStore("127.0.0.1", srv.port, timeout=10, token=TOKEN)  # after the strangers left
    assert again.add("n", 1) == 1
    for s in (again, worker):
        s.close()
    assert srv.ask("ping") == "3"
    assert srv.close() == 0, srv.stderr
    assert srv.stderr.count("accept failed") == 1, srv.stderr  # reported once, not per accept


def test_authenticated_requests_capped_by_max_message_size():
    limit = 1 << 20
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10,
                      token=TOKEN, max_message_size=limit)
    try:
        client = TCPStore("127.0.0.1", master.port, timeout=10, token=TOKEN)
        with pytest.raises(ValueError, match=r"TCPStore.set: request of \d+ bytes is over the "
                                             r"max_message_size .* \(1048576 bytes\)"):
            client.set("big", b"x" * (2 << 20))
        client.set("small", b"ok")  # refused before sending: the connection is intact
        assert master.get("small") == b"ok"
        # A client that does not check is told, and hung up on.
        with connect_raw(master.port) as raw:
            raw.sendall(hello())
            assert read_reply(raw) == (0, [b"1048576"])
            raw.sendall(U32.pack(2 << 20))
            status, fields = read_reply(raw)
            assert status == 2 and fields[0] == (
                b"request of 2097152 bytes refused: this server's max_message_size is 1048576 bytes")
            assert closed_by_server(raw, 5)
        assert client.get("small") == b"ok"
        client.close()
    finally:
        master.close()


def test_tcpstore_limits_checked():
    with pytest.raises(ValueError, match="token must be at most 2048 bytes, got 2049"):
        TCPStore("127.0.0.1", 0, is_master=True, token=b"t" * 2049)
    with pytest.raises(ValueError, match="max_message_size must be positive, got 0"):
        TCPStore("127.0.0.1", 0, is_master=True, max_message_size=0)
    with pytest.raises(TypeError, match="max_message_size must be int, got float"):
        TCPStore("127.0.0.1", 0, is_master=True, max_message_size=1.5)
    with pytest.raises(ValueError, match="handshake_timeout must be a positive"):
        TCPStore("127.0.0.1", 0, is_master=True, handshake_timeout=0)


# ----------------------------------------------------------------------------- FileStore
_FSIZE_SCRIPT = r"""
import json, os, resource, signal, sys
sys.path.insert(0, sys.argv[2])
from spmd.core.errors import DistStoreError
from spmd.store import FileStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
path = sys.argv[1]
writer = FileStore(path, timeout=2)
writer.set("before", b"1")
size = os.path.getsize(path)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, hard))  # room for part of a record
try:
    writer.set("big", b"x" * 100)
    error = None
except DistStoreError as e:
    error = str(e)
size_after = os.path.getsize(path)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
writer.set("later", b"2")
fresh = FileStore(path, timeout=2)
print(json.dumps({
    "error": error, "size": size, "size_after": size_after,
    "fresh": [fresh.get("before").decode(), fresh.get("later").decode(), fresh.check(["big"])],
    "writer": [writer.get("later").decode(), writer.check(["big"])],
}))
"""


def test_filestore_failed_write_rolled_back(tmp_path):
    out = subprocess.run([sys.executable, "-c", _FSIZE_SCRIPT, str(tmp_path / "fs"), ROOT],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["error"] is not None and "writing 'big' failed" in r["error"], r
    assert "cut back to its last complete record" in r["error"], r
    assert r["size_after"] == r["size"], r
    assert r["fresh"] == ["1", "2", False], r  # every process sees the same log
    assert r["writer"] == ["2", False], r


def test_filestore_unfinished_record_skipped_then_cut_off(tmp_path):
    path = str(tmp_path / "fs")
    dead = FileStore(path, timeout=2)
    dead.set("k1", b"1")
    size = os.path.getsize(path)
    dead.set("victim", b"v" * 64)
    os.truncate(path, size + 20)  # its writer was killed in the middle of the record
    reader = FileStore(path, timeout=2)
    assert reader.get("k1") == b"1" and reader.check(["victim"]) is False
    reader.set("k2", b"2")  # cuts the unfinished record off before appending
    fresh = FileStore(path, timeout=2)
    assert fresh.get("k2") == b"2" and fresh.check(["victim"]) is False
    assert reader.get("k2") == b"2"


def test_filestore_corrupt_record_reported(tmp_path):
    path = tmp_path / "fs"
    FileStore(str(path)).set("k", b"value-one")
    data = bytearray(path.read_bytes())
    data[data.index(b"value-one")] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(DistStoreError, match=r"corrupt record at byte \d+ \(checksum mismatch\)"):
        FileStore(str(path))


def test_filestore_refuses_symbolic_link(tmp_path):
    target = tmp_path / "target"
    link = tmp_path / "link"
    os.symlink(target, link)
    with pytest.raises(DistStoreError, match="is a symbolic link; a FileStore does not follow"):
        FileStore(str(link))
    assert not target.exists()
    FileStore(str(target)).set("k", b"v")
    before = target.read_bytes()
    with pytest.raises(DistStoreError, match="is a symbolic link"):
        FileStore(str(link))
    assert target.read_bytes() == before


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's needs root")
def test_filestore_refuses_file_of_another_user(tmp_path):
    path = tmp_path / "fs"
    store = FileStore(str(path))
    store.set("k", b"v")
    os.chown(path, 65534, 65534)  # nobody
    with pytest.raises(DistStoreError, match=f"is owned by uid 65534, not by this process's uid {os.geteuid()}"):
        FileStore(str(path))
    with pytest.raises(DistStoreError, match="owned by uid 65534"):
        store.get("k")  # an open instance checks too, at every operation


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602])
def test_filestore_refuses_file_others_can_write(tmp_path, mode):
    path = tmp_path / "fs"
    FileStore(str(path)).set("k", b"v")
    os.chmod(path, mode)
    with pytest.raises(DistStoreError, match=f"writable by group or others \\(mode {mode:o}, expected 600\\)"):
        FileStore(str(path))
    os.chmod(path, 0o644)  # readable is the user's choice; writable is not
    assert FileStore(str(path)).get("k") == b"v"


def test_filestore_refuses_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(DistStoreError, match="is not a regular file"):
        FileStore(str(fifo))


# ----------------------------------------------------------------------------- flight recorder dump
def _old_temporary_name(path) -> str:
    """The name dumps used to write through: predictable by anyone who knows the pid."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")


def test_dump_never_writes_through_a_planted_file(tmp_path):
    path = str(tmp_path / "spmd_fr.rank0.json")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.link(victim, _old_temporary_name(path))  # a hard link where the temporary file went
    flight_recorder.write_private(path, '{"dump": 1}')
    assert victim.read_text() == "precious"
    assert open(path).read() == '{"dump": 1}'
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_dump_never_follows_a_planted_link(tmp_path):
    path = str(tmp_path / "spmd_fr.rank0.json")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, _old_temporary_name(path))
    flight_recorder.write_private(path, "one")  # the old code failed here (ELOOP)
    os.symlink(victim, tmp_path / "link")
    os.replace(tmp_path / "link", path)  # and a link at the dump's own name is replaced
    flight_recorder.write_private(path, "two")
    assert victim.read_text() == "precious"
    assert not os.path.islink(path) and open(path).read() == "two"


def test_dump_temporary_names_unpredictable(tmp_path, monkeypatch):
    path = str(tmp_path / "spmd_fr.rank0.json")
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((src, stat.S_IMODE(os.lstat(src).st_mode)))
        real_replace(src, dst)

    monkeypatch.setattr(flight_recorder.os, "replace", spy)
    for i in range(3):
        flight_recorder.write_private(path, str(i))
    names = [os.path.basename(src) for src, _ in seen]
    assert len(set(names)) == 3, names
    assert all(n.startswith(".spmd_fr.rank0.json.") and n.endswith(".tmp") for n in names), names
    assert _old_temporary_name(path) not in [src for src, _ in seen]
    assert all(mode == 0o600 for _, mode in seen), seen
    assert sorted(os.listdir(tmp_path)) == ["spmd_fr.rank0.json"]  # nothing left behind

