"""How the ranks of a tensor-parallel group find each other, on one node or on several.

One node (the default): ``serve --tensor-parallel-size N`` makes the calling process rank 0, which
spawns ranks 1..N-1; they meet on a TCP store on 127.0.0.1 at a free port.

Several nodes (SGLang's flags): every node runs the same ``serve`` command with ``--nnodes M
--node-rank R --dist-init-addr HOST:PORT``. Node R runs ranks R*N/M .. (R+1)*N/M - 1 (the first in its
``serve`` process, the others spawned); rank 0, on node 0, hosts the store on HOST:PORT and serves HTTP.
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) says the same with one
rank per process, so each such process is a "node" of one rank on device LOCAL_RANK.

Before the process group forms, rank 0 publishes in the store what every node must agree on (group
shape, dtype, the model's config.json), what the others adopt (packed experts, the collective timeout),
a random token and the port of its *link* listener. Each other node checks the agreement, connects a
plain TCP link to rank 0 and says hello (or why it refuses, which rank 0 reports at once instead of
waiting out the join timeout). The links carry nothing afterwards: they exist because a process that
exits (crash, kill, out of memory) has its sockets closed by the kernel at once, so rank 0 learns that a
node died without a collective's timeout, and a node learns that rank 0 went away (a close without
"bye") and exits instead of waiting for a message forever. A node that hangs, or a network that drops
packets silently, is caught by the collective timeout as on one node.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import ConfigError

log = logging.getLogger(__name__)

_KEY = "ds4serve/rank0"
_HELLO_TIMEOUT_S = 10.0  # a connection to the link listener says who it is within this, or is dropped
BYE = b"bye\n"


@dataclass(frozen=True)
class ParallelSettings:
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    timeout_s: float = 300.0  # a collective that takes longer means a rank died or hangs
    port: int | None = None  # one node: rendezvous port on localhost (None: a free one)
    # "module:function" each worker calls with (rank, engine) once built: fault injection for tests
    worker_hook: str | None = None
    nnodes: int = 1  # --nnodes: nodes the group spans, each running tensor_parallel_size / nnodes ranks
    node_rank: int = 0  # --node-rank: node 0 serves HTTP, the others run their ranks only
    dist_init_addr: str | None = None  # --dist-init-addr HOST:PORT: node 0's store (several nodes)
    join_timeout_s: float = 600.0  # --dist-timeout: how long the nodes may take to start and meet
    device_index: int | None = None  # torchrun's LOCAL_RANK: this process's device on its machine
    agent_store: bool = False  # torchrun's agent hosts the store: rank 0 connects to it like the others


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_addr(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--dist-init-addr {text!r}: give HOST:PORT of node 0, e.g. 10.0.0.1:5000")
    return host, int(port)


def check(s: ParallelSettings) -> None:
    """The group's shape is consistent (before anything loads or listens); ConfigError naming the flag."""
    n, m, r = s.tensor_parallel_size, s.nnodes, s.node_rank
    if n < 1:
        raise ConfigError("--tensor-parallel-size must be at least 1")
    if m < 1:
        raise ConfigError("--nnodes must be at least 1")
    if not 0 <= r < m:
        raise ConfigError(f"--node-rank {r} is out of range: with --nnodes {m} it must be 0..{m - 1}")
    if n % m:
        raise ConfigError(f"--tensor-parallel-size {n} is not divisible by --nnodes {m}: every node runs the "
                          "same number of ranks (tensor-parallel-size / nnodes)")
    if m > 1 and not s.dist_init_addr:
        raise ConfigError(f"--nnodes {m} needs --dist-init-addr HOST:PORT: an address of node 0 that every node "
                          "reaches, and a free port there")
    if m > 1:
        parse_addr(s.dist_init_addr)
    if s.join_timeout_s <= 0:
        raise ConfigError("--dist-timeout must be > 0 seconds")


