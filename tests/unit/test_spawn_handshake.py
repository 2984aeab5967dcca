"""spmd.spawn's channel without MPI: the handshake's pieces (spmd.spawn.protocol), the
caller's listener (spmd.spawn.listener) against hand-made peers on 127.0.0.1, and where
the caller listens (spmd.spawn.launcher.caller_host)."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import threading
import time

import pytest

from spmd.spawn import launcher as launcher_mod
from spmd.spawn.launcher import HOST_VAR, SRUN, Launcher, caller_host, first_node
from spmd.spawn.listener import Listener
from spmd.spawn.protocol import (
    CALLER,
    CHALLENGE,
    HELLO,
    JOB,
    PROOF,
    RANK,
    HandshakeError,
    frame,
    new_nonce,
    proof,
    proof_matches,
    rank_handshake,
    recv_frame,
)

TOKEN = "0123456789abcdef0123456789abcdef"
HELLO_FIELDS = {"rank": 0, "size": 1, "pid": 1234, "host": "h"}


class Marker:
    """Unpickling one creates the file ``path``: proof that something was unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def frames_in(data: bytes) -> list[tuple[int, bytes]]:
    from spmd.spawn.protocol import FrameReader
    reader = FrameReader()
    out = reader.feed(data)
    assert reader.pending() == 0, f"{reader.pending()} bytes of an unfinished frame"
    return out


# -- the proofs ------------------------------------------------------------------------
def test_a_proof_is_bound_to_token_nonce_and_end_and_does_not_show_the_token():
    nonce = new_nonce()
    mine = proof(TOKEN, nonce, CALLER)
    assert TOKEN not in mine and len(mine) == 64
    assert proof_matches(TOKEN, nonce, CALLER, mine)
    assert not proof_matches(TOKEN, nonce, RANK, mine)             # not the other end's
    assert not proof_matches(TOKEN, new_nonce(), CALLER, mine)     # not another nonce's
    assert not proof_matches("f" * 32, nonce, CALLER, mine)        # not another token's
    assert not proof_matches(TOKEN, nonce, CALLER, None)
    assert not proof_matches(TOKEN, nonce, CALLER, TOKEN)


# -- the rank's half, against hand-made callers ----------------------------------------
def run_rank_half(caller, deadline_s: float = 5.0):
    """rank_handshake on one end of a socket pair, ``caller(sock)`` on the other (in a
    thread); what the rank's half returned or raised, and every byte the caller got."""
    rank_end, caller_end = socket.socketpair()
    got = bytearray()

    def serve():
        try:
            caller(caller_end, got)
        finally:
            caller_end.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        outcome = rank_handshake(rank_end, TOKEN, HELLO_FIELDS, time.monotonic() + deadline_s)
    except Exception as exc:  # noqa: BLE001 - the test looks at what came
        outcome = exc
    finally:
        rank_end.close()
        thread.join(10)
    assert not thread.is_alive(), "the hand-made caller did not finish"
    return outcome, bytes(got)


def read_challenge(sock, got) -> str:
    kind, body = recv_frame(sock)
    got += frame(kind, body)
    assert kind == CHALLENGE, kind
    return json.loads(body)["nonce"]


def drain(sock, got):
    """Take what comes until the other end closes (a reset, from unread data, as well)."""
    sock.settimeout(5)
    try:
        while chunk := sock.recv(1 << 16):
            got += chunk
    except ConnectionResetError:
        pass


def test_the_rank_proves_itself_only_after_the_caller_did():
    said = {}

    def caller(sock, got):
        nonce = read_challenge(sock, got)
        said["nonce"] = new_nonce()
        sock.sendall(frame(PROOF, json.dumps({"proof": proof(TOKEN, nonce, CALLER),
                                              "nonce": said["nonce"]}).encode()))
        drain(sock, got)

    outcome, got = run_rank_half(caller)
    assert outcome is True
    frames = frames_in(got)
    assert [k for k, _ in frames] == [CHALLENGE, HELLO], frames
    hello = json.loads(frames[1][1])
    assert proof_matches(TOKEN, said["nonce"], RANK, hello["proof"]), hello
    assert {k: hello[k] for k in HELLO_FIELDS} == HELLO_FIELDS
    assert TOKEN.encode() not in got


