"""Tests of spmd.store: HashStore, FileStore, TCPStore, PrefixStore.

Plain processes (not under mpiexec).  Multi-process tests use multiprocessing with
the spawn start method and the workers in tests/_store_helpers.py.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ROOT = os.path.dirname(HERE)
for _p in (HERE, ROOT):  # for the spawned workers too (they inherit sys.path)
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _store_helpers as helpers  # noqa: E402

from spmd.core.errors import DistNetworkError, DistStoreError  # noqa: E402
from spmd.store import FileStore, HashStore, PrefixStore, Store, TCPStore  # noqa: E402

pytestmark = pytest.mark.timeout(60)

KINDS = ["hash", "file", "tcp", "prefix"]
SLACK = 1.5  # seconds allowed beyond a timeout on a loaded CI machine


class Env:
    """Creates handles on one shared store of a given kind and closes them at the end."""

    def __init__(self, kind, tmp_path):
        self.kind = kind
        self.handles = []
        self.master = None
        if kind == "hash":
            self.shared = HashStore(timeout=10)
        elif kind == "prefix":
            self.shared = HashStore(timeout=10)
        elif kind == "file":
            self.path = str(tmp_path / "store")
        elif kind == "tcp":
            self.master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10)

    def open(self) -> Store:
        """A new handle (a separate client/instance where the kind has them)."""
        if self.kind == "hash":
            store = self.shared
        elif self.kind == "prefix":
            store = PrefixStore("ns", self.shared)
        elif self.kind == "file":
            store = FileStore(self.path, timeout=10)
        else:
            store = TCPStore("127.0.0.1", self.master.port, timeout=10)
        self.handles.append(store)
        return store

    def close(self):
        for h in self.handles:
            h.close()
        if self.master is not None:
            self.master.close()


@pytest.fixture(params=KINDS)
def env(request, tmp_path):
    e = Env(request.param, tmp_path)
    yield e
    e.close()


@pytest.fixture
def store(env):
    return env.open()


def spawn_all(target, args_list):
    """Run target(*args) in spawned processes; assert they all succeed."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=args) for args in args_list]
    for p in procs:
        p.start()
    for p in procs:
        p.join(45)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * len(procs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- basics
def test_set_get_roundtrip(store):
    store.set("a", b"\x00\xffbytes")
    store.set("b", "text é")
    store.set("c", bytearray(b"ba"))
    store.set("", b"empty key")
    assert store.get("a") == b"\x00\xffbytes"
    assert store.get("b") == "text é".encode()
    assert store.get("c") == b"ba"
    assert store.get("") == b"empty key"
    store.set("a", b"")
    assert store.get("a") == b""
    big = os.urandom(3 << 20)
    store.set("big", big)
    assert store.get("big") == big


def test_add_counter(store):
    assert store.add("n", 5) == 5
    assert store.get("n") == b"5"
    assert store.add("n", -7) == -2
    assert store.get("n") == b"-2"
    assert store.add("n", 0) == -2
    store.set("m", b"41")
    assert store.add("m", 1) == 42
    store.set("text", b"abc")
    with pytest.raises(DistStoreError, match="not an integer"):
        store.add("text", 1)
    assert store.get("text") == b"abc"


def test_compare_set_semantics(store):
    # Missing key, empty expected: set; returns the new value.
    assert store.compare_set("k", b"", b"v1") == b"v1"
    assert store.get("k") == b"v1"
    # Existing key, expected matches: set.
    assert store.compare_set("k", "v1", "v2") == b"v2"
    assert store.get("k") == b"v2"
    # Existing key, mismatch: unchanged; returns the current value.
    assert store.compare_set("k", b"nope", b"v3") == b"v2"
    assert store.get("k") == b"v2"
    # Missing key, non-empty expected: not set; returns expected (as c10d does).
    assert store.compare_set("missing", b"exp", b"des") == b"exp"
    assert store.check(["missing"]) is False


def test_check_delete_num_keys(store, env):
    assert store.num_keys() == 0
    assert store.check([]) is True
    store.set("x", b"1")
    store.add("y", 1)
    assert store.check(["x"]) is True
    assert store.check(["x", "y"]) is True
    assert store.check(["x", "z"]) is False
    assert store.num_keys() == 2
    assert store.delete_key("x") is True
    assert store.delete_key("x") is False
    assert store.check(["x"]) is False
    assert store.num_keys() == 1
    store.set("x", b"again")
    assert store.get("x") == b"again"


def test_multi_get_set(store):
    store.multi_set(["a", "b", "c"], [b"1", "2", b"3"])
    assert store.multi_get(["c", "a", "b"]) == [b"3", b"1", b"2"]
    assert store.multi_get([]) == []
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.multi_set(["a", "b"], [b"1"])


def test_handles_share_data(env):
    first, second = env.open(), env.open()
    first.set("shared", b"from first")
    assert second.get("shared") == b"from first"
    assert second.add("count", 2) == 2
    assert first.add("count", 3) == 5


def test_random_ops_match_dict_model(store):
    rng = random.Random(1234)
    model = {}
    for _ in range(300):
        op, key = rng.choice(["set", "add", "delete", "cas", "get"]), rng.choice("abcdef")
        if op == "set":
            value = str(rng.randrange(10)).encode()
            store.set(key, value)
            model[key] = value
        elif op == "add":
            if not model.get(key, b"0").lstrip(b"-").isdigit():
                continue
            amount = rng.randrange(-5, 6)
            expect = int(model.get(key, b"0")) + amount
            assert store.add(key, amount) == expect
            model[key] = str(expect).encode()
        elif op == "delete":
            assert store.delete_key(key) is (model.pop(key, None) is not None)
        elif op == "cas":
            expected = rng.choice([b"", model.get(key, b"x"), b"7"])
            desired = str(rng.randrange(10)).encode()
            cur = model.get(key)
            if (cur is None and expected == b"") or (cur is not None and cur == expected):
                model[key] = desired
                want = desired
            else:
                want = expected if cur is None else cur
            assert store.compare_set(key, expected, desired) == want
        else:
            assert store.check([key]) is (key in model)
            if key in model:
                assert store.get(key) == model[key]
    assert store.num_keys() == len(model)
    assert store.multi_get(sorted(model)) == [model[k] for k in sorted(model)]


# ----------------------------------------------------------------------------- timeouts
def test_timeout_property_and_set_timeout(store):
    store.set_timeout(timedelta(seconds=2.5))
    assert store.timeout == timedelta(seconds=2.5)
    store.set_timeout(7)
    assert store.timeout == timedelta(seconds=7)


def test_get_times_out(store):
    store.set_timeout(timedelta(seconds=0.5))
    t0 = time.monotonic()
    with pytest.raises(DistStoreError, match=r"timed out after 0\.5 s waiting for key 'missing'") as info:
        store.get("missing")
    elapsed = time.monotonic() - t0
    assert 0.45 <= elapsed <= 0.5 + SLACK
    assert isinstance(info.value, RuntimeError)


def test_wait_times_out_naming_missing_keys(store):
    store.set("present", b"1")
    t0 = time.monotonic()
    with pytest.raises(DistStoreError, match=r"0\.4 s waiting for key 'absent'"):
        store.wait(["present", "absent"], timedelta(seconds=0.4))
    elapsed = time.monotonic() - t0
    assert 0.35 <= elapsed <= 0.4 + SLACK
    # A float number of seconds is accepted too.
    t0 = time.monotonic()
    with pytest.raises(DistStoreError, match="'absent'"):
        store.wait(["absent"], 0.3)
    assert 0.25 <= time.monotonic() - t0 <= 0.3 + SLACK


def test_multi_get_times_out(store):
    store.set_timeout(0.3)
    store.set("a", b"1")
    t0 = time.monotonic()
    with pytest.raises(DistStoreError, match=r"key 'b'"):
        store.multi_get(["a", "b"])
    assert 0.25 <= time.monotonic() - t0 <= 0.3 + SLACK


def test_zero_timeout_does_not_wait(store):
    store.set("here", b"1")
    store.wait(["here"], 0)
    t0 = time.monotonic()
    with pytest.raises(DistStoreError):
        store.wait(["gone"], timedelta(0))
    assert time.monotonic() - t0 < 0.5


def test_get_and_wait_wake_on_set(env):
    reader, writer = env.open(), env.open()
    timer = threading.Timer(0.3, lambda: (writer.set("late", b"here"), writer.add("late2", 4)))
    t0 = time.monotonic()
    timer.start()
    try:
        reader.wait(["late", "late2"], timedelta(seconds=20))
        assert reader.get("late") == b"here"
        assert reader.get("late2") == b"4"
    finally:
        timer.join()
    assert 0.25 <= time.monotonic() - t0 < 0.3 + SLACK


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "method, args",
    [
        ("set", (1, b"v")),
        ("get", (b"k",)),
        ("add", (None, 1)),
        ("compare_set", (3.0, b"", b"v")),
        ("delete_key", (("k",),)),
        ("wait", ([1],)),
        ("check", (["ok", 2],)),
        ("multi_get", ([b"k"],)),
        ("multi_set", ([7], [b"v"])),
    ],
)
def test_non_str_key_is_type_error(store, method, args):
    bad = args[0] if not isinstance(args[0], list) else [a for a in args[0] if not isinstance(a, str)][0]
    with pytest.raises(TypeError, match=rf"{method}: key must be str, got {type(bad).__name__}"):
        getattr(store, method)(*args)
    assert store.num_keys() == 0


