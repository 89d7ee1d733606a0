"""Grid sweeps of training runs: every point is its own torchrun job.

    python -m experiments.sweep experiments/sweeps/zero_stages.yaml [--out DIR] [--dry-run]
                                [--timeout S] [--wandb MODE] [--no-retry-failed]
    python -m experiments.sweep --report runs/sweeps/zero_stages     # rebuild tables and plots

A sweep file names a base config and the overrides of each point (keys are config field
names, as the flags of `python -m experiments.train` with underscores):

    name: zero_stages                       # default: the file's name
    base: experiments/configs/tiny.yaml     # relative to here, to the sweep file or to the repository
    nproc: 2                                # processes per point (a point's dp gives tp·pp·dp)
    timeout: 600                            # seconds per point (default: none)
    wandb: offline                          # mode of every point's run and the report run
    common: {steps: 5}                      # overrides of every point
    grid: {zero: [0, 1, 2, 3], dp: [2, 4]}  # cartesian product ...
    points: [{tp: 2}, {pp: 2, micro_batches: 4}]   # ... and/or a list (both: each point × the grid)

A point may also set `name`, `nproc` and `timeout`. Each point runs as
`python -m experiments.train --nproc-per-node=N --config BASE --flag value ... --out OUT/<point>
--overwrite` (the training command checks the point's configuration, then starts its N workers)
with its output in `OUT/<point>/train.log`, where `<point>` is built from its overrides
("zero-1_dp-4"); `--overwrite` because a point runs again only when it is missing or failed. A point is done when its `summary.json` exists; a failed one (an
invalid flag, a crash, out of memory, a timeout) gets `failed.json` with the return code,
the reason and the end of its log, and the sweep goes on. Running the sweep again runs only
the points that are missing or failed (`--no-retry-failed`: only the missing ones).

Afterwards OUT holds `results.csv`, `results.md` and the plots of `experiments.sweep_plots`;
each point is a wandb run in the group named after the sweep, and a report run in that group
logs the results table and the plots.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from experiments import process_tree
from experiments.sweep_columns import CONFIG_COLUMNS
from experiments.sweep_results import (
    REPO,
    format_value,
    point_row,
    report,
    status_of,
)
from research.config import wandb_mode_from_env
from research.metrics import hms

SWEEP_KEYS = ("name", "description", "base", "nproc", "timeout", "wandb", "common", "grid", "points")
POINT_KEYS = ("name", "nproc", "timeout")  # point keys that are not config fields
RUNNER_KEYS = ("out", "wandb_name")  # config fields the runner sets for each point


class SweepError(ValueError):
    """An invalid sweep file; the message names the key at fault."""


@dataclass
class Point:
    name: str
    overrides: dict[str, Any]  # config field -> value (the sweep's common ones included)
    nproc: int
    timeout: float | None
    command: list[str]
    requested: dict[str, Any]  # CONFIG_COLUMNS as far as known before the run


# ---------------------------------------------------------------------------
# The sweep file
# ---------------------------------------------------------------------------


def expand(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The points of a sweep spec, each a dict of its own overrides (common ones excluded):
    every entry of `points` (default: one empty point) merged with every combination of
    `grid` (cartesian product, in the order the keys are written, last key fastest)."""
    grid = spec.get("grid") or {}
    if not isinstance(grid, dict) or any(not isinstance(v, list) or not v for v in grid.values()):
        raise SweepError("grid must map each key to a non-empty list of values")
    points = spec.get("points") or [{}]
    if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
        raise SweepError("points must be a list of {key: value} mappings")
    combos = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    return [{**point, **combo} for point in points for combo in combos]


def point_name(overrides: dict[str, Any]) -> str:
    """A stable, filesystem-safe name from a point's own overrides, in their order:
    {"zero": 1, "micro_batches": 4} -> "zero-1_micro-batches-4"; no overrides -> "base"."""
    if "name" in overrides:
        name = _safe(str(overrides["name"]))
    else:
        parts = [f"{k.replace('_', '-')}-{_safe(_text(v))}" for k, v in overrides.items() if k != "timeout"]
        name = "_".join(parts) or "base"
    if len(name) > 100:
        name = name[:91] + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


def _text(value: Any) -> str:
    """A value as the command line takes it: True -> "true", None -> "none", 0.003 -> "0.003"."""
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    return f"{value:g}" if isinstance(value, float) else str(value)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-") or "x"


