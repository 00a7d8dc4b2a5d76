"""The steps of scripts/gpu_check.sh after the install: each in its own process with its own time
limit, figures collected, ONE markdown summary table at the end whatever failed.

    python scripts/gpu_check.py --device cuda [--quick] [--out DIR] [--budget SECONDS]
    python scripts/gpu_check.py --render DIR/results.json     # the table of an earlier (partial) run
    python scripts/gpu_check.py --plan [--quick]              # the commands, without running them

Steps: (device) torch sees the device; (tests) the CUDA tests (every tests/test_*.py that gates on
``torch.cuda.is_available()``; on cuda the CUDA-gated tests must run, not skip); (bench engine)
``ds4serve bench engine --device D`` (transformers' side only where transformers imports); (serve
smoke) ``ds4serve serve --device D`` on models/ds4v-tiny and one chat completion with a generated
PNG ``data:`` URL (200 and a non-empty answer; whether it is the right colour is reported too);
(images) the mixed-traffic pause measurement, ``python -m ds4serve.bench.images_bench --device D``.

Only the standard library is imported at the top, so ``--render`` and ``--plan`` work anywhere.
Results are written to ``DIR/results.json`` after every step, so a run killed from outside still
leaves the steps it finished.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

# per-step limits (seconds; doubled on cpu), 420 s in all; all steps together are capped by --budget
# (gpu_check.sh passes 465 s minus what the install took, at most 400), each later step keeping a
# third of its limit, so the whole check stays under 8 minutes even when steps hang
LIMITS = {"device": 20, "tests": 100, "bench engine": 140, "serve smoke": 60, "tensor parallel": 50, "images": 80}


@dataclass
class Step:
    name: str
    status: str = "not run"  # pass / FAIL / TIMEOUT / skipped / not run
    seconds: float = 0.0
    figures: str = ""
    log: str = ""
    data: dict = field(default_factory=dict)


# --- rendering ----------------------------------------------------------------------------------

def render(steps: list[Step], header: dict) -> str:
    """The one summary table (markdown) and a verdict line."""
    ok = all(s.status in ("pass", "skipped") for s in steps) and any(s.status == "pass" for s in steps)
    lines = [f"## GPU check summary: {header.get('device', '?')}"
             + (" (quick: small sizes)" if header.get("quick") else ""), ""]
    if header.get("machine"):
        lines += [header["machine"], ""]
    lines += ["| step | result | time | figures |", "|---|---|---:|---|"]
    for s in steps:
        figures = s.figures.replace("|", "/").replace("\n", "; ") or "-"
        lines.append(f"| {s.name} | {s.status} | {s.seconds:.0f} s | {figures} |")
    total = sum(s.seconds for s in steps)
    lines += ["", f"total {total:.0f} s; {'ALL PASSED' if ok else 'SOME STEPS DID NOT PASS'}"
              + (f"; logs in {header['out']}" if header.get("out") else "")]
    return "\n".join(lines)


def save(out: Path, steps: list[Step], header: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps({"header": header, "steps": [asdict(s) for s in steps]}, indent=1))
    tmp.replace(out / "results.json")


def load(path: Path) -> tuple[list[Step], dict]:
    d = json.loads(Path(path).read_text())
    return [Step(**s) for s in d["steps"]], d["header"]


# --- running ------------------------------------------------------------------------------------

def run_logged(cmd: list[str], log: Path, limit: float, env: dict | None = None) -> tuple[int | None, float]:
    """Run ``cmd`` in its own process group, output to ``log``; kill the group at ``limit`` seconds.
    Returns (exit code or None on timeout, seconds)."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env=env)
        try:
            rc = proc.wait(timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            _kill(proc)
            rc = None
    return rc, time.monotonic() - t0


def _kill(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, n: int = 12) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def env_for(device: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("DS4SERVE_LOG_LEVEL", "WARNING")
    return env


def cuda_test_files() -> list[str]:
    """The test files that gate on CUDA (grep), test_decode_graphs.py always among them."""
    files = {"tests/test_decode_graphs.py"}
    for p in sorted((ROOT / "tests").glob("test_*.py")):
        text = p.read_text(errors="replace")
        if re.search(r"cuda\.is_available\(\)|device=[\"']cuda", text):
            files.add(f"tests/{p.name}")
    return sorted(files)


def has_transformers() -> bool:
    r = subprocess.run([PY, "-c", "import transformers; transformers.DeepseekV4ForCausalLM"],
                       capture_output=True, cwd=ROOT)
    return r.returncode == 0


def plan(device: str, quick: bool, out: Path, transformers: bool | None = None) -> dict[str, list[str]]:
    """The command of every step that is a plain command (serve smoke is driven in-process)."""
    tf = has_transformers() if transformers is None else transformers
    engine = [PY, "-m", "ds4serve.cli", "bench", "engine", "--device", device, "--json", str(out / "engine.json")]
    engine += ["--streams", "1,4", "--prompt-len", "32", "--new-tokens", "8", "--rounds", "1"] if quick else \
        ["--streams", "1,4,16,32", "--rounds", "3"]
    if not tf:
        engine.append("--no-transformers")
    images = [PY, "-m", "ds4serve.bench.images_bench", "--device", device, "--json", str(out / "images.json")]
    images += ["--rounds", "1", "--text-tokens", "24", "--new-tokens", "2"] if quick else ["--rounds", "3"]
    tests = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "--junitxml", str(out / "tests.xml")]
    tests += ["-k", "cuda_graph or failing_capture"] if quick else []
    # two CPU processes over gloo on the bundled model, with images: the same answers as one process
    parallel = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "--junitxml", str(out / "tensor-parallel.xml"),
                "tests/test_tensor_parallel.py", "-k", "two_ranks and not ep"]
    return {"tests": tests + cuda_test_files(), "bench engine": engine, "images": images, "tensor parallel": parallel,
            "serve smoke": [PY, "-m", "ds4serve.cli", "--log-level", "WARNING", "serve", "--device", device,
                            "--model", "models/ds4v-tiny", "--port", "PORT"]}