def resolve(s: ParallelSettings, env: Mapping[str, str]) -> ParallelSettings:
    """The settings with torchrun's environment applied (when it launched this process), checked."""
    if "RANK" in env and "WORLD_SIZE" in env and int(env["WORLD_SIZE"]) > 1:
        if s.nnodes > 1:
            raise ConfigError("launched by torchrun (RANK / WORLD_SIZE are set): drop --nnodes / --node-rank / "
                              "--dist-init-addr, torchrun's environment says the same")
        world = int(env["WORLD_SIZE"])
        if s.tensor_parallel_size not in (1, world):
            raise ConfigError(f"--tensor-parallel-size {s.tensor_parallel_size} differs from torchrun's "
                              f"WORLD_SIZE {world}: every torchrun process is one rank of the group")
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise ConfigError(f"torchrun's environment lacks {', '.join(missing)}")
        host = env["MASTER_ADDR"]
        s = replace(s, tensor_parallel_size=world, nnodes=world, node_rank=int(env["RANK"]),
                    dist_init_addr=f"[{host}]:{env['MASTER_PORT']}" if ":" in host else f"{host}:{env['MASTER_PORT']}",
                    device_index=int(env.get("LOCAL_RANK", "0")),
                    agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
    check(s)
    return s


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the group: it runs rank ``first`` and spawns ``first + 1 ..
    first + local - 1`` (the rest of its node); the store is on ``host:port``."""

    world: int
    nnodes: int
    node_rank: int
    host: str
    port: int
    first: int
    local: int
    device_base: int = 0
    agent_store: bool = False
    join_timeout_s: float = 600.0

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def device(self, device: str | torch.device, rank: int) -> torch.device:
        """Rank ``rank``'s device: ``cuda:i`` by its index on this machine; a CPU rank's is the CPU."""
        d = torch.device(device)
        return torch.device("cuda", self.device_base + rank - self.first) if d.type == "cuda" else d


def topology(s: ParallelSettings) -> Topology:
    check(s)
    local = s.tensor_parallel_size // s.nnodes
    if s.nnodes == 1:
        host, port = "127.0.0.1", s.port or free_port()
    else:
        host, port = parse_addr(s.dist_init_addr)
    return Topology(s.tensor_parallel_size, s.nnodes, s.node_rank, host, port, s.node_rank * local, local,
                    s.device_index or 0, s.agent_store, s.join_timeout_s)


def open_store(topo: Topology, rank: int) -> dist.TCPStore:
    """Rank 0 hosts the store (unless torchrun's agent does); the others connect, waiting up to the
    join timeout. A failure names the address and what to check."""
    master = rank == 0 and not topo.agent_store
    try:
        return dist.TCPStore(topo.host, topo.port, topo.world, is_master=master,
                             timeout=timedelta(seconds=topo.join_timeout_s), wait_for_workers=False)
    except Exception as exc:  # torch's DistNetworkError / DistStoreError
        if master:
            raise ConfigError(f"cannot host the rendezvous on {topo.address}: {exc} (give --dist-init-addr a free "
                              "port on node 0)") from None
        raise ConfigError(f"could not reach the rendezvous at {topo.address} within {topo.join_timeout_s:g} s "
                          f"(--dist-timeout): is node 0 started with --dist-init-addr {topo.address}, and does "
                          f"this node reach that address? ({exc})") from None


def agreement(model_dir: Path, s: ParallelSettings, device: str, dtype: str) -> dict:
    """What every node must have the same of: compared on each node against rank 0's."""
    config = Path(model_dir) / "config.json"
    digest = hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.exists() else None
    return {"tensor-parallel-size": s.tensor_parallel_size, "enable-expert-parallel": s.expert_parallel,
            "nnodes": s.nnodes, "dtype": dtype, "device": torch.device(device).type, "model config.json": digest}


def _send_line(conn: socket.socket, payload: dict) -> None:
    conn.sendall(json.dumps(payload).encode() + b"\n")


def _read_line(conn: socket.socket, timeout: float) -> dict | None:
    conn.settimeout(timeout)
    data = b""
    try:
        while not data.endswith(b"\n") and len(data) < 65536:
            chunk = conn.recv(4096)
            if not chunk:
                return None
            data += chunk
        return json.loads(data)
    except (OSError, ValueError):
        return None
    finally:
        conn.settimeout(None)


class NodeLinks:
    """Rank 0's end: publish the rendezvous, gather every other node's hello, then hold the links."""

    def __init__(self, topo: Topology):
        self.topo = topo
        self.token = secrets.token_hex(16)
        if socket.has_dualstack_ipv6():
            self.listener = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            self.listener = socket.create_server(("", 0))
        self.links: dict[int, tuple[socket.socket, str]] = {}  # node -> (link, peer address)

    def publish(self, store: dist.Store, agreed: dict, adopted: dict) -> None:
        store.set(_KEY, json.dumps({"agreed": agreed, "adopted": adopted, "token": self.token,
                                    "link_port": self.listener.getsockname()[1]}))

    def gather(self) -> None:
        """Wait for nodes 1..M-1 to say hello (up to the join timeout); a refusal or a node that never
        comes is a ConfigError naming it."""
        deadline = time.monotonic() + self.topo.join_timeout_s
        while len(self.links) < self.topo.nnodes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, self.topo.nnodes)) - set(self.links))
                raise ConfigError(
                    f"node(s) {', '.join(map(str, missing))} did not join the rendezvous on {self.topo.address} "
                    f"within {self.topo.join_timeout_s:g} s (--dist-timeout): start `ds4serve serve` with the same "
                    f"flags and --node-rank N on each")
            self.listener.settimeout(min(left, 1.0))
            try:
                conn, peer = self.listener.accept()
            except TimeoutError:
                continue
            hello = _read_line(conn, _HELLO_TIMEOUT_S)
            if not hello or not hmac.compare_digest(str(hello.get("token", "")), self.token):
                conn.close()  # not one of ours (a port scan, a stale node of an earlier run)
                continue
            node = int(hello["node"])
            if hello.get("error"):
                conn.close()
                raise ConfigError(f"node {node} refused to join: {hello['error']}")
            host = peer[0].removeprefix("::ffff:")  # an IPv4 peer on the dual-stack listener
            self.links[node] = (conn, f"{host}:{peer[1]}")
            log.info("node %d joined from %s", node, host)
        self.listener.close()

    def bye(self) -> None:
        """Rank 0 stops on purpose: the nodes exit cleanly instead of reporting rank 0 lost."""
        for conn, _ in self.links.values():
            try:
                conn.sendall(BYE)
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        for conn, _ in self.links.values():
            conn.close()


