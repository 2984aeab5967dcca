"""spmd.spawn's channel under attack from 127.0.0.1: idle connections, connections that
never prove the token, a rank with a wrong token, and a listener that does not know it.

The caller runs as a program of its own (written to tmp_path), so that it can lower its
descriptor limit without touching pytest's; it prints the address its ranks were given
(read from its launcher's environment, as any process of the user could) and waits for
"go" before it joins the job."""

from __future__ import annotations

import errno
import json
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time

import pytest
from _launch import ROOT, clean_env

from spmd.spawn.listener import HELLO_WAIT, MAX_PENDING
from spmd.spawn.protocol import (
    CALLER,
    CHALLENGE,
    HELLO,
    JOB,
    PROOF,
    RANK,
    frame,
    new_nonce,
    proof,
    proof_matches,
    recv_frame,
)

CALLER_PROGRAM = r'''
import importlib, json, os, resource, sys, time
import spmd


def nap(rank, seconds):
    time.sleep(seconds)
    return rank + 10


def launcher_address():
    """SPMD_SPAWN_ADDRESS in the environment of this process's child, the launcher.
    Children are found by their parent pid in /proc/PID/stat: /proc/self/task/*/children
    can miss one while processes come and go (proc(5): reliable only when they are
    frozen), as they do with other tests' jobs beside this one."""
    me = os.getpid()
    for _ in range(100):   # a few tries, in case the system is slow to list it
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) != me:
                        continue
                with open(f"/proc/{name}/environ", "rb") as e:
                    items = e.read().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue   # a process that has just ended
            for item in items:
                if item.startswith(b"SPMD_SPAWN_ADDRESS="):
                    return item.split(b"=", 1)[1].decode()
        time.sleep(0.05)
    raise SystemExit("no launcher with SPMD_SPAWN_ADDRESS below this process")


if __name__ == "__main__":
    seconds, fd_room, give_up = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    if give_up:   # seconds of failing accepts after which the caller gives up
        importlib.import_module("spmd.spawn.job")._ACCEPT_GIVE_UP = give_up
    ctx = spmd.spawn(nap, args=(seconds,), nprocs=2, join=False)
    print(json.dumps({"address": launcher_address()}), flush=True)
    assert sys.stdin.readline().strip() == "go"
    if fd_room >= 0:
        # Room for fd_room more descriptors (the ranks' two connections, a few strangers),
        # or for none.
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (len(os.listdir("/proc/self/fd")) - 1 + fd_room, hard))
    t0 = time.monotonic()
    try:
        ctx.join()
        out = {"results": ctx.results, "error": None}
    except BaseException as exc:
        out = {"results": None, "error": f"{type(exc).__name__}: {exc}"}
    out["seconds"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
'''