@pytest.mark.parametrize("value", [1, None, 2.5, ["x"], memoryview(b"x")])
def test_non_bytes_value_is_type_error(store, value):
    with pytest.raises(TypeError, match=rf"set: value must be bytes or str, got {type(value).__name__}"):
        store.set("k", value)
    with pytest.raises(TypeError, match="compare_set: expected_value"):
        store.compare_set("k", value, b"x")
    with pytest.raises(TypeError, match="compare_set: desired_value"):
        store.compare_set("k", b"", value)
    with pytest.raises(TypeError, match="multi_set: value"):
        store.multi_set(["k"], [value])
    assert store.check(["k"]) is False


def test_bad_keys_container_and_amount(store):
    with pytest.raises(TypeError, match="wait: keys must be a list of str, got str"):
        store.wait("abc")
    with pytest.raises(TypeError, match="add: amount must be int, got float"):
        store.add("k", 1.0)
    with pytest.raises(TypeError, match="add: amount must be int, got bool"):
        store.add("k", True)
    assert store.check(["k"]) is False


def test_bad_timeouts(store):
    with pytest.raises(ValueError, match="non-negative"):
        store.wait(["k"], timedelta(seconds=-1))
    with pytest.raises(ValueError, match="non-negative"):
        store.wait(["k"], -0.5)
    with pytest.raises(ValueError, match="non-negative"):
        store.set_timeout(timedelta(seconds=-3))
    with pytest.raises(ValueError, match="non-negative"):
        store.set_timeout(float("nan"))
    with pytest.raises(TypeError, match="timedelta or a number of seconds, got str"):
        store.set_timeout("10")
    assert store.timeout == timedelta(seconds=10)


