"""Two "nodes" on one machine: a tensor + expert parallel group over two processes that meet on a TCP
rendezvous on 127.0.0.1 (``serve --nnodes 2 --node-rank R --dist-init-addr``), gloo on CPU.

Node 0 is this test process (the in-process server, rank 0, HTTP); node 1 is a separate ``ds4serve
serve --node-rank 1`` process started through the real command line. The reference is the same server
in one process: 8 concurrent greedy chat requests, half with an image, must give the same text, and
their top-5 logprobs may differ only by the reordered floating-point sums of the all-reduces (as in
tests/test_tensor_parallel.py). Node 1 exits 0 when node 0 stops; a killed node 1 stops node 0 with an
error naming it, not a hang. The argument errors and the rendezvous's refusals are checked without a
model.
"""

from __future__ import annotations

import base64
import logging
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import openai
import pytest

from ds4serve.cli import main
from ds4serve.config import ConfigError
from ds4serve.runtime.tp_group import ParallelSettings
from ds4serve.runtime.rendezvous import NodeLinks, RankZeroLink, agreement, open_store, resolve, topology
from ds4serve.tiny.random_model import BUNDLED
from image_helpers import image_url
from server_harness import free_port, serve

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

SAMPLE = "data:image/png;base64," + base64.b64encode((BUNDLED / "sample.png").read_bytes()).decode()
QUESTIONS = ["What is 7 + 5?", "What colour is the triangle?", "How many shapes are there?", "What colour is it?",
             "Reverse: abc", "Which shape is blue?", "What is 3 + 4?", "Where is the circle?"]
SETTINGS = {"max_seqs": 8}
TIMEOUT_S = 30.0  # the collective timeout: far above any healthy wait on 2 busy cores, far below a hang


def _ask(client: openai.OpenAI, i: int) -> tuple[str, list[list[tuple[str, float]]]]:
    """Prompt ``i``: odd ones carry an image (the bundled sample for 1, drawn ones for the others)."""
    image = SAMPLE if i == 1 else image_url(i)
    q = QUESTIONS[i]
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": q}] if i % 2 else q
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                       max_tokens=10, temperature=0, logprobs=True, top_logprobs=5)
    top = [[(t.token, t.logprob) for t in c.top_logprobs] for c in r.choices[0].logprobs.content]
    return r.choices[0].message.content, top


def _eight(srv) -> list:
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=4 * TIMEOUT_S)
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda i: _ask(client, i), range(8)))


def _node1(port: int) -> subprocess.Popen:
    """``ds4serve serve --node-rank 1`` as its own process (one CPU thread: the machine has two cores)."""
    cmd = [sys.executable, "-c", "import sys; from ds4serve.cli import main; sys.exit(main())", "serve",
           "--model", str(BUNDLED), "--tensor-parallel-size", "2", "--enable-expert-parallel", "--nnodes", "2",
           "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{port}", "--threads", "1", "--dist-timeout", "120"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _node0(port: int) -> ParallelSettings:
    return ParallelSettings(2, True, timeout_s=TIMEOUT_S, nnodes=2, node_rank=0,
                            dist_init_addr=f"127.0.0.1:{port}", join_timeout_s=120)


def _wait_for(what: str, happened, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not happened():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within_s:.0f} s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def one_process():
    with serve(BUNDLED, random_weights=False, settings=SETTINGS) as srv:
        return _eight(srv)


def test_two_nodes_answer_as_one_process_and_node_1_exits_with_node_0(one_process):
    port = free_port()
    node1 = _node1(port)
    try:
        with serve(BUNDLED, random_weights=False, settings=SETTINGS, parallel=_node0(port)) as srv:
            assert srv.loop.core.parallel.links.links.keys() == {1}  # the group really spans the other process
            got = _eight(srv)
        out, _ = node1.communicate(timeout=60)
    finally:
        if node1.poll() is None:
            node1.kill()
    assert node1.returncode == 0, out[-3000:]
    assert "node 1: rank 0 stopped the group; exiting" in out
    assert [g[0] for g in got] == [b[0] for b in one_process]
    assert got[0][0] == "12" and got[1][0] == "green"  # the model really answers, on text and on the image
    diffs = [abs(x[1] - y[1]) for a, b in zip(one_process, got) for ta, tb in zip(a[1], b[1])
             for x, y in zip(ta, tb) if x[0] == y[0]]
    assert len(diffs) >= 8 * 5
    logging.getLogger(__name__).warning("two nodes, tp=2 ep: max top-5 logprob difference %.3g", max(diffs))
    assert max(diffs) < 1e-4


def test_a_killed_node_stops_the_serving_node_with_a_clear_error(caplog):
    port = free_port()
    node1 = _node1(port)
    try:
        with serve(BUNDLED, random_weights=False, settings=SETTINGS, parallel=_node0(port)) as srv:
            client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=4 * TIMEOUT_S)
            assert _ask(client, 0)[0] == "12"
            with caplog.at_level(logging.CRITICAL, logger="ds4serve"):
                node1.send_signal(signal.SIGKILL)
                _wait_for("node 0 stopping after node 1 died", lambda: not srv.loop.alive, 2 * TIMEOUT_S)
                with pytest.raises(openai.APIError) as err:
                    _ask(client, 0)
                assert not isinstance(err.value, openai.APITimeoutError), "the request hung until the client gave up"
            logged = " ".join(r.getMessage() for r in caplog.records)
            assert "tensor-parallel node 1 (ranks 1-1, 127.0.0.1:" in logged and "is gone" in logged, logged
    finally:
        node1.kill()
        node1.communicate(timeout=30)


