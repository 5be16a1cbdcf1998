"""Runs over several hosts, each host a network namespace:

* ``afd generate --nnodes 2 --transport torch`` (attention on node 0, FFN on node 1, two namespaces joined
  by a veth pair) gives the same output as a one-host run;
* ``afd serve --nnodes 3 --transport tcp`` (node 0: the server and the attention rank, in this test's own
  namespace; nodes 1 and 2: an FFN rank each, in namespaces of their own, each joined to node 0 by a veth
  pair) serves the monolithic server's text; with every expert on both FFN ranks, the loss of node 2
  (every process on it killed) under load costs no request and changes no text; SIGTERM on node 0 ends
  the run on node 1 too, and nothing is left.

Both fall back to 127.0.0.1 (and say so) where namespaces cannot be made."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import uuid
import warnings

import pytest

from afd.cli.common import BUILTIN_MODEL
from tests import support
from tests.serving.server_proc import MODEL_NAME, Server
from tests.support import run_processes

pytestmark = pytest.mark.procs

ARGS = ["--prompt", "ROMEO:", "--prompt", "KING.\nWhat say you", "--prompt", "To be", "--max-tokens", "16",
        "--dtype", "float32", "--json", "--attention-ranks", "2", "--ffn-ranks", "2", "--transport", "torch",
        "--mode", "async", "--num-microbatches", "2", "--split", "token"]


def afd(*args):
    return [sys.executable, "-m", "afd.cli.main", "generate", str(BUILTIN_MODEL), *ARGS, *args]


class Namespaces:
    """Two hosts: network namespaces joined by a veth pair (only the ones this test made are touched)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns = (f"afd{tag}A", f"afd{tag}B")
        self.ifs = (f"va{tag}", f"vb{tag}")
        net = random.randint(1, 250)
        self.addrs = (f"10.77.{net}.1", f"10.77.{net}.2")
        self.made: list[str] = []

    def __enter__(self):
        (a, b), (ia, ib) = self.ns, self.ifs
        cmds = [
            ["ip", "netns", "add", a], ["ip", "netns", "add", b],
            ["ip", "link", "add", ia, "type", "veth", "peer", "name", ib],
            ["ip", "link", "set", ia, "netns", a], ["ip", "link", "set", ib, "netns", b],
            ["ip", "-n", a, "addr", "add", f"{self.addrs[0]}/24", "dev", ia],
            ["ip", "-n", b, "addr", "add", f"{self.addrs[1]}/24", "dev", ib],
            ["ip", "-n", a, "link", "set", "lo", "up"], ["ip", "-n", a, "link", "set", ia, "up"],
            ["ip", "-n", b, "link", "set", "lo", "up"], ["ip", "-n", b, "link", "set", ib, "up"],
        ]
        for cmd in cmds:
            subprocess.run(cmd, check=True, capture_output=True)
            if cmd[1:3] == ["netns", "add"]:
                self.made.append(cmd[3])
        return self

    def __exit__(self, *exc):
        for ns in self.made:  # deleting the namespaces removes the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def wrap(self, node: int, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[node], "env", f"GLOO_SOCKET_IFNAME={self.ifs[node]}", *cmd]