def flags(overrides: dict[str, Any]) -> list[str]:
    """Command-line flags of overrides: {"zero": 1, "sequence_parallel": True} ->
    ["--zero", "1", "--sequence-parallel"]; False -> "--no-flag", None -> "none"."""
    out: list[str] = []
    for key, value in overrides.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, dict)):
            raise SweepError(f"{key}: {value!r} is not a single value (lists belong under grid)")
        else:
            out += [flag, _text(value)]
    return out


def _find(path: str, sweep_file: Path) -> Path:
    """A path as given, or relative to the sweep file's folder, or to the repository."""
    for candidate in (Path(path), sweep_file.parent / path, REPO / path):
        if candidate.exists():
            return candidate.resolve()
    raise SweepError(f"base: {path} does not exist (tried the current folder, {sweep_file.parent} and {REPO})")


def load_sweep(
    path: str | Path, out: str | None = None, timeout: float | None = None, wandb: str | None = None
) -> tuple[dict[str, Any], list[Point]]:
    """The sweep's settings (name, base, out, wandb mode, project, group) and its points,
    validated: unknown keys, duplicate point names and missing sizes are errors here,
    before anything runs. `out`, `timeout` and `wandb` override the file's."""
    path = Path(path)
    spec = _read_spec(path)
    base = _find(str(spec["base"]), path)
    defaults = _base_fields(base, path)
    common = dict(spec.get("common") or {})
    settings = _sweep_settings(path, spec, base, defaults, common, out, wandb)
    default_timeout = timeout if timeout is not None else spec.get("timeout")
    points: list[Point] = []
    for own in expand(spec):
        pname = point_name(own)
        if any(p.name == pname for p in points):
            raise SweepError(f"{path}: two points are both named {pname!r}")
        overrides = _point_overrides(path, own, common, defaults)
        setting = {**defaults, **overrides}
        nproc = _point_nproc(own, overrides, setting, spec.get("nproc"))
        if not nproc:
            raise SweepError(f"{path}: point {pname}: give nproc (in the sweep or the point) or dp")
        limit = own.get("timeout", default_timeout)
        command = train_command(settings, pname, overrides, nproc)
        points.append(
            Point(pname, overrides, int(nproc), float(limit) if limit else None, command, _requested(setting, nproc))
        )
    return settings, points


def _read_spec(path: Path) -> dict[str, Any]:
    """The sweep file's mapping, with only sweep keys and a base."""
    with open(path) as f:
        spec = yaml.safe_load(f) or {}
    unknown = set(spec) - set(SWEEP_KEYS)
    if unknown:
        raise SweepError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; sweep keys are {', '.join(SWEEP_KEYS)}")
    if "base" not in spec:
        raise SweepError(f"{path}: base (the config file every point starts from) is missing")
    return spec


def _base_fields(base: Path, path: Path) -> dict[str, Any]:
    """Every config field of the training command: the base file's value, else its default."""
    from research.config import ConfigError, build_parser, load_yaml

    try:
        return vars(build_parser(load_yaml(str(base))).parse_args([]))
    except ConfigError as e:
        raise SweepError(f"{path}: base: {e}") from None


def _sweep_settings(
    path: Path,
    spec: dict[str, Any],
    base: Path,
    defaults: dict[str, Any],
    common: dict[str, Any],
    out: str | None,
    wandb: str | None,
) -> dict[str, Any]:
    """The sweep's name, base, out folder, wandb mode, project and group. The runner sets a
    point's wandb mode and group, so `common` gives them up here: `wandb_group` always,
    `wandb` when the command line gives no mode."""
    name = str(spec.get("name") or path.stem)
    mode = wandb or common.pop("wandb", None) or spec.get("wandb") or wandb_mode_from_env()
    if mode not in ("offline", "online", "disabled"):
        raise SweepError(f"{path}: wandb: {mode!r} is not one of offline, online, disabled")
    return {
        "name": name,
        "description": spec.get("description"),
        "base": str(base),
        "out": str(Path(out or Path("runs", "sweeps", name)).resolve()),
        "wandb": mode,
        "project": common.get("wandb_project", defaults["wandb_project"]),
        "group": common.pop("wandb_group", None) or name,
    }