class RankZeroLink:
    """A node's end: check rank 0's agreement, say hello (or refuse), then watch for rank 0 leaving."""

    def __init__(self, topo: Topology, store: dist.Store, agreed: dict):
        self.topo = topo
        try:
            info = json.loads(store.get(_KEY))
        except Exception as exc:  # torch's DistStoreError: the store did not get the key in time
            raise ConfigError(f"node 0 did not publish the rendezvous on {topo.address} within "
                              f"{topo.join_timeout_s:g} s (--dist-timeout): {exc}") from None
        self.adopted: dict = info["adopted"]
        differ = [f"{k}: node 0 has {info['agreed'].get(k)!r}, node {topo.node_rank} has {v!r}"
                  for k, v in agreed.items() if info["agreed"].get(k) != v]
        try:
            self.conn = socket.create_connection((topo.host, info["link_port"]), timeout=_HELLO_TIMEOUT_S)
        except OSError as exc:
            raise ConfigError(f"cannot open the link to rank 0 at {topo.host}:{info['link_port']}: {exc}") from None
        self.conn.settimeout(None)
        why = "; ".join(differ)
        _send_line(self.conn, {"token": info["token"], "node": topo.node_rank, "error": why})
        if differ:
            self.conn.close()
            raise ConfigError(f"node {topo.node_rank} does not match node 0 ({why}): run the same command on "
                              "every node, only --node-rank differs")

    def tell(self, why: str) -> None:
        """Rank 0's log says why this node goes (before the close it will see)."""
        try:
            self.conn.sendall(why.encode()[:4000] + b"\n")
        except OSError:
            pass

    def wait_for_rank0(self) -> bool:
        """Block until rank 0 says bye (True: a clean stop) or its side closes (False: it went away)."""
        data = b""
        while True:
            try:
                chunk = self.conn.recv(64)
            except OSError:
                chunk = b""
            if not chunk:
                return data.startswith(BYE)
            data += chunk
            if data.startswith(BYE):
                return True