def run_two_nodes(wrap, master_addr: str) -> str:
    port = str(random.randint(20000, 40000))
    env = {**os.environ, "AFD_NUM_THREADS": "1"}
    common = ["--nnodes", "2", "--master-addr", master_addr, "--master-port", port]
    node1 = subprocess.Popen(wrap(1, afd(*common, "--node-rank", "1")), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        node0 = subprocess.run(wrap(0, afd(*common, "--node-rank", "0")), capture_output=True, text=True, timeout=180, env=env)
        out1, err1 = node1.communicate(timeout=60)
    finally:
        if node1.poll() is None:
            node1.kill()
    assert node0.returncode == 0, node0.stderr
    assert node1.returncode == 0, err1
    return node0.stdout


def test_two_nodes_equal_one_host():
    env = {**os.environ, "AFD_NUM_THREADS": "1"}
    one_host = subprocess.run(afd(), capture_output=True, text=True, timeout=180, env=env, check=True).stdout
    try:
        ns = Namespaces().__enter__()
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        warnings.warn(f"network namespaces unavailable ({e}); multi-node test runs over 127.0.0.1")
        two = run_two_nodes(lambda node, cmd: cmd, "127.0.0.1")
    else:
        try:
            two = run_two_nodes(ns.wrap, ns.addrs[0])
        finally:
            ns.__exit__(None, None, None)
    rows_one = [json.loads(l) for l in one_host.splitlines()]
    rows_two = [json.loads(l) for l in two.splitlines()]
    assert len(rows_one) == 3 and [r["token_ids"] for r in rows_two] == [r["token_ids"] for r in rows_one]


class Star:
    """Hosts around this test's namespace: ``n`` network namespaces, each joined to this one by a veth pair
    (only the namespaces and links this test made are touched; deleting a namespace removes its pair)."""

    def __init__(self, n: int) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns = [f"afd{tag}n{k + 1}" for k in range(n)]
        # subnets no interface here has: a namespace left by a killed run keeps its pair, and a second route to
        # the same /24 sent node 0's packets to it (a start that waited 300 s, one fault-test round in thirteen)
        taken = set(re.findall(r"inet 10\.79\.(\d+)\.", subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout))
        nets = random.SystemRandom().sample([k for k in range(1, 250) if str(k) not in taken], n)
        self.links = [(f"vh{tag}{k + 1}", f"vn{tag}{k + 1}", f"10.79.{net}.1", f"10.79.{net}.2") for k, net in enumerate(nets)]
        self.made: list[str] = []

    def __enter__(self) -> "Star":
        try:
            for ns, (here, there, addr_here, addr_there) in zip(self.ns, self.links):
                subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
                self.made.append(ns)
                for cmd in (["ip", "link", "add", here, "type", "veth", "peer", "name", there],
                            ["ip", "link", "set", there, "netns", ns],
                            ["ip", "addr", "add", f"{addr_here}/24", "dev", here], ["ip", "link", "set", here, "up"],
                            ["ip", "-n", ns, "addr", "add", f"{addr_there}/24", "dev", there],
                            ["ip", "-n", ns, "link", "set", "lo", "up"], ["ip", "-n", ns, "link", "set", there, "up"]):
                    subprocess.run(cmd, check=True, capture_output=True)
                route = subprocess.run(["ip", "-o", "route", "get", addr_there], check=True, capture_output=True, text=True).stdout
                assert f" dev {here} " in route, f"{addr_there} is not reached through {here}: {route}"
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def wrap(self, node: int, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[node - 1], *cmd]

    def master_addr(self, node: int) -> str:
        """Node 0's address as node ``node`` reaches it."""
        return self.links[node - 1][2]

    def pids(self, node: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.ns[node - 1]], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


class Loopback:
    """The fallback: every node on 127.0.0.1 (a node's processes are then found by their parent)."""

    def wrap(self, node: int, cmd: list[str]) -> list[str]:
        return cmd

    def master_addr(self, node: int) -> str:
        return "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _payload(i: int) -> dict:
    return {"model": MODEL_NAME, "prompt": f"KING {i}:", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.faults
def test_three_nodes_serve_the_monolithic_text_and_survive_an_ffn_nodes_loss(tmp_path):
    """Node 2 starts late, after node 0's attention rank linked to node 1's FFN rank and waits for node 2's:
    a link not yet in service is not watched for silence (the hang timeout is 2 s here), so the start is not
    a failure (it once was, one CI run in a few)."""
    try:
        hosts = Star(2).__enter__()
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        warnings.warn(f"network namespaces unavailable ({e}); the three-node test runs over 127.0.0.1")
        hosts = Loopback()
    port = str(_free_port())
    run_id = uuid.uuid4().hex[:12]
    flags = ["--attention-ranks", "1", "--ffn-ranks", "2", "--transport", "tcp", "--redundant-experts", "8", "--hang-timeout", "2",
             "--nnodes", "3", "--master-port", port]
    env = {**os.environ, "AFD_NUM_THREADS": "1", "AFD_RUN_ID": run_id}

    def start(k: int) -> subprocess.Popen:  # its output in files (a pipe no one reads could block it), shown on failure
        out, err = (open(tmp_path / f"node-{k}.{name}", "w") for name in ("out", "err"))
        with out, err:
            return subprocess.Popen(hosts.wrap(k, [sys.executable, "-m", "afd.cli.main", "serve", str(BUILTIN_MODEL), "--dtype", "float32",
                                                   *flags, "--node-rank", str(k), "--master-addr", hosts.master_addr(k)]),
                                    stdout=out, stderr=err, text=True, env=env)

    def said(k: int, name: str) -> str:
        path = tmp_path / f"node-{k}.{name}"
        return path.read_text() if path.exists() else "(not started)"

    nodes = {1: start(1)}
    late = threading.Timer(6.0, lambda: nodes.__setitem__(2, start(2)))  # once node 0 waits on it, past the hang timeout
    try:
        with Server() as mono:
            want = mono.streams([_payload(i) for i in range(6)])
        late.start()
        with Server(*flags, "--node-rank", "0", "--master-addr", hosts.master_addr(1), env={"AFD_RUN_ID": run_id}) as s:
            s.run_id = run_id  # every node's processes carry it: none may be left after the run
            assert any("every expert is on at least two FFN ranks" in line for line in s.stderr)
            assert len(s.rank_pids("attention")) == 1 and not s.rank_pids("ffn")  # node 0 runs no FFN rank
            assert s.streams([_payload(i) for i in range(6)]) == want, "three nodes differ from the monolithic server"
            # FFN rank 1 alone is killed: node 2's launcher starts its replacement, node 0 links to it
            rank = next(pid for pid, title in run_processes(run_id).items() if title == "afd ffn 1")
            assert s.streams([_payload(i) for i in range(6)], fault=lambda: os.kill(rank, signal.SIGKILL)) == want
            support.wait_for(lambda: s.metric("afd_ffn_replacements_total", wait=0) >= 1, 60, "the replacement of ffn rank 1 in use")
            assert s.metric("afd_ffn_replacements_total") == 1 and s.metric("afd_ffn_ranks_lost_total") == 1
            assert any(title == "afd ffn 1 g1" for title in run_processes(run_id).values())
            assert s.streams([_payload(i) for i in range(6)]) == want  # with the replacement in use
            # then the whole of node 2
            node2 = hosts.pids(2) if isinstance(hosts, Star) else [nodes[2].pid, *_children(nodes[2].pid)]
            assert nodes[2].pid in node2 and len(node2) >= 2  # its launcher and its FFN rank

            def lose_node_2() -> None:
                for pid in node2:  # every process on that host: ours, started by this test
                    os.kill(pid, signal.SIGKILL)

            got = s.streams([_payload(i) for i in range(6)], fault=lose_node_2)
            assert got == want, "a stream failed or changed when node 2 was lost"
            assert s.get("/health").status_code == 200
            assert s.metric("afd_ffn_ranks_lost_total") == 2
            assert s.streams([_payload(i) for i in range(6)]) == want  # and it goes on serving on node 1 alone
            assert nodes[1].poll() is None
        nodes[1].wait(timeout=60)  # SIGTERM on node 0 ends the run on node 1
        assert nodes[1].returncode == 0 and "the run ended" in said(1, "out"), said(1, "err")[-3000:]
    except BaseException:
        for k in (1, 2):
            print(f"--- node {k} (exit {nodes[k].poll() if k in nodes else None}) stderr:\n{said(k, 'err')[-6000:]}", file=sys.stderr)
        raise
    finally:
        late.cancel()
        late.join()
        for p in nodes.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        if isinstance(hosts, Star):
            hosts.__exit__()