def _point_overrides(
    path: Path, own: dict[str, Any], common: dict[str, Any], defaults: dict[str, Any]
) -> dict[str, Any]:
    """A point's config overrides: the common ones, then its own config fields; each must be
    a config field that the runner does not set."""
    overrides = {**common, **{k: v for k, v in own.items() if k not in POINT_KEYS}}
    for key in overrides:
        if key not in defaults or key == "config":
            raise SweepError(f"{path}: {key!r} is not a config field (see python -m experiments.train --help)")
        if key in RUNNER_KEYS:
            raise SweepError(f"{path}: {key} is set by the sweep for each point; leave it out")
    return overrides


def _point_nproc(
    own: dict[str, Any], overrides: dict[str, Any], setting: dict[str, Any], sweep_nproc: int | None
) -> int | None:
    """A point's process count: its own `nproc`, else tp·cp·pp·dp when it sets dp, else the
    sweep's `nproc` (None when there is none)."""
    if own.get("nproc") or not overrides.get("dp"):
        return own.get("nproc") or sweep_nproc
    return setting["tp"] * setting["cp"] * setting["pp"] * setting["dp"]


def _requested(setting: dict[str, Any], nproc: int) -> dict[str, Any]:
    """The CONFIG_COLUMNS a point asks for, and its process count; dp = nproc / (tp·cp·pp)
    when the config leaves dp to the world size."""
    requested = {**{k: setting.get(k) for k in CONFIG_COLUMNS}, "nproc": int(nproc)}
    model_parallel = setting["tp"] * setting["cp"] * setting["pp"]
    if requested["dp"] is None and nproc % model_parallel == 0:
        requested["dp"] = nproc // model_parallel
    return requested


def train_command(settings: dict[str, Any], name: str, overrides: dict[str, Any], nproc: int) -> list[str]:
    """`python -m experiments.train --nproc-per-node=N --config BASE <overrides>` with the point's
    output folder (replaced: a point runs again only when missing or failed) and wandb run
    (mode, group, name)."""
    return [
        sys.executable,
        "-m",
        "experiments.train",
        f"--nproc-per-node={nproc}",
        "--config",
        settings["base"],
        *flags(overrides),
        "--out",
        str(Path(settings["out"], name)),
        "--overwrite",
        "--wandb",
        settings["wandb"],
        "--wandb-group",
        settings["group"],
        "--wandb-name",
        name,
    ]


# ---------------------------------------------------------------------------
# Running points
# ---------------------------------------------------------------------------


PROGRESS_EVERY_S = 10.0  # how often a running point's progress is read


