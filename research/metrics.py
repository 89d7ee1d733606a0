"""What a training run reports: throughput, FLOPs, MFU, memory, communication; written to
the console, to ``OUT/metrics.jsonl`` and to wandb.

Throughput, with T the tokens of one global batch, t the step time, F the model FLOPs per
token (from the caller, e.g. 6·N plus attention), W the world size and P the device's dense
peak FLOP/s:

    tokens_per_s      = T / t
    tflops_per_device = F · tokens_per_s / W / 1e12
    mfu               = tflops_per_device · 1e12 / P      (None when P is unknown)

Memory is CUDA's ``max_memory_allocated`` on GPUs and the process's peak RSS on CPU.
``ActivationMeter`` measures the bytes autograd keeps saved for backward.
Collectives used here (maxima and gathers over ranks) go through ``parallel.comm`` under
``accounting.untracked()``: the desync report sees them, the communication counts do not.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TextIO

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel import accounting, comm
from research.costmodel.datasheet import gpu_peak_flops

__all__ = [
    "ActivationMeter",
    "Console",
    "MetricsFile",
    "WandbRun",
    "all_ranks",
    "comm_per_step",
    "over_ranks",
    "peak_flops",
    "peak_memory_bytes",
    "reset_peak_memory",
    "summarize",
    "throughput",
    "write_json",
]

GiB = 2**30


# ---------------------------------------------------------------------------
# Peak FLOP/s and throughput
# ---------------------------------------------------------------------------


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of one ``device`` for matmuls in ``dtype``, or None if unknown.

    ``ZERO3D_PEAK_TFLOPS`` (TFLOP/s per device) overrides everything, on any device (CPU
    included). Otherwise the CUDA device name is looked up in the GPU table
    (`research.costmodel.datasheet`); fp32 counts as TF32 when cuBLAS may use it
    (``torch.backends.cuda.matmul.fp32_precision == "tf32"``, i.e. ``allow_tf32``),
    else as the non-tensor FP32 peak. None for CPU, unlisted GPUs and other dtypes.
    """
    override = os.environ.get("ZERO3D_PEAK_TFLOPS")
    if override:
        try:
            return float(override) * 1e12
        except ValueError:
            raise ValueError(f"ZERO3D_PEAK_TFLOPS={override!r} is not a number of TFLOP/s") from None
    if device.type != "cuda":
        return None
    tf32 = torch.backends.cuda.matmul.fp32_precision == "tf32"
    return gpu_peak_flops(torch.cuda.get_device_name(device), dtype, tf32)


def throughput(
    tokens: int, step_time_s: float, flops_per_token: float, world_size: int, peak: float | None
) -> dict[str, float | None]:
    """``{"tokens_per_s": T/t, "tflops_per_device": F·(T/t)/W/1e12, "mfu": that·1e12/P}``
    for T tokens of one global batch in t seconds on W devices of peak P FLOP/s
    (mfu None when P is None)."""
    tokens_per_s = tokens / step_time_s
    tflops = flops_per_token * tokens_per_s / world_size / 1e12
    return {
        "tokens_per_s": tokens_per_s,
        "tflops_per_device": tflops,
        "mfu": None if peak is None else tflops * 1e12 / peak,
    }


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's peak allocated bytes; on CPU (Linux) the process's peak
    RSS, by writing 5 to /proc/self/clear_refs (a no-op where that is not possible)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes since the last ``reset_peak_memory``: ``torch.cuda.max_memory_allocated``
    on CUDA; on CPU the whole process's peak resident set size (RSS, from
    ``getrusage().ru_maxrss``), which includes the Python interpreter and libraries."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB on Linux