def test_constructors_reject_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="non-negative"):
        HashStore(timeout=timedelta(seconds=-1))
    with pytest.raises(ValueError, match="non-negative"):
        FileStore(str(tmp_path / "f"), timeout=-1)
    with pytest.raises(ValueError, match="world_size"):
        FileStore(str(tmp_path / "f"), world_size=0)
    with pytest.raises(TypeError, match="file_name"):
        FileStore(5)
    with pytest.raises(ValueError, match="non-negative"):
        TCPStore("127.0.0.1", 0, is_master=True, timeout=-2)
    with pytest.raises(ValueError, match="0 is allowed only on the master"):
        TCPStore("127.0.0.1", 0)
    with pytest.raises(TypeError, match="port must be int"):
        TCPStore("127.0.0.1", "80", is_master=True)
    with pytest.raises(TypeError, match="token must be"):
        TCPStore("127.0.0.1", 0, is_master=True, token=123)
    with pytest.raises(TypeError, match="prefix must be str"):
        PrefixStore(1, HashStore())
    with pytest.raises(TypeError, match="store must be a Store"):
        PrefixStore("p", {})
    assert not os.path.exists(tmp_path / "f")


# ----------------------------------------------------------------------------- concurrency
def _run_threads(fn, n):
    errors = []

    def body(i):
        try:
            fn(i)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize("shared_handle", [False, True])
def test_threads_add_exact(env, shared_handle):
    n_threads, n_adds = 8, 200
    handles = [env.open()] * n_threads if shared_handle else [env.open() for _ in range(n_threads)]
    results = [None] * n_threads

    def work(i):
        results[i] = [handles[i].add("counter", 1) for _ in range(n_adds)]

    _run_threads(work, n_threads)
    total = n_threads * n_adds
    assert handles[0].get("counter") == str(total).encode()
    # Atomicity: every add returned a distinct value, each thread's increasing.
    assert sorted(v for r in results for v in r) == list(range(1, total + 1))
    assert all(r == sorted(r) for r in results)


