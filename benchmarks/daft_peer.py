"""Daft as a peer: its own virtualenv, made on first use, and its cases run as
subprocesses (``daft_child.py``) whose one-line JSON result becomes the suite's rounds.

Daft 0.7.x pins ray<2.60 and pyarrow<26; this project runs Ray 2.60 and pyarrow 26. So
``daft[ray]==0.7.26`` (ray 2.59, pyarrow 25.0.1) goes into ``.venv-daft/`` at the
repository root (git-ignored), made once with ``python -m venv`` and pip. If it cannot be
made (no network, no pip), every Daft case is recorded as skipped with the reason.

The shuffle is chosen with ``daft.set_execution_config(shuffle_algorithm=...)``
("map_reduce", "pre_shuffle_merge", "flight_shuffle" or "auto"; daft/context.py, 0.7.26);
the child reports its physical plan's shuffle node (``RayShuffle`` / ``FlightShuffle``)
and the suite checks it is the one asked for.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

DAFT_SPEC = "daft[ray]==0.7.26"
# What the child imports besides Daft and its own dependencies (numpy, pyarrow):
# ``benchmarks.workloads`` -> ``hybrid_ray.partitioning`` -> xxhash, pinned as
# pyproject.toml pins it. The venv lacked it once partitioning began to use it, and every
# Daft case failed with "No module named 'xxhash'".
CHILD_REQUIREMENTS = ("xxhash==4.1.0",)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_VENV = os.path.join(ROOT, ".venv-daft")
READY_MARKER = ".hr-bench-ready"
# Written as soon as ``python -m venv`` made the directory: this suite made it, and may
# remove it (``READY_MARKER`` comes only once everything is installed).
MADE_MARKER = ".hr-bench-made"
RESULT_PREFIX = "HR_DAFT_RESULT "
# Daft strategy -> the shuffle node its physical plan must show.
STRATEGIES = {"map_reduce": "RayShuffle", "flight_shuffle": "FlightShuffle"}

Runner = Callable[..., subprocess.CompletedProcess]


class DaftUnavailable(Exception):
    """The Daft virtualenv could not be made: the cases are skipped with this reason."""


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def _last_line(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def ensure_daft_venv(venv: str = DEFAULT_VENV, base_python: str = sys.executable,
                     spec: str = DAFT_SPEC, run: Runner = subprocess.run,
                     timeout: float = 1200) -> str:
    """The python of a virtualenv with ``spec`` and ``CHILD_REQUIREMENTS`` installed, made
    on first use; a ready venv (its marker names them) is reused as is. Raises
    ``DaftUnavailable`` with the failing step and its last line of output.

    Only a directory this function made (its marker present, whatever it names) or an
    empty one is ever removed: any other directory at ``venv`` is refused, untouched
    (``--daft-venv .venv`` once deleted the project's own virtualenv)."""
    marker = os.path.join(venv, READY_MARKER)
    python = venv_python(venv)
    requirements = [spec, *CHILD_REQUIREMENTS]
    ready = " ".join(requirements)
    if os.path.exists(python) and os.path.exists(marker):
        with open(marker) as f:
            if f.read().strip() == ready:
                return python
    problem = venv_path_problem(venv)
    if problem:
        raise DaftUnavailable(problem)
    shutil.rmtree(venv, ignore_errors=True)  # ours, partial or for another spec: start over
    steps = [
        ("create the venv", [base_python, "-m", "venv", venv]),
        (f"pip install {ready}", [python, "-m", "pip", "install", "--quiet",
                                  "--disable-pip-version-check", *requirements]),
        ("import daft", [python, "-c", "import daft, ray, pyarrow; print(daft.__version__, "
                                       "ray.__version__, pyarrow.__version__)"]),
    ]
    for what, cmd in steps:
        try:
            proc = run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError) as exc:
            _forget_unmarked(venv)
            raise DaftUnavailable(f"cannot {what}: {type(exc).__name__}: {exc}") from exc
        if proc.returncode != 0:
            _forget_unmarked(venv)
            raise DaftUnavailable(f"cannot {what} (exit {proc.returncode}): "
                                  f"{_last_line(proc.stderr) or _last_line(proc.stdout)}")
        if what == "create the venv" and os.path.isdir(venv):
            # Marked as ours at once: a later pip failure leaves a venv the next run may
            # remove and make again (not one it must refuse as someone else's).
            with open(os.path.join(venv, MADE_MARKER), "w") as f:
                f.write(ready + "\n")
    with open(marker, "w") as f:
        f.write(ready + "\n")
    return python


