"""The transports copy bytes exactly, wake a sleeping receiver, and report a dead peer."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from afd.connectors.shm import ShmMailbox, create_links
from afd.connectors.transport import LoopbackHub, LoopbackMailbox, PeerDiedError
from afd.connectors.wire import Header, Kind, Role, TensorName, make_message


def _msg(i: int, rows: int) -> object:
    torch.manual_seed(i)
    return make_message(
        Header(Kind.WORK, Role.ATTENTION, 0, 0, layer=i % 5, seq=i, num_tokens=rows),
        {TensorName.HIDDEN: torch.randn(rows, 64).to(torch.bfloat16), TensorName.EXPERT_IDS: torch.randint(-1, 8, (rows, 2), dtype=torch.int32)},
    )


def _shm(run_dir, role, num_slots=2, slot_bytes=4096) -> ShmMailbox:
    box = ShmMailbox(run_dir, role, 0, 1, num_slots=num_slots, slot_bytes=slot_bytes)
    box.connect(30)
    return box


def _echo_ffn(run_dir, n):
    box = _shm(run_dir, Role.FFN, slot_bytes=64 << 10)
    for _ in range(n):
        m = box.recv(30)
        h = m.header
        back = Header(Kind.RESULT, Role.FFN, 0, 0, h.layer, h.microbatch, h.seq, h.num_tokens)
        box.send(0, make_message(back, {TensorName.OUTPUT: m.tensors[TensorName.HIDDEN]}))
    box.close()


@pytest.mark.procs
def test_shm_is_byte_exact_across_processes_and_ring_wraps(tmp_path):
    n = 25  # > num_slots: the ring wraps and the producer waits for space
    create_links(tmp_path, 1, 1, num_slots=2, slot_bytes=64 << 10)
    peer = mp.get_context("spawn").Process(target=_echo_ffn, args=(tmp_path, n))
    peer.start()
    try:
        box = _shm(tmp_path, Role.ATTENTION, slot_bytes=64 << 10)
        for i in range(n):
            sent = _msg(i, rows=1 + 37 * i % 200)
            box.send(0, sent)
            got = box.recv(30)
            assert got.header.seq == i and got.header.kind == Kind.RESULT
            assert torch.equal(got.tensors[TensorName.OUTPUT], sent.tensors[TensorName.HIDDEN])
        peer.join(10)
        assert peer.exitcode == 0
        # the peer is gone: a receive reports it instead of hanging
        with pytest.raises(PeerDiedError, match="ffn rank 0 is gone"):
            box.recv(5)
    finally:
        if peer.is_alive():
            peer.kill()


def test_shm_receive_times_out_quietly_when_idle(tmp_path):
    create_links(tmp_path, 1, 1, num_slots=2, slot_bytes=4096)
    # open both ends in this process: an idle link is not a failure
    a_box = {}

    def open_ffn():
        a_box["ffn"] = _shm(tmp_path, Role.FFN)

    import threading

    th = threading.Thread(target=open_ffn)
    th.start()
    attn = _shm(tmp_path, Role.ATTENTION)
    th.join()
    t0 = time.monotonic()
    assert attn.recv(0.3) is None
    assert 0.25 < time.monotonic() - t0 < 2.0
    with pytest.raises(ValueError, match="exceeds the shm slot"):
        attn.send(0, _msg(0, rows=100))


def test_loopback_copies_and_reports_closed_links():
    hub = LoopbackHub()
    a, f = LoopbackMailbox(hub, Role.ATTENTION, 0, 1), LoopbackMailbox(hub, Role.FFN, 0, 1)
    sent = _msg(3, rows=5)
    a.send(0, sent)
    sent.tensors[TensorName.HIDDEN].zero_()  # the sender's buffer may be reused at once
    got = f.recv(1)
    assert got.header.seq == 3 and got.tensors[TensorName.HIDDEN].abs().sum() > 0
    assert f.recv(0.05) is None
    hub.close()
    with pytest.raises(PeerDiedError):
        f.recv(1)


def _say_shutdown_and_exit(transport, arg, peer_open):
    box = _open(transport, Role.ATTENTION, arg)
    peer_open.wait(30)  # both ends of every link are open before this side goes away
    box.send(0, make_message(Header(Kind.SHUTDOWN, Role.ATTENTION, 0, 0), {}))
    box.close()


def _open(transport, role, arg):
    if transport == "shm":
        return _shm(arg, role)
    if transport == "tcp":
        from afd.connectors.tcp import TcpMailbox

        box = TcpMailbox(role, 0, 1, 1, "127.0.0.1", arg, timeout=30)
    else:
        from afd.connectors.torch_dist import TorchMailbox

        box = TorchMailbox(role, 0, 1, 1, "127.0.0.1", arg, timeout=30)
    box.connect(30)
    return box


@pytest.mark.procs
@pytest.mark.parametrize("transport", ["shm", "tcp", "torch"])
def test_shutdown_then_close_is_not_a_death(transport, tmp_path):
    """A peer that says SHUTDOWN and exits at once: its link's EOF may already be there when the receiver
    drains for more messages (the two-node CI failure). SHUTDOWN is the last message on a link, so the
    receiver stops listening to it as it reads it; a peer that closes without SHUTDOWN is still a death."""
    if transport == "shm":
        create_links(tmp_path, 1, 1, num_slots=2, slot_bytes=4096)
        arg, store = tmp_path, None
    else:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
        arg = store.port
    ctx = mp.get_context("spawn")
    peer_open = ctx.Event()
    peer = ctx.Process(target=_say_shutdown_and_exit, args=(transport, arg, peer_open))
    peer.start()
    try:
        box = _open(transport, Role.FFN, arg)
        peer_open.set()
        peer.join(30)
        assert peer.exitcode == 0
        got = box.recv(10)  # the peer is gone by now, its SHUTDOWN still queued before the EOF
        assert got.header.kind == Kind.SHUTDOWN
        assert box.recv(0.2) is None  # a drain after SHUTDOWN: quiet, not PeerDiedError
        box.close()
    finally:
        if peer.is_alive():
            peer.kill()


def _send_two(transport, arg, sent, drained):
    box = _open(transport, Role.ATTENTION, arg)
    for i in range(2):  # the shm ring of _open has two slots
        box.send(0, _msg(i, rows=4))
    sent.set()
    assert drained.wait(30), "the receiver did not drain the link"  # keep the link open until it has
    box.close()


@pytest.mark.procs
@pytest.mark.parametrize("transport", ["shm", "tcp", "torch", "loopback"])
def test_a_zero_timeout_receive_returns_what_is_already_waiting(transport, tmp_path):
    """The FFN loop drains waiting work with recv(0.0): it must return messages already delivered (on shm
    it once returned None before looking, so nothing was ever drained)."""
    if transport == "loopback":
        hub = LoopbackHub()
        a, f = LoopbackMailbox(hub, Role.ATTENTION, 0, 1), LoopbackMailbox(hub, Role.FFN, 0, 1)
        for i in range(2):
            a.send(0, _msg(i, rows=4))
        assert [f.recv(0.0).header.seq for _ in range(2)] == [0, 1] and f.recv(0.0) is None
        return
    if transport == "shm":
        create_links(tmp_path, 1, 1, num_slots=2, slot_bytes=4096)
        arg = tmp_path
    else:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
        arg = store.port
    ctx = mp.get_context("spawn")
    sent, drained = ctx.Event(), ctx.Event()
    peer = ctx.Process(target=_send_two, args=(transport, arg, sent, drained))
    peer.start()
    try:
        box = _open(transport, Role.FFN, arg)
        assert sent.wait(30)
        first = box.recv(10)  # the first may still be in flight; the rest are waiting once it is here
        deadline = time.monotonic() + 5
        rest = []
        while not rest and time.monotonic() < deadline:
            got = box.recv(0.0)
            if got is not None:
                rest.append(got)
            elif transport == "shm":
                break  # shm delivers into the ring before the sender returns: nothing may be missing
        drained.set()
        assert first.header.seq == 0 and [m.header.seq for m in rest] == [1]
        box.close()
        peer.join(10)
        assert peer.exitcode == 0
    finally:
        peer.kill()
        peer.join(10)


def test_tcp_is_byte_exact_reports_a_death_and_reconnects_to_a_replacement():
    """Frames of every size (beyond a socket buffer too) arrive as sent; a stray connection is refused without
    harm; a peer closing without SHUTDOWN is a death naming it; a replacement under a new generation is
    reached by reconnect."""
    import threading

    import torch.distributed as dist

    from afd.connectors.tcp import TcpMailbox

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    boxes = {}

    def open_ffn(generation):
        box = TcpMailbox(Role.FFN, 0, 1, 1, "127.0.0.1", store.port, timeout=30, generation=generation)
        box.connect(30)
        boxes[generation] = box

    th = threading.Thread(target=open_ffn, args=(0,))
    th.start()
    attn = TcpMailbox(Role.ATTENTION, 0, 1, 1, "127.0.0.1", store.port, timeout=30)
    attn.connect(30)
    th.join()
    ffn = boxes[0]
    import socket

    from afd.connectors.tcp import HELLO, address_key

    host, port = store.get(address_key(0, 0)).decode().rsplit(":", 1)
    with socket.create_connection((host, int(port))) as stray:  # another run's rank, or an old incarnation
        stray.sendall(HELLO.pack(0, 7))
        assert ffn.recv(0.3) is None  # refused and logged; the rank serves on, its real link untouched
    for i, rows in enumerate([0, 1, 7, 300, 40000]):  # 40000 x 64 bf16: 5 MB, past any socket buffer
        sent = _msg(i, rows)
        th = threading.Thread(target=attn.send, args=(0, sent))
        th.start()
        got = ffn.recv(30)
        th.join()
        assert got.header.seq == i and torch.equal(got.tensors[TensorName.HIDDEN], sent.tensors[TensorName.HIDDEN])
        assert torch.equal(got.tensors[TensorName.EXPERT_IDS], sent.tensors[TensorName.EXPERT_IDS])
    assert ffn.recv(0.1) is None  # idle is quiet
    ffn.close()  # gone without a SHUTDOWN
    with pytest.raises(PeerDiedError, match="ffn rank 0 is gone") as died:
        attn.recv(5)
    assert died.value.peer == 0
    th = threading.Thread(target=open_ffn, args=(1,))
    th.start()
    attn.reconnect(0, 1, 30)
    attn.send(0, _msg(9, rows=3))
    th.join()
    got = boxes[1].recv(10)  # the replacement accepts as it receives
    assert got.header.seq == 9 and got.header.src_index == 0
    boxes[1].close()
    attn.close()