def over_ranks(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's ``values`` (as float64: exact for byte counts below 2**53), in rank order:
    one all-gather on ``device`` (the CUDA device under nccl, CPU under gloo), not counted as
    training communication; ``[values]`` when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = torch.empty(dist.get_world_size() * len(values), dtype=torch.float64, device=device)
    with accounting.untracked():
        comm.all_gather_into_tensor(out, mine)
    return out.view(-1, len(values)).tolist()


def all_ranks(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    with accounting.untracked():
        return comm.all_gather_object(obj)


class _Saved:
    """A tensor saved for backward while an ``ActivationMeter`` was active. Autograd holds
    it until the backward that uses it has run (or the graph is freed); then ``__del__``
    queues its storage for release. Only queueing (an atomic ``deque.append``) happens in
    ``__del__``, which may run on an autograd thread or inside the meter's own code."""

    __slots__ = ("key", "released", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, released: deque[int]) -> None:
        self.tensor, self.key, self.released = tensor, key, released

    def __del__(self) -> None:
        self.released.append(self.key)


class ActivationMeter:
    """Peak bytes of the activations autograd saves for backward while the block is active.

    A ``saved_tensors_hooks`` pack hook sees every tensor saved for backward. Each storage
    is counted once, in full (``untyped_storage().nbytes()``; views of one storage share
    it), from its first save until the last saved reference to it is released by backward
    or by freeing the graph. Storages of the parameters of ``modules`` are left out,
    compared at pack time with each parameter's current storage (ZeRO-3 re-points
    parameters at gathered buffers). ``current_bytes`` falls back as backward runs;
    ``peak_bytes`` is its maximum since entering (or ``reset``), exact because it can only
    rise at a save.

    Costs O(#parameters) Python work per saved tensor: meter a step, not every step.
    Under activation checkpointing it sees what the checkpoint keeps (a region's inputs),
    not the activations recomputed in backward; tensors saved under any inner
    ``saved_tensors_hooks`` are not seen.
    """

    def __init__(self, modules: Iterable[nn.Module] = ()) -> None:
        self._params = [p for m in modules for p in m.parameters()]
        self._live: dict[int, list[int]] = {}  # storage data_ptr -> [live saves, nbytes]
        self._released: deque[int] = deque()  # data_ptrs of saves freed, not yet counted
        self._lock = threading.Lock()
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._current = 0
        self.peak_bytes = 0

    @property
    def current_bytes(self) -> int:
        """Bytes of the saved storages alive now."""
        with self._lock:
            self._drain()
            return self._current

    def reset(self) -> None:
        """Start a new peak at the bytes saved now."""
        self.peak_bytes = self.current_bytes

    def __enter__(self) -> ActivationMeter:
        self.reset()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None

    def _drain(self) -> None:
        """Count the queued releases (caller holds the lock)."""
        while self._released:
            key = self._released.popleft()
            entry = self._live[key]
            entry[0] -= 1
            if entry[0] == 0:
                self._current -= entry[1]
                del self._live[key]

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Saved:
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key == 0 or nbytes == 0 or key in {p.untyped_storage().data_ptr() for p in self._params}:
            return tensor
        with self._lock:
            self._drain()
            entry = self._live.setdefault(key, [0, nbytes])
            if entry[0] == 0:
                self._current += nbytes
                self.peak_bytes = max(self.peak_bytes, self._current)
            entry[0] += 1
        # detached: a saved output would otherwise hold its own grad_fn, and through the
        # graph's saved variable this object, a cycle that outlives the graph
        return _Saved(tensor.detach(), key, self._released)

    @staticmethod
    def _unpack(packed: torch.Tensor | _Saved) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed


# ---------------------------------------------------------------------------
# Communication and summaries
# ---------------------------------------------------------------------------

_COUNTS = ("calls", "bytes", "payload_bytes")


def comm_per_step(
    log_dict: Mapping[str, Mapping[str, Mapping[str, int]]], steps: int, groups: Iterable[str] = ()
) -> dict[str, dict[str, Any]]:
    """Per-step averages of ``parallel.accounting.CommLog.as_dict()`` recorded over ``steps`` steps:
    ``{group: {"ops": {op: {"calls", "bytes", "payload_bytes"}}, "total": {...}}}``, each
    count divided by ``steps``; "total" sums the group's ops. Names in ``groups`` appear even
    when they made no call (all zeros)."""
    if steps <= 0:
        raise ValueError(f"steps={steps} must be positive")
    out: dict[str, dict[str, Any]] = {}
    for group in [*log_dict, *(g for g in groups if g not in log_dict)]:
        ops = {op: {k: e[k] / steps for k in _COUNTS} for op, e in log_dict.get(group, {}).items()}
        total = {k: sum(e[k] for e in ops.values()) for k in _COUNTS}
        out[group] = {"ops": ops, "total": total}
    return out


def _median(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


LAST_STEPS = 10  # the final loss is also given as the mean over this many last steps, one step being noisy


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One run from its per-step records (the metrics.jsonl objects): ``steps``,
    ``final_loss`` (the last record's) and ``final_loss_mean`` (the mean of the last
    LAST_STEPS finite losses, over ``final_loss_mean_steps`` of them), medians of
    ``step_time_s``, ``tokens_per_s``, ``tflops_per_device`` and ``mfu`` (robust to warm-up
    steps; None where absent), ``tokens_per_s_spread`` (half the interquartile range of the
    steps' tokens/s over its median: how far a comparison of throughputs can trust the median;
    None under 4 steps), and the largest ``mem_peak_bytes``."""
    mems = [r["mem_peak_bytes"] for r in records if r.get("mem_peak_bytes") is not None]
    rates = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    quartiles = statistics.quantiles(rates, n=4) if len(rates) >= 4 else None
    last = [r["loss"] for r in records[-LAST_STEPS:] if r.get("loss") is not None and math.isfinite(r["loss"])]
    return {
        "steps": len(records),
        "final_loss": records[-1].get("loss") if records else None,
        "final_loss_mean": statistics.fmean(last) if last else None,
        "final_loss_mean_steps": len(last),
        "median_step_time_s": _median(records, "step_time_s"),
        "median_tokens_per_s": _median(records, "tokens_per_s"),
        "tokens_per_s_spread": (quartiles[2] - quartiles[0]) / (2 * quartiles[1]) if quartiles else None,
        "median_tflops_per_device": _median(records, "tflops_per_device"),
        "median_mfu": _median(records, "mfu"),
        "mem_peak_bytes": max(mems) if mems else None,
    }


# ---------------------------------------------------------------------------
# Console
# ---------------------------------------------------------------------------


def _sci(x: float) -> str:
    """12345.6 -> "1.2e4"."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def hms(seconds: float) -> str:
    """Seconds as H:MM:SS."""
    return str(timedelta(seconds=round(seconds)))


def _loss(v: float) -> str:
    return f"{v:.3f}"


def _tok(v: float) -> str:
    return f"{_sci(v)} tok/s"


def _tflops(v: float) -> str:
    return f"{v:#.3g} TFLOP/s/dev"


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


def _gib(v: float) -> str:
    return f"{v / GiB:.1f} GiB"


# (key, label, format) of the progress line and of the summary line
_STEP_FIELDS = (
    ("loss", "loss ", _loss),
    ("moe_aux_loss", "aux ", _loss),
    ("moe_dropped_fraction", "dropped ", _pct),
    ("tokens_per_s", "", _tok),
    ("tflops_per_device", "", _tflops),
    ("mfu", "MFU ", _pct),
    ("mem_peak_bytes", "mem ", _gib),
)
_SUMMARY_FIELDS = (
    ("final_loss", "final loss ", _loss),
    ("final_loss_mean", f"mean of the last {LAST_STEPS} ", _loss),
    ("median_tokens_per_s", "median ", _tok),
    ("median_tflops_per_device", "median ", _tflops),
    ("median_mfu", "median MFU ", _pct),
    ("mem_peak_bytes", "peak mem ", _gib),
    ("wall_time_s", "wall ", hms),
)


def _format(values: Mapping[str, Any], fields: tuple) -> list[str]:
    """ "label value" for each field whose key is in ``values`` and not None."""
    return [label + fmt(values[key]) for key, label, fmt in fields if values.get(key) is not None]


def say(message: str) -> None:
    """One line for the researcher on stdout, from rank 0 only (a start-up phase, a save, a
    resume)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


class Console:
    """Progress on one rank (pass ``enabled=rank == 0``).

    With ``stream`` (stderr) a terminal, a tqdm bar (steps, ETA) with the metrics as its
    postfix (a pseudo-terminal nobody sized, 0 × 0 as under `script` or an IDE's runner, gets
    a fixed width: tqdm would print nothing there); otherwise one plain line every
    ``log_every`` steps and at the last step:
    ``step 12/50 | loss 3.214 | 1.2e4 tok/s | 0.8 TFLOP/s/dev | MFU 41.2% | mem 1.3 GiB | ETA 0:01:10``.
    Reads loss, tokens_per_s, tflops_per_device, mfu, mem_peak_bytes; a missing or None
    one is left out. ETA = wall time since construction / steps done × steps left.
    """

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        log_every: int = 1,
        stream: TextIO | None = None,
    ) -> None:
        self.total_steps, self.start_step, self.enabled = total_steps, start_step, enabled
        self.log_every = max(1, log_every)
        self.stream = sys.stderr if stream is None else stream
        self._t0 = time.perf_counter()
        self._bar = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            try:
                size = os.get_terminal_size(self.stream.fileno())
                sized = size.columns > 0 and size.lines > 0
            except (OSError, ValueError):  # a stream that says it is a terminal but has no descriptor
                sized = False
            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                file=self.stream,
                unit="step",
                dynamic_ncols=sized,
                **({} if sized else {"ncols": 120, "nrows": 24}),
            )

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Report that step ``step`` (counting from 1) finished with ``metrics``."""
        if not self.enabled:
            return
        fields = _format(metrics, _STEP_FIELDS)
        if self._bar is not None:
            self._bar.set_postfix_str(" | ".join(fields), refresh=False)
            self._bar.update(step - self._bar.n)
        elif step % self.log_every == 0 or step >= self.total_steps:
            done = step - self.start_step
            eta = (time.perf_counter() - self._t0) / done * (self.total_steps - step) if done > 0 else 0.0
            line = [f"step {step}/{self.total_steps}", *fields, f"ETA {hms(eta)}"]
            print(" | ".join(line), file=self.stream, flush=True)

    def warn(self, message: str) -> None:
        """One line "warning: ..." outside the progress display."""
        self.say(f"warning: {message}")

    def say(self, message: str) -> None:
        """One line outside the progress display (under the bar when there is one)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self, summary: Mapping[str, Any]) -> None:
        """Close the bar; print one line from a ``summarize`` dict plus ``wall_time_s``:
        ``done 50 steps | final loss 3.1 | median 1.2e4 tok/s | median 0.8 TFLOP/s/dev |
        median MFU 41.2% | peak mem 1.3 GiB | wall 0:01:10`` (missing values left out)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        line = [
            f"done {summary.get('steps', self.total_steps - self.start_step)} steps",
            *_format(summary, _SUMMARY_FIELDS),
        ]
        print(" | ".join(line), file=self.stream, flush=True)


# ---------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------


def _jsonable(obj: Any) -> Any:
    """``obj`` as strict JSON values: non-finite floats -> None (null), tensors and numpy
    values -> their ``tolist()``, tuples -> lists, other objects (dtypes, paths) -> ``str``."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "tolist"):  # tensors, numpy arrays and scalars
        return _jsonable(obj.tolist())
    return str(obj)


def write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` to ``path`` as indented strict JSON (NaN / inf as null, see MetricsFile)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_jsonable(obj), indent=2, allow_nan=False) + "\n")


class MetricsFile:
    """``path`` as JSON Lines: ``write(record)`` appends one object and flushes.

    Appends, so a resumed run continues the file (steps after the resume point may repeat).
    Strict JSON: NaN and ±inf (a diverged loss, the inf grad norm of a skipped fp16 step)
    are written as null, which pandas reads back as NaN. Open it on one rank.
    """

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a")  # noqa: SIM115 - held open until close() / __exit__

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one line and flush it."""
        self._file.write(json.dumps(_jsonable(record), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------
# wandb
# ---------------------------------------------------------------------------


def _global_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def run_id_for(out_dir: str | Path, resuming: bool) -> str:
    """The wandb run id of the job writing to ``out_dir``: the one saved in ``out_dir/wandb_id``
    when the job resumes, a new one (saved there) when it starts. Called on rank 0."""
    path = Path(out_dir) / "wandb_id"
    if resuming and path.is_file():
        return path.read_text().strip()
    run_id = os.urandom(6).hex()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id)
    return run_id


def log_event(out_dir: str | Path, event: str, **fields: Any) -> None:
    """Append one event (a resume, with its cause) to ``out_dir/events.jsonl``. Called on rank 0."""
    with open(Path(out_dir) / "events.jsonl", "a") as f:
        f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


class WandbRun:
    """One wandb run per training job, logged from global rank 0 (a no-op elsewhere and
    with ``mode="disabled"``). ``offline`` writes under ``out_dir/wandb`` (``wandb sync`` it
    later); runs of a sweep share ``group``; a ``run_id`` (``run_id_for``) continues the run of
    that id, so a resumed job stays one wandb run. wandb is imported only for an enabled run and
    its console output is silenced (``WANDB_*`` environment variables still apply).
    """

    def __init__(
        self,
        mode: Literal["offline", "online", "disabled"] = "offline",
        project: str = "zero3d",
        group: str | None = None,
        name: str | None = None,
        out_dir: str | Path = ".",
        config: Mapping[str, Any] | None = None,
        run_id: str | None = None,
    ) -> None:
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb mode {mode!r} is not one of offline, online, disabled")
        self._run = None
        if mode == "disabled" or _global_rank() != 0:
            return
        import wandb

        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            mode=mode,
            project=project,
            group=group,
            name=name,
            dir=str(out_dir),
            config=_jsonable(dict(config or {})),
            settings=wandb.Settings(silent=True),
            id=run_id,
            resume="allow" if run_id is not None else None,
        )

    @property
    def enabled(self) -> bool:
        return self._run is not None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log ``metrics`` (None values left out) at training step ``step``; a list (one value
        per rank) as one chart per element, ``key/i``."""
        if self._run is not None:
            flat: dict[str, Any] = {}
            for k, v in metrics.items():
                if isinstance(v, list):
                    flat.update({f"{k}/{i}": x for i, x in enumerate(v)})
                elif v is not None:
                    flat[k] = v
            self._run.log(flat, step=step)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Set run summary values (final loss, medians, memory, comm)."""
        if self._run is not None:
            self._run.summary.update(_jsonable(dict(values)))

    def finish(self, exit_code: int = 0) -> None:
        """Close the run (a non-zero ``exit_code`` marks it failed) and, when no other wandb run
        is open in this process, wait for wandb's service to write everything to disk
        (``run.finish`` alone may return before the offline ``.wandb`` file is flushed); idempotent.
        """
        if self._run is not None:
            import wandb

            self._run.finish(exit_code=exit_code)
            self._run = None
            if wandb.run is None:
                wandb.teardown()

    def __enter__(self) -> WandbRun:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.finish(exit_code=0 if exc_type is None else 1)