class Caller:
    """The caller program, started; ``address`` is where its ranks connect."""

    def __init__(self, tmp_path, seconds: float, fd_room: int = -1, give_up: float = 0):
        program = tmp_path / "caller.py"
        program.write_text(CALLER_PROGRAM)
        self.proc = subprocess.Popen(
            [sys.executable, str(program), str(seconds), str(fd_room), str(give_up)], cwd=ROOT,
            env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        seen = []   # the launcher shares the caller's stdout: skip what it says first
        while not (line := self.proc.stdout.readline()).startswith('{"address"'):
            seen.append(line)
            assert line, "".join(seen)
        host, _, port = json.loads(line)["address"].rpartition(":")
        self.address = (host, int(port))

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def outcome(self, timeout: float) -> dict:
        out, _ = self.proc.communicate(timeout=timeout)
        rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"results"')]
        assert rows, out
        return {**rows[0], "output": out}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def open_idle(address, count: int) -> list[socket.socket]:
    """``count`` connections to ``address`` that never send a byte (connects in flight:
    the ones beyond the backlog complete when the caller accepts)."""
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        code = sock.connect_ex(address)
        assert code in (0, errno.EINPROGRESS), os.strerror(code)
        socks.append(sock)
    return socks


def ended(sock: socket.socket) -> bool:
    """The caller closed ``sock`` (a nonblocking one, connected or still connecting)."""
    try:
        return sock.recv(1) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError as exc:   # reset: closed too; not connected yet: not
        return exc.errno != errno.ENOTCONN


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fd_room", [-1, 12], ids=["plenty_of_descriptors", "out_of_descriptors"])
def test_200_idle_connections_do_not_stop_a_spawn_of_2_ranks(tmp_path, fd_room):
    """200 connections that never say a word arrive while the job runs.  With descriptors
    to spare the caller holds MAX_PENDING of them and closes the oldest beyond; with room
    for 12 more it runs out (EMFILE) on the way, and makes room the same way.  Either way
    the job completes, and nothing raises an OSError."""
    caller = Caller(tmp_path, seconds=4.0, fd_room=fd_room)
    idle = []
    try:
        caller.go()
        idle = open_idle(caller.address, 200)
        # While the ranks nap, and before any idle connection's HELLO_WAIT is up, the
        # caller has closed all but the newest MAX_PENDING.
        limit = time.monotonic() + min(2.5, HELLO_WAIT - 1)
        while sum(map(ended, idle)) < 200 - MAX_PENDING and time.monotonic() < limit:
            time.sleep(0.05)
        closed = sum(map(ended, idle))
        row = caller.outcome(timeout=100)
        assert row["error"] is None, row["output"]
        assert row["results"] == [10, 11], row["output"]
        assert closed >= 200 - MAX_PENDING, (closed, row["output"])
        assert row["seconds"] < 60, row
    finally:
        for sock in idle:
            sock.close()
        caller.kill()


def processes_with(text: str) -> list[int]:
    """The processes whose environment holds ``text``."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(name))
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.timeout(120)
def test_a_caller_with_no_descriptor_to_spare_gives_up_saying_why_and_ends_the_launcher(
        tmp_path):
    """Not one descriptor left: no rank can be accepted.  The caller keeps serving, backs
    off, and after the give-up time (3 s here) join raises DistNetworkError naming the
    ranks, EMFILE and the limit; the launcher and the ranks are gone."""
    caller = Caller(tmp_path, seconds=0.0, fd_room=0, give_up=3.0)
    address = f"SPMD_SPAWN_ADDRESS={caller.address[0]}:{caller.address[1]}"
    try:
        assert processes_with(address), "the launcher's processes were not found"
        caller.go()
        row = caller.outcome(timeout=100)
        error = row["error"] or ""
        assert error.startswith("DistNetworkError: spawn: ranks [0, 1] of 2 could not connect "
                                "to this process: accepting connections has failed for "), error
        assert "(EMFILE)" in error and "RLIMIT_NOFILE" in error, error
        assert "was ended" in error, error
        assert 3 <= row["seconds"] < 30, row
        assert processes_with(address) == [], "processes of the job outlived join"
    finally:
        caller.kill()


@pytest.mark.timeout(120)
def test_connections_that_never_say_hello_are_dropped_by_their_deadline(tmp_path):
    """A silent connection, and one that takes the caller's proof and says nothing after,
    are closed HELLO_WAIT seconds after they came, while the job runs on."""
    caller = Caller(tmp_path, seconds=HELLO_WAIT + 3)
    try:
        caller.go()
        silent = socket.create_connection(caller.address, timeout=30)
        challenged = socket.create_connection(caller.address, timeout=30)
        challenged.sendall(frame(CHALLENGE, json.dumps({"nonce": new_nonce()}).encode()))
        t0 = time.monotonic()
        kind, _ = recv_frame(challenged)
        assert kind == PROOF
        ends = {}
        for name, sock in (("silent", silent), ("challenged", challenged)):
            ready, _, _ = select.select([sock], [], [], HELLO_WAIT + 10)
            assert ready, f"the {name} connection was kept past {HELLO_WAIT + 10} s"
            assert sock.recv(1) == b"", name
            ends[name] = time.monotonic() - t0
            sock.close()
        for name, seconds in ends.items():
            assert HELLO_WAIT - 0.5 < seconds < HELLO_WAIT + 2.5, (name, ends)
        row = caller.outcome(timeout=100)
        assert row["error"] is None and row["results"] == [10, 11], row["output"]
    finally:
        caller.kill()


@pytest.mark.timeout(120)
def test_a_rank_with_a_wrong_token_is_refused_and_gets_no_job(tmp_path):
    """It gets the caller's proof (which shows nothing of the token), and after its own
    wrong proof, the end of its connection: no JOB, not a byte of it.  The job's own
    ranks are not disturbed."""
    caller = Caller(tmp_path, seconds=2.0)
    try:
        caller.go()
        sock = socket.create_connection(caller.address, timeout=30)
        nonce = new_nonce()
        sock.sendall(frame(CHALLENGE, json.dumps({"nonce": nonce}).encode()))
        kind, body = recv_frame(sock)
        reply = json.loads(body)
        assert kind == PROOF and len(reply["proof"]) == 64, body
        wrong = "f" * 32
        assert not proof_matches(wrong, nonce, CALLER, reply["proof"])
        hello = {"rank": 0, "size": 2, "pid": os.getpid(), "host": socket.gethostname(),
                 "proof": proof(wrong, reply["nonce"], RANK)}
        sock.sendall(frame(HELLO, json.dumps(hello).encode()))
        sock.settimeout(30)
        rest = b""
        try:
            while chunk := sock.recv(1 << 16):
                rest += chunk
        except ConnectionResetError:
            pass
        assert rest == b"", f"a refused rank was sent {len(rest)} bytes: {rest[:40]!r}"
        sock.close()
        row = caller.outcome(timeout=100)
        assert row["error"] is None and row["results"] == [10, 11], row["output"]
    finally:
        caller.kill()


class Marker:
    """Unpickling one creates the file ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fake", ["wrong_proof", "job_first"])
def test_a_listener_without_the_token_gets_neither_it_nor_an_unpickle(tmp_path, fake):
    """A rank (python -m spmd.spawn.child, an MPI singleton) sent to a listener that does
    not know its token: it answers with a made-up proof, or skips the handshake, then
    sends a JOB whose unpickling would create a file.  The rank sends nothing but its
    challenge, unpickles nothing, and exits with status 4 saying why."""
    marker = str(tmp_path / "unpickled")
    token = new_nonce()
    server = socket.create_server(("127.0.0.1", 0))
    got = bytearray()

    def listen():
        conn, _ = server.accept()
        with conn:
            conn.settimeout(30)
            kind, body = recv_frame(conn)
            got.extend(frame(kind, body))
            if fake == "wrong_proof":
                conn.sendall(frame(PROOF, json.dumps(
                    {"proof": proof(new_nonce(), json.loads(body)["nonce"], CALLER),
                     "nonce": new_nonce()}).encode()))
            try:
                conn.sendall(frame(JOB, pickle.dumps({"path": [], "main": None,
                                                      "main_file": None,
                                                      "payload": pickle.dumps(Marker(marker))})))
                while chunk := conn.recv(1 << 16):
                    got.extend(chunk)
            except OSError:
                pass   # the rank closed first

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    try:
        address = f"127.0.0.1:{server.getsockname()[1]}"
        proc = subprocess.run(
            [sys.executable, "-m", "spmd.spawn.child"], cwd=ROOT, timeout=90,
            env=clean_env(SPMD_SPAWN_ADDRESS=address, SPMD_SPAWN_TOKEN=token),
            stdin=subprocess.DEVNULL, capture_output=True, text=True)
        thread.join(30)
    finally:
        server.close()
    assert proc.returncode == 4, (proc.returncode, proc.stderr)
    why = {"wrong_proof": "its proof that it knows the job's token does not match",
           "job_first": f"it sent a frame of kind {JOB} where the proof"}[fake]
    assert f"rank 0 refuses the listener at {address}: {why}" in proc.stderr, proc.stderr
    assert "nothing it sent was unpickled" in proc.stderr, proc.stderr
    assert not os.path.exists(marker)
    assert token.encode() not in got
    header = got[:9]
    assert header[0] == CHALLENGE and len(got) == 9 + int.from_bytes(header[1:], "big"), got