def test_threads_compare_set_exact(env):
    n_threads, n_incs = 8, 40
    handles = [env.open() for _ in range(n_threads)]
    handles[0].set("cas", b"0/init")
    results = [None] * n_threads

    def work(i):
        results[i] = [helpers.cas_increment(handles[i], "cas", f"{i}.{j}") for j in range(n_incs)]

    _run_threads(work, n_threads)
    total = n_threads * n_incs
    assert int(handles[0].get("cas").split(b"/")[0]) == total
    assert sorted(v for r in results for v in r) == list(range(1, total + 1))


@pytest.fixture(params=["file", "tcp"])
def shared_spec(request, tmp_path):
    """A store reachable from other processes: (spec for workers, parent's handle)."""
    n_workers = 4
    if request.param == "file":
        path = str(tmp_path / "mp_store")
        parent = FileStore(path, world_size=n_workers + 1, timeout=30)
        yield ("file", path, n_workers + 1), parent
        parent.close()
        # The parent was the last of world_size users: the file is gone.
        assert not os.path.exists(path)
    else:
        parent = TCPStore("127.0.0.1", 0, world_size=n_workers + 1, is_master=True,
                          wait_for_workers=False, timeout=30)
        yield ("tcp", "127.0.0.1", parent.port), parent
        parent.close()


def test_processes_add_exact(shared_spec):
    spec, parent = shared_spec
    n_procs, n_adds = 4, 200
    spawn_all(helpers.add_worker, [(spec, r, n_adds) for r in range(n_procs)])
    assert parent.get("counter") == str(n_procs * n_adds).encode()
    values = [int(v) for r in range(n_procs) for v in parent.get(f"vals/{r}").split(b",")]
    assert sorted(values) == list(range(1, n_procs * n_adds + 1))
    if spec[0] == "file":
        assert os.path.exists(spec[1])  # the parent still holds it open


def test_processes_compare_set_exact(shared_spec):
    spec, parent = shared_spec
    n_procs, n_incs = 4, 50
    parent.set("cas", b"0/init")
    spawn_all(helpers.cas_worker, [(spec, r, n_incs) for r in range(n_procs)])
    assert int(parent.get("cas").split(b"/")[0]) == n_procs * n_incs
    values = [int(v) for r in range(n_procs) for v in parent.get(f"vals/{r}").split(b",")]
    assert sorted(values) == list(range(1, n_procs * n_incs + 1))


# ----------------------------------------------------------------------------- FileStore
def test_filestore_mode_0600(tmp_path):
    path = tmp_path / "secret"
    old = os.umask(0)  # so the mode comes from FileStore, not from the umask
    try:
        store = FileStore(str(path))
    finally:
        os.umask(old)
    store.set("k", b"v")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    store.close()


def test_filestore_cleanup_by_last_of_world_size(tmp_path):
    path = str(tmp_path / "ws2")
    a, b = FileStore(path, world_size=2), FileStore(path, world_size=2)
    a.set("k", b"v")
    a.close()
    assert os.path.exists(path)
    assert b.get("k") == b"v"
    del b  # garbage collection closes too, as c10d's destructor does
    assert not os.path.exists(path)


def test_filestore_unknown_world_size_keeps_file(tmp_path):
    path = str(tmp_path / "keep")
    a = FileStore(path)
    a.set("k", b"v")
    a.close()
    a.close()  # idempotent
    assert os.path.exists(path)
    b = FileStore(path)
    assert b.get("k") == b"v"
    assert b.num_keys() == 1  # the internal reference counts are not keys
    b.close()


def test_filestore_closed_instance_raises(tmp_path):
    store = FileStore(str(tmp_path / "c"))
    store.close()
    with pytest.raises(DistStoreError, match="is closed"):
        store.set("k", b"v")


def test_filestore_recreated_file_is_reread(tmp_path):
    path = tmp_path / "re"
    store = FileStore(str(path))
    store.set("old", b"1")
    os.unlink(path)
    other = FileStore(str(path))
    other.set("new", b"2")
    assert store.check(["old"]) is False
    assert store.get("new") == b"2"
    store.close()
    other.close()


def test_filestore_accepts_pathlike(tmp_path):
    store = FileStore(tmp_path / "pl", world_size=1)
    store.set("k", b"v")
    assert store.path == str(tmp_path / "pl")
    store.close()
    assert not os.path.exists(tmp_path / "pl")


