"""The promised-equal results of the native forward hold for every instruction set it is built for.

Batch invariance (a row's logprobs do not depend on its batch), prefix identity (a hit computes what a
cold run cut there computes) and the native-vs-torch checks passed on the machine they were written on
and failed on an AVX2 EPYC: GCC's default contraction fused multiply-adds differently in the tile, panel
and attention paths for that CPU (``-march=znver3`` here reproduces it on the code before the fix). The
forward is now built with ``-ffp-contract=off`` and explicit fused multiply-adds, and these tests rerun
the exactness suites in a fresh process against builds for other targets: one without FMA
(``x86-64-v2``), a Zen 3 tuned AVX2 build, and AVX-512 where the CPU has it. The default build
(``-march=native``) is the one the rest of the suite runs.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the native batch-invariance, multi-block, packed-expert, prefix-identity and draft-verification tests
# (speculative decoding promises plain decoding's bits), and every native-vs-torch comparison in those files
EXACTNESS = ["tests/test_host_forward.py", "tests/test_host_packed.py", "tests/test_host_q8.py", "tests/test_host_pairs.py",
             "tests/test_host_f8pairs.py",
             "tests/test_stored_weights.py",
             "tests/test_prefix_cache.py", "tests/test_spec_decode.py", "tests/test_capture.py",
             "tests/test_native_dspark.py"]
# the default build (-march=native, AVX-512 on the CI machine) runs with the whole suite; these two add a build
# without FMA and the AVX2 + FMA build tuned for Zen 3 whose contraction broke the promises before
TARGETS = ["x86-64-v2", "znver3"]
# predefined macros of a -march -> the /proc/cpuinfo flag the CPU needs to run such code: the extensions
# a compiler emits for plain C (not those only reached through intrinsics, like AES, SHA or RDSEED, which
# a virtual machine may hide while the target still runs)
_FEATURES = {"__SSE4_2__": "sse4_2", "__POPCNT__": "popcnt", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma",
             "__F16C__": "f16c", "__BMI__": "bmi1", "__BMI2__": "bmi2", "__MOVBE__": "movbe", "__LZCNT__": "abm",
             "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512DQ__": "avx512dq",
             "__AVX512VL__": "avx512vl", "__AVX512CD__": "avx512cd"}


@lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.split(":", 1)[-1].split())


def _missing(target: str) -> str | None:
    """Why code built for ``target`` cannot run on this CPU (None: it can)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler"
    done = subprocess.run([cc, f"-march={target}", "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True)
    if done.returncode != 0:
        return f"the compiler does not know -march={target}"
    macros = set(re.findall(r"#define (__\w+__) ", done.stdout))
    lacking = sorted(flag for macro, flag in _FEATURES.items() if macro in macros and flag not in _cpu_flags())
    return f"this CPU lacks {', '.join(lacking)}" if lacking else None


def _run(target: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS4SERVE_NATIVE_TARGET=target, **(env or {}))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("target", TARGETS)
def test_exactness_suites_hold_for_the_target(target):
    why = _missing(target)
    if why:
        pytest.skip(f"{target}: {why}")
    built = _run(target, "-c", "from ds4serve.model import host_forward as h; h.library(); print(h.description())")
    assert built.returncode == 0 and f"-march={target}" in built.stdout, built.stderr[-2000:]
    # host-off cases run the torch forward, which no -march changes: the main run has them
    done = _run(target, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k", "not host-off", *EXACTNESS)
    assert done.returncode == 0, f"built for {target}:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"


def test_a_named_target_is_what_gets_built_and_says_what_it_computes_with():
    """The target decides FMA; a target without it gets the separate multiply and add (never a silent
    fallback to another target), and the description the start-up log prints names both."""
    probe = "from ds4serve.model import host_forward as h; lib = h.library(); print(h.description())"
    for target, fma in (("x86-64-v2", "no FMA"), ("x86-64-v3", "fused multiply-add")):
        if _missing(target):
            continue
        out = _run(target, "-c", probe)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"-march={target}" in out.stdout and fma in out.stdout and "contraction off" in out.stdout
    bad = _run("no-such-cpu", "-c", probe)
    assert "None" in bad.stdout and "no-such-cpu" in bad.stderr  # unavailable, and the log says why


def test_the_start_up_log_names_the_target(ckpt_factory, caplog):
    from ds4serve.llm import LLM
    from ds4serve.model import host_forward

    if host_forward.library() is None:
        pytest.skip("no C compiler: the native forward is not built here")
    _, path = ckpt_factory("A")
    with caplog.at_level(logging.INFO, logger="ds4serve"):
        llm = LLM(path, max_seqs=2, host_kernels="on", warmup=False)
    assert llm.core.executor.host is not None
    line = next(r.getMessage() for r in caplog.records if "native host forward on" in r.getMessage())
    assert f"built for {host_forward.description()}" in line and "-march=native" in line and "contraction off" in line


@pytest.mark.parametrize("flags", [["-march=native"], ["-march=x86-64-v2", "-Wno-psabi"], ["-march=native", "-DDS4_CHECK"]],
                         ids=["native", "no-fma", "checked"])
def test_the_c_compiles_without_warnings(flags):
    """-Wall -Wextra as errors, for every C part and build kind: an implicit declaration (ldexpf without
    math.h compiled to a call returning int under older rules) or an unused bound is a bug waiting."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    csrc = ROOT / "ds4serve" / "model" / "csrc"
    for path in (csrc / "host.c", csrc / "kernels.c", ROOT / "ds4serve" / "cache" / "csrc" / "view.c"):
        done = subprocess.run([cc, *flags, "-Wall", "-Wextra", "-Werror", "-fsyntax-only", f"-I{csrc}", str(path)],
                              capture_output=True, text=True)
        assert done.returncode == 0, f"{path.name} with {' '.join(flags)}:\n{done.stderr[-3000:]}"