@pytest.mark.parametrize("settings, message", [
    (ParallelSettings(2, nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:5000"),
     "--node-rank 2 is out of range: with --nnodes 2 it must be 0..1"),
    (ParallelSettings(3, nnodes=2, dist_init_addr="127.0.0.1:5000"),
     "--tensor-parallel-size 3 is not divisible by --nnodes 2"),
    (ParallelSettings(2, nnodes=4, dist_init_addr="127.0.0.1:5000"),
     "--tensor-parallel-size 2 is not divisible by --nnodes 4"),
    (ParallelSettings(2, nnodes=2), "--nnodes 2 needs --dist-init-addr HOST:PORT"),
    (ParallelSettings(2, nnodes=2, dist_init_addr="node0"), "--dist-init-addr 'node0': give HOST:PORT"),
    (ParallelSettings(2, nnodes=2, dist_init_addr="127.0.0.1:70000"), "give HOST:PORT"),
])
def test_argument_errors_name_the_flag(settings, message):
    with pytest.raises(ConfigError) as err:
        resolve(settings, {})
    assert message in str(err.value)


def test_torchrun_environment_stands_in_for_the_node_flags():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    s = resolve(ParallelSettings(1, True), env)
    assert (s.tensor_parallel_size, s.nnodes, s.node_rank, s.dist_init_addr, s.device_index, s.agent_store) == \
        (4, 4, 3, "10.1.2.3:29500", 1, True)
    topo = topology(s)
    assert (topo.first, topo.local, str(topo.device("cuda", 3)), topo.address) == (3, 1, "cuda:1", "10.1.2.3:29500")
    with pytest.raises(ConfigError, match="differs from torchrun's WORLD_SIZE 4"):
        resolve(ParallelSettings(2), env)
    with pytest.raises(ConfigError, match="drop --nnodes"):
        resolve(ParallelSettings(4, nnodes=2, dist_init_addr="a:1"), env)
    assert resolve(ParallelSettings(2), {"RANK": "0", "WORLD_SIZE": "1"}).nnodes == 1  # one process: ignored


def test_the_command_line_refuses_bad_flags_and_an_unreachable_rendezvous(capsys):
    assert main(["serve", "--model", str(BUNDLED), "-tp", "2", "--nnodes", "2", "--node-rank", "5",
                 "--dist-init-addr", "127.0.0.1:5000"]) == 2
    assert "ds4serve: --node-rank 5 is out of range" in capsys.readouterr().err
    port = free_port()  # nobody listens there
    t0 = time.monotonic()
    assert main(["serve", "--model", str(BUNDLED), "-tp", "2", "--nnodes", "2", "--node-rank", "1",
                 "--dist-init-addr", f"127.0.0.1:{port}", "--dist-timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert f"could not reach the rendezvous at 127.0.0.1:{port} within 2 s (--dist-timeout)" in err, err
    assert time.monotonic() - t0 < 30


def _pair(**node1):
    """Node 0's published rendezvous and node 1's settings (node 1 differing by ``node1``)."""
    s0 = ParallelSettings(2, True, nnodes=2, dist_init_addr=f"127.0.0.1:{free_port()}", join_timeout_s=20)
    s1 = replace(s0, node_rank=1, **node1)
    links = NodeLinks(topology(s0))
    store = open_store(links.topo, 0)
    links.publish(store, agreement(BUNDLED, s0, "cpu", "float32"), {"packed_experts": False, "timeout_s": 5.0})
    return links, store, s1


def _join(s1: ParallelSettings, box: list) -> None:
    topo = topology(s1)
    try:
        box.append(RankZeroLink(topo, open_store(topo, 1), agreement(BUNDLED, s1, "cpu", "float32")))
    except ConfigError as exc:
        box.append(exc)


def test_a_node_with_other_flags_is_refused_at_once_on_both_ends():
    links, _store, s1 = _pair(expert_parallel=False)
    box: list = []
    t = threading.Thread(target=_join, args=(s1, box))
    t.start()
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="node 1 refused to join: enable-expert-parallel: node 0 has True, "
                                          "node 1 has False"):
        links.gather()
    assert time.monotonic() - t0 < 15  # not the 20 s join timeout
    t.join(timeout=30)
    assert isinstance(box[0], ConfigError) and "only --node-rank differs" in str(box[0])
    links.close()


@pytest.mark.parametrize("bye", [True, False], ids=["rank-0-stops", "rank-0-vanishes"])
def test_a_node_tells_a_clean_stop_from_rank_0_going_away(bye):
    links, _store, s1 = _pair()
    box: list = []
    t = threading.Thread(target=_join, args=(s1, box))
    t.start()
    links.gather()
    t.join(timeout=30)
    link = box[0]
    assert link.adopted == {"packed_experts": False, "timeout_s": 5.0}
    if bye:
        links.bye()
    links.close()
    assert link.wait_for_rank0() is bye
    link.conn.close()