# ----------------------------------------------------------------------------- TCPStore
def test_tcpstore_port_zero_binds_exact_address():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=5)
    try:
        assert 0 < master.port < 65536
        assert master.host == "127.0.0.1"
        assert master.is_master is True
        assert master._server.socket.getsockname() == ("127.0.0.1", master.port)
        client = TCPStore("127.0.0.1", master.port, timeout=5)
        assert client.port == master.port and client.is_master is False
        client.set("k", b"v")
        assert master.get("k") == b"v"
        client.close()
    finally:
        master.close()


def test_tcpstore_busy_port_is_network_error():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=5)
    try:
        with pytest.raises(DistNetworkError, match=f"127.0.0.1:{master.port}"):
            TCPStore("127.0.0.1", master.port, is_master=True, timeout=5)
        assert master.add("still", 1) == 1
    finally:
        master.close()


def test_tcpstore_token_enforced():
    master = TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False,
                      timeout=5, token=b"s3cret")
    try:
        good = TCPStore("127.0.0.1", master.port, timeout=5, token="s3cret")
        good.set("k", b"v")
        assert master.get("k") == b"v"
        for bad in (None, b"wrong", "s3cre"):
            with pytest.raises(DistStoreError, match="token rejected"):
                TCPStore("127.0.0.1", master.port, timeout=5, token=bad)
        assert master._server.joined == 2  # the master and `good` only
        assert good.get("k") == b"v"
        good.close()
    finally:
        master.close()


def test_tcpstore_server_survives_garbage():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=5)
    try:
        for junk in (b"GET / HTTP/1.0\r\n\r\n", b"\x00\x00\x00\x05\x00\xff\xff\xff\xff", b""):
            with socket.create_connection(("127.0.0.1", master.port), timeout=5) as raw:
                raw.settimeout(5)
                try:
                    raw.sendall(junk)
                    raw.shutdown(socket.SHUT_WR)
                    raw.recv(100)  # the server answers or hangs up; it must not hang
                except OSError as e:  # hung up with our bytes unread: refused at the length
                    assert not isinstance(e, TimeoutError), f"the server hung on {junk!r}"
        client = TCPStore("127.0.0.1", master.port, timeout=5)
        assert client.add("n", 3) == 3
        client.close()
    finally:
        master.close()


def test_tcpstore_wait_for_workers():
    port = free_port()
    box = {}

    def run_master():
        try:
            box["master"] = TCPStore("127.0.0.1", port, world_size=3, is_master=True, timeout=20)
        except BaseException as e:  # pragma: no cover - reported below
            box["error"] = e

    t = threading.Thread(target=run_master)
    t.start()
    time.sleep(0.2)
    assert t.is_alive()  # blocked: 1/3 joined
    c1 = TCPStore("127.0.0.1", port, world_size=3, timeout=20)
    time.sleep(0.2)
    assert t.is_alive()  # 2/3
    c2 = TCPStore("127.0.0.1", port, world_size=3, timeout=20)
    t.join(10)
    assert not t.is_alive() and "error" not in box
    master = box["master"]
    c1.set("x", b"1")
    assert c2.get("x") == b"1" and master.get("x") == b"1"
    for s in (c1, c2, master):
        s.close()


def test_tcpstore_wait_for_workers_times_out():
    t0 = time.monotonic()
    with pytest.raises(DistStoreError, match="waiting for workers: 1/2 joined"):
        TCPStore("127.0.0.1", 0, world_size=2, is_master=True, timeout=0.5)
    assert 0.45 <= time.monotonic() - t0 <= 0.5 + SLACK


def test_tcpstore_connect_retries_then_fails():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(DistNetworkError, match=f"could not connect to 127.0.0.1:{port} within 0.6 s"):
        TCPStore("127.0.0.1", port, timeout=0.6)
    assert 0.55 <= time.monotonic() - t0 <= 0.6 + SLACK


def test_tcpstore_client_waits_for_late_master():
    port = free_port()
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("c", TCPStore("127.0.0.1", port, timeout=20)))
    t.start()
    time.sleep(0.5)  # the client is retrying
    master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=20)
    t.join(10)
    assert not t.is_alive()
    box["c"].set("k", b"late")
    assert master.get("k") == b"late"
    box["c"].close()
    master.close()