def step_limit(i: int, remaining: float, device: str) -> float:
    """Seconds step ``i`` may take: its own limit (doubled on cpu), but never so much of the time
    left that a later step gets less than a third of its own limit."""
    names = list(LIMITS)
    reserve = sum(LIMITS[n] / 3 for n in names[i + 1:])
    # whole milliseconds, rounded down: float sums of the limits never exceed the budget
    return math.floor(min(LIMITS[names[i]] * (2 if device == "cpu" else 1), remaining - reserve) * 1000) / 1000


def step_device(device: str, out: Path, limit: float) -> Step:
    s = Step("device")
    probe = ("import json, torch; c = torch.cuda.is_available(); "
             "print(json.dumps({'torch': torch.__version__, 'cuda': c, 'cuda_version': torch.version.cuda, "
             "'name': torch.cuda.get_device_name(0) if c else None, "
             "'mem_gib': round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if c else None, "
             "'threads': torch.get_num_threads()}))")
    rc, s.seconds = run_logged([PY, "-c", probe], out / "device.log", limit)
    s.log = str(out / "device.log")
    try:
        info = json.loads(Path(s.log).read_text().splitlines()[-1])
    except (ValueError, IndexError):
        s.status, s.figures = ("TIMEOUT" if rc is None else "FAIL"), tail(s.log, 3)
        return s
    s.data = info
    if device == "cuda":
        s.status = "pass" if info["cuda"] else "FAIL"
        s.figures = (f"{info['name']}, {info['mem_gib']} GiB; torch {info['torch']} (CUDA {info['cuda_version']})"
                     if info["cuda"] else f"torch {info['torch']}: torch.cuda.is_available() is False")
    else:
        s.status, s.figures = "pass", f"cpu, {info['threads']} threads; torch {info['torch']}"
    return s


def junit_counts(xml: Path) -> tuple[dict[str, int], dict[str, str]]:
    """(passed / failed / skipped counts, {name: result} of the tests named *cuda*) of a JUnit XML
    report; zero counts when there is none (pytest killed before writing it)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    cuda_cases: dict[str, str] = {}
    try:
        for case in ET.parse(xml).getroot().iter("testcase"):
            res = "failed" if case.find("failure") is not None or case.find("error") is not None else \
                "skipped" if case.find("skipped") is not None else "passed"
            counts[res] += 1
            if "cuda" in case.get("name", "").lower():
                cuda_cases[case.get("name")] = res
    except (ET.ParseError, OSError):
        pass
    return counts, cuda_cases


def step_tests(cmd: list[str], device: str, out: Path, limit: float, name: str = "tests") -> Step:
    s = Step(name)
    xml = Path(cmd[cmd.index("--junitxml") + 1])
    xml.unlink(missing_ok=True)
    log = out / (xml.stem + ".log")
    rc, s.seconds = run_logged(cmd, log, limit, env_for(device))
    s.log = str(log)
    counts, cuda_cases = junit_counts(xml)
    files = [c for c in cmd if c.startswith("tests/")]
    s.data = counts | {"cuda_cases": cuda_cases, "files": files}
    s.figures = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
                 f"({', '.join(Path(f).name for f in files)})")
    if cuda_cases:
        s.figures += "; " + ", ".join(f"{k}: {v}" for k, v in cuda_cases.items())
    if "No module named 'transformers'" in Path(s.log).read_text(errors="replace"):
        s.figures += " (the tests' reference checkpoints need transformers: bring it in the wheelhouse)"
    cuda_ran = all(v == "passed" for v in cuda_cases.values()) and bool(cuda_cases)
    if rc is None:
        s.status = "TIMEOUT"
    elif rc != 0 or counts["failed"]:
        s.status = "FAIL"
    elif device == "cuda" and not cuda_ran and name == "tests":
        s.status, s.figures = "FAIL", s.figures + " (the CUDA test did not run)"
    else:
        s.status = "pass"
    return s


def _run_for_json(s: Step, cmd: list[str], device: str, out: Path, limit: float,
                  stem: str) -> tuple[int | None, dict | None]:
    """Run a bench that writes ``out/<stem>.json``: its exit status (None: killed at the limit) and
    figures, or None figures with ``s`` marked failed and the log's last lines as its figures."""
    js = out / f"{stem}.json"
    js.unlink(missing_ok=True)
    rc, s.seconds = run_logged(cmd, out / f"{stem}.log", limit, env_for(device))
    s.log = str(out / f"{stem}.log")
    try:
        return rc, json.loads(js.read_text())
    except (OSError, ValueError):
        s.status = "TIMEOUT" if rc is None else "FAIL"
        s.figures = tail(s.log, 2)[-300:]
        return rc, None


