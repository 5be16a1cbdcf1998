"""Two invocations with --nnodes 2 (attention on node 0, FFN on node 1), each in its own network
namespace joined by a veth pair, give the same output as a one-host run. Falls back to 127.0.0.1
(and says so) where namespaces cannot be made."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
import warnings

from afd.cli.common import BUILTIN_MODEL

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