def test_tcpstore_shared_client_between_threads_and_close():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10)
    client = TCPStore("127.0.0.1", master.port, timeout=10)
    # A get blocked on the client returns as soon as another client sets the key.
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("v", client.get("later")))
    t.start()
    time.sleep(0.2)
    master.set("later", b"ok")
    t.join(10)
    assert got == {"v": b"ok"}
    master.close()
    t0 = time.monotonic()
    with pytest.raises(DistNetworkError, match=f"127.0.0.1:{master.port}"):
        client.get("later")
    assert time.monotonic() - t0 < 2
    with pytest.raises(DistNetworkError, match="closed or lost its connection"):
        client.set("k", b"v")
    client.close()


@pytest.fixture
def master_process():
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "_store_helpers.py"), "master", "127.0.0.1"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        port = int(proc.stdout.readline())
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdout.close()


def test_tcpstore_client_errors_when_master_killed(master_process):
    proc, port = master_process
    client = TCPStore("127.0.0.1", port, timeout=30)
    client.set("k", b"v")
    assert client.get("k") == b"v"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    t0 = time.monotonic()
    with pytest.raises((DistNetworkError, DistStoreError), match=f"127.0.0.1:{port}"):
        client.get("k")
    assert time.monotonic() - t0 < 3
    client.close()


def test_tcpstore_blocked_client_errors_when_master_killed(master_process):
    proc, port = master_process
    client = TCPStore("127.0.0.1", port, timeout=30)
    killer = threading.Timer(0.5, proc.kill)
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(DistNetworkError, match="lost the connection"):
        client.get("never-set")  # would wait 30 s
    elapsed = time.monotonic() - t0
    killer.join()
    assert 0.4 <= elapsed < 5
    client.close()


# ----------------------------------------------------------------------------- PrefixStore
def test_prefixstore_isolation(env):
    base = env.open()
    a, b = PrefixStore("a", base), PrefixStore("b", base)
    a.set("k", b"A")
    b.set("k", b"B")
    assert (a.get("k"), b.get("k")) == (b"A", b"B")
    assert base.get("a/k") == b"A" and base.get("b/k") == b"B"
    assert a.add("n", 2) == 2 and b.add("n", 5) == 5
    assert a.check(["k", "n"]) and not a.check(["other"])
    assert b.delete_key("k") is True
    assert a.get("k") == b"A" and b.check(["k"]) is False
    assert a.compare_set("k", b"A", b"A2") == b"A2" and base.get("a/k") == b"A2"
    a.multi_set(["x", "y"], [b"1", b"2"])
    assert a.multi_get(["x", "y"]) == [b"1", b"2"] and not b.check(["x"])
    assert a.underlying_store is base
    assert a.num_keys() == base.num_keys()  # counts the underlying store's keys, as c10d


def test_prefixstore_nested_timeout_and_errors():
    base = HashStore(timeout=4)
    outer = PrefixStore("outer", base)
    nested = PrefixStore("inner", outer)
    nested.set("k", b"v")
    assert base.get("outer/inner/k") == b"v"
    assert nested.underlying_store is outer
    assert nested.timeout == timedelta(seconds=4)
    nested.set_timeout(0.3)
    assert base.timeout == timedelta(seconds=0.3)
    t0 = time.monotonic()
    with pytest.raises(DistStoreError, match="waiting for key 'missing'"):
        nested.wait(["k", "missing"])
    assert 0.25 <= time.monotonic() - t0 <= 0.3 + SLACK
    with pytest.raises(TypeError, match="get: key must be str, got int"):
        nested.get(1)


# ----------------------------------------------------------------------------- module
def test_store_modules_use_only_the_standard_library():
    # Importing spmd starts nothing, so this shows what the store modules themselves
    # import (no mpi4py, no numpy).
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import spmd; before = set(sys.modules); "
        "import spmd.store as s; "
        "assert s.TCPStore.__name__ == 'TCPStore'; "
        "from spmd.store import *; assert set(s.__all__) <= set(dir()); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mpi4py', 'numpy') "
        "or m.startswith('spmd.') and m not in before))"
    )
    out = subprocess.run([sys.executable, "-c", code, ROOT],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "['spmd.core.typing', 'spmd.store', 'spmd.store.base', 'spmd.store.file', "
        "'spmd.store.tcp', 'spmd.store.tcp_admission', 'spmd.store.tcp_protocol']")