@pytest.mark.parametrize("fake", ["wrong_proof", "job_first", "reflected_proof", "huge_frame"])
def test_a_caller_that_cannot_prove_the_token_gets_nothing_and_nothing_is_unpickled(
        fake, tmp_path):
    marker = str(tmp_path / "unpickled")
    job = frame(JOB, pickle.dumps(Marker(marker)))

    def caller(sock, got):
        nonce = read_challenge(sock, got)
        if fake == "wrong_proof":
            answer = proof("f" * 32, nonce, CALLER)
        elif fake == "reflected_proof":   # what a rank would answer to the same nonce
            answer = proof(TOKEN, nonce, RANK)
        if fake in ("wrong_proof", "reflected_proof"):
            sock.sendall(frame(PROOF, json.dumps({"proof": answer,
                                                  "nonce": new_nonce()}).encode()))
        elif fake == "huge_frame":
            sock.sendall(frame(PROOF, b"")[:1] + (1 << 40).to_bytes(8, "big"))
        try:
            sock.sendall(job)
        except OSError:
            pass   # the rank closed its end: fine
        drain(sock, got)

    outcome, got = run_rank_half(caller)
    assert isinstance(outcome, HandshakeError), outcome
    expected = {"wrong_proof": "does not match", "reflected_proof": "does not match",
                "job_first": f"kind {JOB} where the proof", "huge_frame": "announces"}[fake]
    assert expected in str(outcome), outcome
    assert [k for k, _ in frames_in(got)] == [CHALLENGE]   # no HELLO, no proof of its own
    assert TOKEN.encode() not in got
    assert not os.path.exists(marker)


def test_a_caller_that_closes_before_answering_means_connect_again():
    def caller(sock, got):
        read_challenge(sock, got)

    outcome, _ = run_rank_half(caller)
    assert outcome is False


def test_a_silent_caller_is_given_up_on_by_the_deadline():
    def caller(sock, got):
        read_challenge(sock, got)
        drain(sock, got)   # until the rank gives up and closes

    t0 = time.monotonic()
    outcome, _ = run_rank_half(caller, deadline_s=0.5)
    assert isinstance(outcome, TimeoutError), outcome
    assert 0.4 < time.monotonic() - t0 < 5


# -- the caller's listener, against hand-made ranks -------------------------------------
class Served:
    """A Listener on 127.0.0.1 served in the test's own loop."""

    def __init__(self, **kwargs):
        self.listener = Listener("127.0.0.1", TOKEN, backlog=512, **kwargs)
        host, _, port = self.listener.address.rpartition(":")
        self.address = (host, int(port))
        self.arrivals: list = []

    def serve_until(self, done, seconds: float):
        limit = time.monotonic() + seconds
        while not done() and time.monotonic() < limit:
            self.arrivals += self.listener.serve(0.01)[1]
        return done()

    def close(self):
        self.listener.close_all()


def connect(address) -> socket.socket:
    sock = socket.create_connection(address, timeout=10)
    sock.setblocking(False)
    return sock


def ended(sock) -> bool:
    """The other end closed ``sock`` (without a read that blocks)."""
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_a_connection_that_never_proves_itself_is_dropped_at_its_deadline():
    served = Served(hello_wait=0.5)
    try:
        silent = connect(served.address)
        challenged = connect(served.address)   # gets the caller's proof, then says nothing
        challenged.sendall(frame(CHALLENGE, json.dumps({"nonce": new_nonce()}).encode()))
        t0 = time.monotonic()
        assert served.serve_until(lambda: ended(silent), 10), "the silent one was kept"
        seconds = time.monotonic() - t0
        assert 0.4 < seconds < 2.5, seconds
        challenged.setblocking(True)
        challenged.settimeout(5)
        kind, _ = recv_frame(challenged)
        assert kind == PROOF
        assert challenged.recv(1) == b"", "the challenged one was kept past its deadline"
        assert served.arrivals == []
    finally:
        served.close()


def test_a_rank_with_a_wrong_token_is_refused_and_a_right_one_admitted():
    served = Served()
    try:
        def attempt(token: str):
            sock = socket.create_connection(served.address, timeout=10)
            sock.sendall(frame(CHALLENGE, json.dumps({"nonce": (n := new_nonce())}).encode()))
            answer = {}
            thread = threading.Thread(target=lambda: answer.update(
                zip(("kind", "body"), recv_frame(sock))), daemon=True)
            thread.start()
            served.serve_until(lambda: not thread.is_alive(), 10)
            assert answer["kind"] == PROOF
            reply = json.loads(answer["body"])
            assert proof_matches(TOKEN, n, CALLER, reply["proof"])
            sock.sendall(frame(HELLO, json.dumps(
                {**HELLO_FIELDS, "proof": proof(token, reply["nonce"], RANK)}).encode()))
            sock.setblocking(False)
            return sock

        wrong = attempt("f" * 32)
        assert served.serve_until(lambda: ended(wrong), 10), "a wrong proof was kept"
        assert served.arrivals == []
        right = attempt(TOKEN)
        assert served.serve_until(lambda: served.arrivals, 10)
        [(conn, frames)] = served.arrivals
        assert frames[0][0] == HELLO and conn.hello["rank"] == 0
        assert not ended(right)
    finally:
        served.close()