def point_progress(folder: Path) -> tuple[int, int] | None:
    """(the last step a running point logged, its --steps), from its metrics.jsonl and
    config.yaml; None before its first step."""
    metrics, config = folder / "metrics.jsonl", folder / "config.yaml"
    if not (metrics.is_file() and config.is_file()):
        return None
    rows = [line for line in metrics.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    return json.loads(rows[-1])["step"], yaml.safe_load(config.read_text())["train"]["steps"]


def _wait(proc: subprocess.Popen, timeout: float | None, tick: Callable[[], None]) -> bool:
    """Wait for `proc`, calling `tick()` every PROGRESS_EVERY_S; True when it ran past `timeout`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        wait = PROGRESS_EVERY_S if deadline is None else min(PROGRESS_EVERY_S, deadline - time.monotonic())
        if wait <= 0:
            return True
        try:
            proc.wait(timeout=wait)
            return False
        except subprocess.TimeoutExpired:
            tick()


def run_point(point: Point, folder: Path, tick: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Launch one point and wait (at most its timeout), calling `tick()` every
    PROGRESS_EVERY_S while it runs; returns the failure record, or {} when the run wrote its
    summary. A Ctrl-C stops the job and propagates."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "failed.json").unlink(missing_ok=True)
    meta_file = folder / "point.json"
    attempts = json.loads(meta_file.read_text()).get("attempts", 0) if meta_file.exists() else 0
    meta = {
        "name": point.name,
        "overrides": point.overrides,
        "nproc": point.nproc,
        "attempts": attempts + 1,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": point.command,
    }
    meta_file.write_text(json.dumps(meta, indent=2) + "\n")
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    started, timed_out = time.monotonic(), False
    with open(folder / "train.log", "w") as log:
        log.write("$ " + shlex.join(point.command) + "\n")
        log.flush()
        proc = subprocess.Popen(
            point.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )  # Ctrl-C reaches us only; we stop the job
        try:
            timed_out = _wait(proc, point.timeout, tick)
        except BaseException:
            process_tree.stop(proc)
            raise
        if timed_out:
            process_tree.stop(proc)
    elapsed = time.monotonic() - started
    if status_of(folder) == "ok":
        return {}
    text = (folder / "train.log").read_text(errors="replace")
    failure = {
        "name": point.name,
        "returncode": proc.returncode,
        **failure_reason(proc.returncode, text, timed_out, point.timeout),
        "elapsed_s": round(elapsed, 1),
        "log_tail": text.splitlines()[-30:],
        "command": point.command,
    }
    (folder / "failed.json").write_text(json.dumps(failure, indent=2) + "\n")
    return failure


def failure_reason(returncode: int, log: str, timed_out: bool, timeout: float | None) -> dict[str, Any]:
    """{"exit_code", "kind" (timeout / oom / signal / error), "reason"} of a failed job from
    its return code and log. torchrun exits 1 whatever its worker did; the worker's own
    code is in torchrun's "Root Cause" report. The message is the worker's last
    `error: ...` line (invalid config) or exception line."""
    code = returncode
    root = re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", log, re.DOTALL)
    if root:
        code = int(root.group(1))
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in log.splitlines()]
    errors = [line for line in lines if line.startswith("error:")]
    exceptions = [
        line
        for line in lines
        if re.match(r"^[\w.]*(Error|Exception)\b.*:", line)
        and "ChildFailedError" not in line
        and "SignalException" not in line
    ]
    message = (errors or exceptions or [""])[-1]
    if timed_out:
        kind, head = "timeout", f"timeout: stopped after {timeout:g} s"
    elif code is not None and code < 0:
        sig = -code
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "?"
        kind = "oom" if sig == signal.SIGKILL else "signal"
        head = f"killed by signal {sig} ({name}{', out of memory?' if kind == 'oom' else ''})"
    else:
        kind, head = "error", f"exit {code}"
    if "out of memory" in message.lower():
        kind = "oom"
    return {"exit_code": code, "kind": kind, "reason": f"{head}: {message}" if message and not timed_out else head}


def check_point(point: Point) -> str | None:
    """The error the training command would stop this point with at start-up (invalid flags
    for its process count), or None; what `--dry-run` shows. Nothing is launched."""
    from experiments.launcher import checked
    from research.config import ConfigError

    try:
        checked(point.command[point.command.index("experiments.train") + 1 :])
    except ConfigError as e:
        return f"error: {e}"
    except SystemExit:
        return "error: the training command rejects these flags"
    return None


def run_sweep(
    settings: dict[str, Any],
    points: list[Point],
    retry_failed: bool = True,
    dry_run: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the points not yet done (and the failed ones, with `retry_failed`), one after
    another, then write the tables and plots and the wandb report run.
    Returns {"launched": [names], "failed": [names], "rows": results rows}."""
    out = Path(settings["out"])
    todo = points_to_run(points, out, retry_failed)
    done = sum(status_of(out / p.name) == "ok" for p in points)
    log(f"sweep {settings['name']}: {len(points)} points, {done} done, {len(todo)} to run -> {out}")
    if dry_run:
        _show_commands(points, todo, out, log)
        return {"launched": [], "failed": [], "rows": []}
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({**settings, "points": [asdict(p) for p in points]}, indent=2) + "\n")
    for p in points:
        if p not in todo:
            _warn_if_changed(p, out / p.name, log)
    launched, took = [], []
    for i, p in enumerate(todo, 1):
        t0 = time.monotonic()
        after = (len(todo) - i) * statistics.fmean(took) if took else None  # the points after this one
        _run_and_log(p, out / p.name, f"[{i}/{len(todo)}]", log, after)
        took.append(time.monotonic() - t0)
        launched.append(p.name)
    rows = report(out, settings["wandb"], log=log)
    failed = [r["name"] for r in rows if r["status"] != "ok"]
    return {"launched": launched, "failed": failed, "rows": rows}


def points_to_run(points: list[Point], out: Path, retry_failed: bool) -> list[Point]:
    """The points with neither summary.json nor failed.json under `out`, and the failed ones
    with `retry_failed`."""
    return [
        p
        for p in points
        if status_of(out / p.name) == "missing" or (retry_failed and status_of(out / p.name) == "failed")
    ]