def venv_path_problem(venv: str) -> str | None:
    """Why ``venv`` must not be (re)made by ``ensure_daft_venv``, or None: something is
    there that this suite did not make (no marker) and that is not an empty directory."""
    if not os.path.lexists(venv):
        return None
    if os.path.isdir(venv) and not os.path.islink(venv):
        if _made_here(venv) or not os.listdir(venv):
            return None
    return (f"refusing to replace {venv}: it is not a Daft virtualenv this suite made (no "
            f"{READY_MARKER} or {MADE_MARKER} in it) and not an empty directory; choose "
            f"another --daft-venv path (default {DEFAULT_VENV})")


def _forget_unmarked(venv: str) -> None:
    """Remove what a failed ``python -m venv`` left at ``venv`` before the marker was
    written (this call made it: the path was free or empty), so the next run does not
    refuse it as someone else's."""
    if os.path.isdir(venv) and not _made_here(venv):
        shutil.rmtree(venv, ignore_errors=True)


def _made_here(venv: str) -> bool:
    return any(os.path.exists(os.path.join(venv, m)) for m in (READY_MARKER, MADE_MARKER))


def child_command(python: str, strategy: str, workload: str, size: int, seed: int,
                  partitions: int, rounds: int, cpus: int, object_store_bytes: int,
                  shuffle_dir: str) -> list[str]:
    return [python, os.path.join(ROOT, "benchmarks", "daft_child.py"),
            "--strategy", strategy, "--workload", workload, "--size", str(size),
            "--seed", str(seed), "--partitions", str(partitions), "--rounds", str(rounds),
            "--cpus", str(cpus), "--object-store-bytes", str(object_store_bytes),
            "--shuffle-dir", shuffle_dir]


def child_env() -> dict[str, str]:
    """The child's environment: without this project's PYTHONPATH (the child finds the
    workloads itself; Daft's Ray workers must import the Daft venv's packages only)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    return env


def parse_daft_output(stdout: str) -> dict[str, Any]:
    """The child's result: the JSON of the last ``HR_DAFT_RESULT`` line of its stdout
    (Ray and Daft may print other lines). Raises ValueError if there is none or it is
    malformed."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if not lines:
        raise ValueError("the Daft subprocess printed no result line"
                         + (f" (last output: {_last_line(stdout)})" if stdout.strip() else ""))
    try:
        data = json.loads(lines[-1][len(RESULT_PREFIX):])
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed Daft result line: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("rounds"), list):
        raise ValueError("malformed Daft result: no rounds")
    return data


def rounds_from_result(data: dict[str, Any], expected: tuple[int, int], partitions: int,
                       size: int) -> list[dict[str, Any]]:
    """One dict per round: seconds, verified, error, mb_s, as the suite records them.

    A round verifies only if its output has the input's rows (count and checksum, the
    checksum the suite computed itself from the same workload) in ``partitions``
    partitions, and the child's plan ran the shuffle its strategy names. Not checked: which
    partition each key went to (Daft hashes keys with its own function), or that a key is
    in one partition only. A failure of the child after some rounds adds a failed round
    (it is never dropped)."""
    strategy = data.get("strategy")
    want_node = STRATEGIES.get(strategy)
    node = data.get("physical_shuffle")
    plan_error = None
    if want_node and node is not None and node != want_node:
        plan_error = f"strategy {strategy} ran {node}, not {want_node}"
    if data.get("expected") is not None and tuple(data["expected"]) != tuple(expected):
        plan_error = (f"the Daft subprocess generated different input {data['expected']} "
                      f"(expected {list(expected)})")
    out = []
    for r in data["rounds"]:
        seconds = float(r["seconds"])
        error = plan_error
        if error is None and (int(r["rows"]), int(r["checksum"])) != tuple(expected):
            error = "output rows differ from the input (checksum mismatch)"
        # Daft may hand a large partition back in several pieces (2 GiB into 16 gave 35):
        # fewer than asked is wrong, more is how its output is chunked. The plan check
        # above makes sure the key shuffle ran.
        if error is None and int(r.get("partitions") or 0) < partitions:
            error = f"{r.get('partitions')} output partitions, fewer than {partitions}"
        out.append({"seconds": seconds, "verified": error is None, "error": error,
                    "mb_s": size / 1e6 / seconds if error is None and seconds > 0 else None})
    if data.get("error"):
        out.append({"seconds": None, "verified": False, "error": f"Daft: {data['error']}",
                    "mb_s": None})
    if not out:
        out.append({"seconds": None, "verified": False,
                    "error": "the Daft subprocess ran no round", "mb_s": None})
    return out