def test_no_more_than_max_pending_strangers_are_held_oldest_dropped_first():
    served = Served(max_pending=8)
    socks = []
    try:
        for _ in range(20):
            socks.append(connect(served.address))
            served.serve_until(lambda: False, 0.02)
        served.serve_until(lambda: sum(map(ended, socks)) >= 12, 10)
        closed = [i for i, s in enumerate(socks) if ended(s)]
        assert closed == list(range(12)), closed   # the newest 8 are held
    finally:
        for s in socks:
            s.close()
        served.close()


# -- where the caller listens ----------------------------------------------------------
def test_on_one_host_the_caller_listens_on_loopback(monkeypatch):
    monkeypatch.setenv(HOST_VAR, "10.1.2.3")   # for srun only
    assert caller_host(Launcher("/x/mpiexec", "hydra")) == "127.0.0.1"


def test_under_srun_the_setting_wins_and_a_bad_one_is_named(monkeypatch):
    srun = Launcher("/x/srun", SRUN)
    monkeypatch.setenv(HOST_VAR, "127.0.0.1")
    assert caller_host(srun) == "127.0.0.1"
    monkeypatch.setenv(HOST_VAR, "no-such-host.invalid")
    with pytest.raises(RuntimeError, match=f"{HOST_VAR}=no-such-host.invalid is not"):
        caller_host(srun)


def test_under_srun_the_route_to_the_allocations_nodes_gives_the_address(monkeypatch):
    srun = Launcher("/x/srun", SRUN)
    monkeypatch.delenv(HOST_VAR, raising=False)
    routes = {"n1": "127.0.0.1", "n2": "10.0.0.7", "n3": "10.0.0.7"}   # n1 is this host
    monkeypatch.setattr(launcher_mod, "_allocation_nodes", lambda: ["n1", "n2", "n3"])
    monkeypatch.setattr(launcher_mod, "_route_source", routes.get)
    assert caller_host(srun) == "10.0.0.7"
    # The allocation is this host alone: loopback reaches every rank.
    monkeypatch.setattr(launcher_mod, "_allocation_nodes", lambda: ["n1"])
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    assert caller_host(srun) == "127.0.0.1"
    # Nodes of their own that are all reached over loopback (a cluster on one host).
    routes["n5"] = "127.0.0.1"
    monkeypatch.setattr(launcher_mod, "_allocation_nodes", lambda: ["n1", "n5"])
    assert caller_host(srun) == "127.0.0.1"
    # Other nodes, and nothing but loopback to reach them by: say what to set.
    monkeypatch.setattr(launcher_mod, "_allocation_nodes", lambda: ["n1", "n4"])
    with pytest.raises(RuntimeError, match=f"set {HOST_VAR}"):
        caller_host(srun)


def test_a_node_whose_name_does_not_resolve_is_found_by_slurms_node_address(monkeypatch):
    """slurm.conf may name a node and give its address (NodeAddr) without DNS."""
    def run(cmd, **kwargs):
        assert cmd == ["scontrol", "-o", "show", "node", "gpu-7"], cmd
        out = "NodeName=gpu-7 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.2.0.7 NodeHostName=x"
        return subprocess.CompletedProcess(cmd, 0, stdout=out)

    monkeypatch.setattr(launcher_mod.subprocess, "run", run)
    monkeypatch.setattr(socket, "gethostbyname",
                        lambda name: name if name[0].isdigit() else _no_such_host(name))
    assert launcher_mod._node_address("gpu-7") == "10.2.0.7"


def _no_such_host(name: str) -> str:
    raise socket.gaierror(f"{name}: no such host")


def test_first_node_of_a_slurm_node_list():
    assert first_node("node[03-05,9],gpu1") == "node03"
    assert first_node("gpu1,node[1-2]") == "gpu1"
    assert first_node("a-b-c") == "a-b-c"