def _show_commands(points: list[Point], todo: list[Point], out: Path, log: Callable[[str], None]) -> None:
    """`--dry-run`: every point's state ("run" or its status) and command, and the error it
    would stop with at start-up."""
    for p in points:
        state = "run" if p in todo else status_of(out / p.name)
        problem = check_point(p)
        log(f"[{state}] {shlex.join(p.command)}" + (f"\n    (will fail: {problem})" if problem else ""))


def _run_and_log(point: Point, folder: Path, tag: str, log: Callable[[str], None], after: float | None) -> None:
    """Run one point and log its start, its progress (step, its ETA and, with `after` the
    expected seconds of the points after it, the sweep's) and its end: the failure's reason,
    or its summary."""
    log(f"{tag} {point.name} ({point.nproc} processes) ...")
    t0 = time.monotonic()

    def progress() -> None:
        at = point_progress(folder)
        if at is None:
            return
        step, steps = at
        left = (time.monotonic() - t0) / step * (steps - step)
        whole = f", sweep ETA {hms(left + after)}" if after is not None else ""
        log(f"{tag} {point.name}: step {step}/{steps}, ETA {hms(left)}{whole}")

    failure = run_point(point, folder, progress)
    took = f"{time.monotonic() - t0:.0f} s"
    if failure:
        log(f"{tag} {point.name} FAILED after {took}: {failure['reason']}")
    else:
        log(f"{tag} {point.name} ok in {took} | " + _summary_brief(folder, point.name))


def _summary_brief(folder: Path, name: str) -> str:
    """ "1.234e+04 tok/s | 3.4 MiB per rank | 5.678 final loss" from a finished point's summary.json."""
    row = point_row(json.loads((folder / "summary.json").read_text()), name, "ok")
    return " | ".join(
        f"{format_value(c, row[c])} {unit}"
        for c, unit in (
            ("tokens_per_s", "tok/s"),
            ("mem_per_rank_bytes", "per rank"),
            ("final_loss_mean", "mean final loss"),
        )
    )


def _warn_if_changed(point: Point, folder: Path, log: Callable[[str], None]) -> None:
    meta = folder / "point.json"
    if status_of(folder) == "ok" and meta.exists():
        old = json.loads(meta.read_text())
        if old.get("overrides") != point.overrides or old.get("nproc") != point.nproc:
            log(
                f"note: {point.name} finished with other settings ({old.get('overrides')}, nproc "
                f"{old.get('nproc')}); it is kept. Delete {folder} to run it again."
            )


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0 every point ok, 1 some not ok, 2 an invalid sweep or folder, 130 interrupted."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.report:
        if not Path(args.report, "sweep.json").exists():
            print(f"error: --report {args.report}: no sweep.json there (not a sweep's output folder)", file=sys.stderr)
            return 2
        rows = report(args.report, args.wandb or "disabled")
        return 0 if all(r["status"] == "ok" for r in rows) else 1
    if not args.sweep:
        parser.error("give a sweep file (or --report DIR)")
    try:
        settings, points = load_sweep(args.sweep, args.out, args.timeout, args.wandb)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run_sweep(settings, points, args.retry_failed, args.dry_run)
    except KeyboardInterrupt:
        print("interrupted; the point that was running is stopped and will run again next time", file=sys.stderr)
        return 130
    if result["failed"] and not args.dry_run:
        print(f"{len(result['failed'])} point(s) not ok: {', '.join(result['failed'])}", file=sys.stderr)
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    """The command line of `python -m experiments.sweep` (usage: the module's docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("sweep", nargs="?", help="sweep YAML file")
    parser.add_argument("--out", help="output folder (default: runs/sweeps/<name>)")
    parser.add_argument("--dry-run", action="store_true", help="print each point's command and state; run nothing")
    parser.add_argument(
        "--timeout",
        type=float,
        help="seconds per point before it is stopped and recorded as failed "
        "(default: the sweep file's timeout; a point's own timeout wins)",
    )
    parser.add_argument(
        "--wandb",
        choices=("offline", "online", "disabled"),
        help="wandb mode of the points and the report run (default: the sweep's, $WANDB_MODE, offline)",
    )
    parser.add_argument(
        "--retry-failed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run failed points again (finished points are never run again)",
    )
    parser.add_argument(
        "--report",
        metavar="DIR",
        help="only rebuild results.csv/.md and the plots of a sweep "
        "folder (and, with --wandb offline/online, log a report run)",
    )
    return parser


if __name__ == "__main__":
    sys.exit(main())