def step_engine(cmd: list[str], device: str, out: Path, limit: float) -> Step:
    s = Step("bench engine")
    rc, d = _run_for_json(s, cmd, device, out, limit, "engine")
    if d is None:
        return s
    s.data = d
    parts = []
    for r in d["rows"]:
        p = f"{r['streams']} streams {r['ours_tok_s']:.0f} tok/s ({r['ours_step_ms']:.1f} ms/step)"
        if r.get("hf_tok_s"):
            p += f" vs transformers {r['hf_tok_s']:.0f} = {r['ratio']:.2f}x"
        parts.append(p)
    b = d.get("breakdown", {})
    graphs = (f"decode graphs {b.get('decode_graphs')}: {b.get('graph_captures')} captured, "
              f"{b.get('graph_replays')} replays")
    if b.get("graphs_disabled"):
        graphs += f", TURNED OFF: {b['graphs_disabled']}"
    parts.append(graphs)
    if "--no-transformers" in cmd:
        parts.append("transformers not importable: ds4serve side only")
    s.figures = "; ".join(parts)
    graphs_ok = device != "cuda" or (not b.get("graphs_disabled") and (b.get("graph_replays") or 0) > 0)
    s.status = "pass" if rc == 0 and graphs_ok else ("TIMEOUT" if rc is None else "FAIL")
    return s


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _smoke_image() -> tuple[str, str, str]:
    """(data: URL, question, expected answer): a picture like the bundled model's training data."""
    sys.path.insert(0, str(ROOT))
    from ds4serve.tiny.data import Shape, draw  # noqa: PLC0415

    im = draw([Shape("triangle", "green", 4), Shape("circle", "red", 0), Shape("square", "blue", 8)])
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), "What colour is the triangle?", "green"


def step_serve(cmd: list[str], device: str, out: Path, limit: float) -> Step:
    s = Step("serve smoke")
    port = _free_port()
    cmd = [str(port) if c == "PORT" else c for c in cmd]
    s.log = str(out / "serve.log")
    t0 = time.monotonic()
    deadline = t0 + limit
    with open(s.log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env=env_for(device))
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                s.status, s.figures = "FAIL", f"server exited ({proc.returncode}) during start-up: " + tail(s.log, 2)
                return s
            if time.monotonic() > deadline:
                s.status, s.figures = "TIMEOUT", "server not healthy in time"
                return s
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.3)
        startup = time.monotonic() - t0
        url, question, expected = _smoke_image()
        body = {"model": "ds4v-tiny", "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": question}]}]}
        req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t1 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=max(deadline - time.monotonic(), 1)) as r:
                code, payload = r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            code, payload = e.code, {"error": e.read().decode(errors="replace")[:300]}
        except OSError as e:
            s.status = "TIMEOUT" if time.monotonic() > deadline else "FAIL"
            s.figures = f"request failed: {e}"
            return s
        latency = time.monotonic() - t1
        answer = ""
        if code == 200:
            answer = (payload["choices"][0]["message"].get("content") or "").strip()
        s.data = {"status": code, "answer": answer, "expected": expected, "startup_s": startup, "latency_s": latency,
                  "usage": payload.get("usage")}
        right = "right" if answer.lower().startswith(expected) else f"expected {expected!r}"
        s.figures = (f"HTTP {code}, answer {answer!r} ({right}) to {question!r}; start-up {startup:.1f} s, "
                     f"request {1000 * latency:.0f} ms")
        if code != 200:
            s.figures += f"; {payload.get('error', '')}"
        s.status = "pass" if code == 200 and answer else "FAIL"
        return s
    finally:
        s.seconds = time.monotonic() - t0
        _kill(proc)


def step_images(cmd: list[str], device: str, out: Path, limit: float) -> Step:
    s = Step("images")
    rc, d = _run_for_json(s, cmd, device, out, limit, "images")
    if d is None:
        return s
    sl, wh = d["sliced"], d["whole"]
    s.data = {"sliced": sl, "whole": wh, "overhead": d["overhead"], "answers_match": d["answers_match"],
              "leaks": d["leaks"]}
    s.figures = (f"text streams' longest pause while 11 images prefill: sliced {sl['longest_pause_ms']:.1f} ms "
                 f"({sl['pause_ratio']:.2f}x the median gap {sl['median_gap_ms']:.1f} ms; target <= 3x), whole "
                 f"{wh['longest_pause_ms']:.1f} ms ({wh['pause_ratio']:.2f}x); slicing overhead "
                 f"{100 * d['overhead']:+.1f}% wall; 4 image answers concurrent {d['four_concurrent_s']:.2f} s vs "
                 f"sequential {d['four_sequential_s']:.2f} s; answers sliced == whole: "
                 f"{'yes' if d['answers_match'] else 'NO'}; leaks: {d['leaks']}")
    s.status = "pass" if rc == 0 and d["answers_match"] and d["leaks"] == "none" else \
        ("TIMEOUT" if rc is None else "FAIL")
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=os.environ.get("GPU_CHECK_DEVICE", "cuda"))
    ap.add_argument("--quick", action="store_true", help="small sizes (for a CPU run of the same steps)")
    ap.add_argument("--out", type=Path, default=ROOT / "gpu-check-out")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET", "400")),
                    help="seconds for all steps together (each also has its own limit)")
    ap.add_argument("--install", default="", help="'STATUS|SECONDS|figures' of the install done by gpu_check.sh")
    ap.add_argument("--render", type=Path, default=None, help="print the table of an earlier results.json")
    ap.add_argument("--plan", action="store_true", help="print the step commands and limits, run nothing")
    a = ap.parse_args(argv)
    if a.render:
        steps, header = load(a.render)
        print(render(steps, header))
        return 0 if all(s.status in ("pass", "skipped") for s in steps) else 1
    out = a.out.resolve()
    cmds = plan(a.device, a.quick, out)
    if a.plan:
        for name, limit in LIMITS.items():
            print(f"{name} (<= {limit} s): " + (" ".join(cmds[name]) if name in cmds else "torch device probe"))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    header = {"device": a.device, "quick": a.quick, "out": str(out), "machine": "",
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    steps: list[Step] = []
    if a.install:
        st, secs, figs = (a.install.split("|", 2) + ["", ""])[:3]
        steps.append(Step("install", st, float(secs or 0), figs))
    names = list(LIMITS)
    todo = [Step(n) for n in names]
    steps += todo
    deadline = time.monotonic() + a.budget
    runners = {"tests": step_tests, "bench engine": step_engine, "serve smoke": step_serve, "images": step_images,
               "tensor parallel": lambda cmd, dev, o, lim: step_tests(cmd, dev, o, lim, "tensor parallel")}
    device_ok = True
    for i, name in enumerate(names):
        save(out, steps, header)
        limit = step_limit(i, deadline - time.monotonic(), a.device)
        idx = steps.index(todo[i])
        if limit < 5:
            steps[idx] = Step(name, "skipped", 0, "no time left in the budget")
            continue
        if name != "device" and not device_ok:
            steps[idx] = Step(name, "skipped", 0, f"{a.device} is not available")
            continue
        print(f"== {name} (limit {limit:.0f} s)", flush=True)
        try:
            if name == "device":
                res = step_device(a.device, out, limit)
                device_ok = res.status == "pass"
                header["machine"] = res.figures if device_ok else ""
            else:
                res = runners[name](cmds[name], a.device, out, limit)
        except Exception as e:  # a bug in one step must not lose the table
            res = Step(name, "FAIL", 0, f"{type(e).__name__}: {e}")
        steps[idx] = res
        print(f"   {res.status} in {res.seconds:.0f} s: {res.figures}", flush=True)
        if res.status != "pass" and res.log:
            print("   last lines of " + res.log + ":\n      " + tail(Path(res.log), 8).replace("\n", "\n      "),
                  flush=True)
    save(out, steps, header)
    table = render(steps, header)
    (out / "summary.md").write_text(table + "\n")
    print("\n" + table, flush=True)
    return 0 if all(s.status in ("pass", "skipped") for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
