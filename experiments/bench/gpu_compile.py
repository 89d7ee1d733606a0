"""Every Triton kernel of the repository compiled ahead of time for five GPUs, without a GPU.

    python -m experiments.bench.gpu_compile                              # the whole table
    python -m experiments.bench.gpu_compile --json compile.json          # also one JSON row each
    python -m experiments.bench.gpu_compile --kernels adam_kernel --targets sm_90 gfx942

The specializations are those the launches build, listed next to them
(`optim.fused.triton_variants`, `optim.quantize.triton_variants` at ZeRO++'s block of 2048),
each twice: with the element count n a multiple of 16 (ZeroOptimizer's shards,
`optim.buffers.ALIGN`) and without, since Triton specializes integer arguments on
divisibility by 16 (pointers are taken 16-byte aligned, as torch allocates them).
`triton.compile` builds each for sm_80 (A100), sm_90 (H100, H200), sm_100 (B200), gfx90a
(MI250X) and gfx942 (MI300X) with the ptxas / LLVM it bundles. Per kernel, signature and target:

registers          per thread: ptxas's "Used N registers" (CUDA), .vgpr_count (AMD).
spills             32-bit registers spilled: ptxas's spill-store bytes / 4 (CUDA),
                   .vgpr_spill_count + .sgpr_spill_count (AMD).
shared_bytes       shared memory (LDS) per program, as Triton requests it at launch.
vector_width_bits  the narrowest global load or store of block-wide data, in bits (PTX
                   ld/st.global.vN.bM: N·M; AMDGCN global/buffer_load/store_dwordxN: 32·N).
                   A load or store through a scalar pointer (once per program, as the
                   quantizer's block scale) is left out: the TTIR's tt.load / tt.store of a
                   !tt.ptr, matched to the machine code by its source line (.loc).
ok                 compiled; an error is shown with its first line and the table goes on (each
                   compile runs in a forked process, so even an LLVM abort is one row's error).

Exit status 1 if a row is not ok. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import multiprocessing as mp
import os
import re
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from experiments.bench.results import write_json
from experiments.bench.tables import Cell, format_table, table
from optim import fused, quantize
from optim.fused import KernelVariant
from optim.grads import QGZ_BLOCK
from research.cli import arg, config_from, config_parser

TARGETS = {  # name -> triton GPUTarget(backend, arch, warp size)
    "sm_80": ("cuda", 80, 32),
    "sm_90": ("cuda", 90, 32),
    "sm_100": ("cuda", 100, 32),
    "gfx90a": ("hip", "gfx90a", 64),
    "gfx942": ("hip", "gfx942", 64),
}
ALIGNED = {True: "n%16=0", False: "n%16>0"}
COLUMNS = ("registers", "spills", "shared_bytes", "vector_width_bits", "ok")


@functools.cache
def variants() -> tuple[KernelVariant, ...]:
    """Every launchable specialization of the repository's Triton kernels (none without triton)."""
    return (*fused.triton_variants(), *quantize.triton_variants(QGZ_BLOCK))


def kernel_name(variant: KernelVariant) -> str:
    return variant.kernel.__name__.lstrip("_")


@dataclass
class Row:
    """One kernel specialization compiled for one target (None: not measured)."""

    kernel: str
    signature: str
    target: str
    registers: int | None = None
    spills: int | None = None
    shared_bytes: int | None = None
    vector_width_bits: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_json(self) -> dict[str, Any]:
        """The row's fields, `ok` in place of the error."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "error"}
        return {**fields, "ok": self.ok}


# ---- compiling -----------------------------------------------------------------------------
def _compile(variant: KernelVariant, aligned: bool, target: str) -> tuple[Any, str]:
    """(the CompiledKernel, ptxas's log) as a launch would build it: pointers, and with `aligned`
    integers, specialized as divisible by 16. A fresh cache, so that ptxas runs and logs."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    divisible = [i for i, t in enumerate(variant.signature.values()) if t[0] == "*" or (aligned and t[0] in "iu")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    source = ASTSource(variant.kernel, variant.signature, variant.constexprs, attrs)
    with (
        tempfile.TemporaryDirectory() as cache,
        knobs.cache.scope(),
        knobs.nvidia.scope(),
        contextlib.redirect_stdout(io.StringIO()) as log,  # ptxas's log, or the PTX of a failure
    ):
        knobs.cache.dir = cache
        knobs.nvidia.dump_ptxas_log = True
        kernel = triton.compile(source, target=GPUTarget(*TARGETS[target]), options=dict(variant.options))
    return kernel, log.getvalue()


def _number(pattern: str, text: str) -> int | None:
    m = re.search(pattern, text, re.MULTILINE)
    return None if m is None else int(m.group(1))


def registers_and_spills(kernel: Any, ptxas_log: str) -> tuple[int | None, int | None]:
    """(registers per thread, 32-bit registers spilled) from ptxas's log (CUDA) or the
    AMDGCN metadata (AMD)."""
    if "amdgcn" in kernel.asm:
        amdgcn = kernel.asm["amdgcn"]
        spills = [_number(rf"^\s*\.{kind}_spill_count:\s*(\d+)", amdgcn) for kind in ("vgpr", "sgpr")]
        return _number(r"^\s*\.vgpr_count:\s*(\d+)", amdgcn), None if None in spills else sum(spills)
    spill_bytes = _number(r"(\d+) bytes spill stores", ptxas_log)
    return _number(r"Used (\d+) registers", ptxas_log), None if spill_bytes is None else spill_bytes // 4


def _row(variant: KernelVariant, aligned: bool, target: str) -> Row:
    return Row(kernel_name(variant), f"{variant.label} {ALIGNED[aligned]}", target)


def compile_row(variant: KernelVariant, aligned: bool, target: str) -> Row:
    """`variant` (n a multiple of 16 when `aligned`) compiled for `target`, measured; a failure
    is the row's error, its first line."""
    row = _row(variant, aligned, target)
    try:
        kernel, log = _compile(variant, aligned, target)
    except Exception as e:  # every compiler failure is the row's result
        lines = str(e).strip().splitlines()
        row.error = f"{type(e).__name__}: {lines[0] if lines else ''}"
        return row
    row.registers, row.spills = registers_and_spills(kernel, log)
    row.shared_bytes = kernel.metadata.shared
    asm = kernel.asm["ptx"] if "ptx" in kernel.asm else kernel.asm["amdgcn"]
    row.vector_width_bits = bulk_vector_width(asm, kernel.asm["ttir"])
    return row


# ---- vector widths -------------------------------------------------------------------------
_PTX_ACCESS = re.compile(r"\b(?:ld|st)\.global((?:\.[\w:]+)*)")
_AMD_ACCESS = re.compile(r"^\s*(?:global|buffer|flat)_(?:load|store)_(\w+)")
_AMD_WIDTH = (
    (r"(?:lds_)?dword(?:x(\d))?", 32),
    (r"[us]?byte(?:_d16(?:_hi)?)?", 8),
    (r"[us]?short(?:_d16(?:_hi)?)?", 16),
)
_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+(?:"[^"]*"\s+)?"([^"]+)"')
_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)")


def access_width(line: str) -> int | None:
    """Bits moved per thread by a PTX or AMDGCN global load / store on `line` (None: not one)."""
    if m := _PTX_ACCESS.search(line):
        vector = re.search(r"\.v(\d)\b", m.group(1))
        bits = re.findall(r"\.[bsuf](\d+)\b", m.group(1))
        return int(vector.group(1) if vector else 1) * int(bits[-1]) if bits else None
    if m := _AMD_ACCESS.match(line):
        suffix = m.group(1)
        if b := re.fullmatch(r"[bui](\d+)", suffix):
            return int(b.group(1))
        for pattern, bits in _AMD_WIDTH:
            if w := re.fullmatch(pattern, suffix):
                return bits * int(w.groups()[0] or 1) if w.groups() else bits
    return None


def global_accesses(asm: str) -> list[tuple[tuple[str, int] | None, int]]:
    """((source file name, line) of the latest .loc or None, bits) of every global access. In
    PTX an inline-asm block (Triton's loads and stores) is one source line, its first .loc:
    LLVM's later .locs in it count the block's own lines on from there."""
    lines = asm.splitlines()
    files = {m.group(1): os.path.basename(m.group(2)) for line in lines if (m := _FILE.match(line))}  # PTX: at the end
    where, in_block, located, found = None, False, False, []
    for line in lines:
        if "begin inline asm" in line:
            in_block, located = True, False
        elif "end inline asm" in line:
            in_block = False
        elif m := _LOC.match(line):
            if not (in_block and located):
                where = (files.get(m.group(1), ""), int(m.group(2)))
            located = in_block
        elif (bits := access_width(line)) is not None:
            found.append((where, bits))
    return found


def scalar_access_lines(ttir: str) -> set[tuple[str, int]]:
    """(file name, line) of every tt.load / tt.store through a scalar pointer in the TTIR."""
    aliases = dict(re.findall(r"^(#loc\d*) = loc\((.*)\)\s*$", ttir, re.MULTILINE))

    def resolve(body: str) -> tuple[str, int] | None:
        if m := re.search(r'"([^"]+)":(\d+):\d+', body):
            return os.path.basename(m.group(1)), int(m.group(2))
        return next(
            (r for ref in re.findall(r"#loc\d*", body) if (r := resolve(aliases.get(ref, ""))) is not None), None
        )

    ops = re.findall(r"\btt\.(?:load|store)\b[^:]*:\s*!tt\.ptr<.*\bloc\((.*)\)\s*$", ttir, re.MULTILINE)
    return {where for body in ops if (where := resolve(body)) is not None}


def bulk_vector_width(asm: str, ttir: str) -> int | None:
    """The narrowest global access of `asm` outside the TTIR's scalar-pointer accesses."""
    scalar = scalar_access_lines(ttir)
    return min((bits for where, bits in global_accesses(asm) if where not in scalar), default=None)


# ---- the table -----------------------------------------------------------------------------
Job = tuple[int, bool, str]  # (index into `variants()`, n a multiple of 16, target)


def _worker(conn: Connection, log: str) -> None:
    """Compile the jobs that come through `conn` until None, sending back each row; C-level
    stderr (MLIR, LLVM) goes to `log`, emptied at each job."""
    os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    while (job := conn.recv()) is not None:
        os.ftruncate(2, 0)
        index, aligned, target = job
        conn.send(compile_row(variants()[index], aligned, target))


def _start(ctx: Any, log: str) -> tuple[Connection, mp.process.BaseProcess, str]:
    """A forked `_worker`: (the parent's end of its pipe, the process, its stderr log)."""
    conn, theirs = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(theirs, log), daemon=True)
    proc.start()
    theirs.close()
    return conn, proc, log


def _died(job: Job, exitcode: int | None, log: str) -> Row:
    """The row of a compile whose process died (an LLVM abort): its first error line."""
    index, aligned, target = job
    lines = [line.strip() for line in Path(log).read_text(errors="replace").splitlines() if line.strip()]
    error = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "")
    row = _row(variants()[index], aligned, target)
    row.error = f"the compiler died (exit code {exitcode}): {error}"
    return row


def compile_table(kernels: tuple[str, ...], targets: tuple[str, ...], jobs: int = 1) -> list[Row]:
    """Every specialization of `kernels` (names as `kernel_name`) × n alignment × `targets`,
    compiled by `jobs` forked worker processes (a compiler that aborts is its row's error and
    its worker is replaced); rows in kernel, signature, target order."""
    ctx = mp.get_context("fork")
    work = [
        (i, aligned, target)
        for i, v in enumerate(variants())
        if kernel_name(v) in kernels
        for aligned in ALIGNED
        for target in targets
    ]
    todo, rows = list(range(len(work)))[::-1], dict[int, Row]()
    busy: dict[Connection, tuple[mp.process.BaseProcess, str, int]] = {}
    with tempfile.TemporaryDirectory() as logs:
        idle = [_start(ctx, os.path.join(logs, f"{n}.log")) for n in range(min(jobs, len(work)))]
        while todo or busy:
            while todo and idle:
                conn, proc, log = idle.pop()
                busy[conn] = (proc, log, todo.pop())
                conn.send(work[busy[conn][2]])
            for conn in wait(list(busy)):  # ready: a row came, or the worker is gone
                proc, log, slot = busy.pop(conn)
                try:
                    rows[slot] = conn.recv()
                    idle.append((conn, proc, log))
                except EOFError:
                    proc.join()
                    rows[slot] = _died(work[slot], proc.exitcode, log)
                    idle.append(_start(ctx, os.path.join(logs, f"after{slot}.log")))
        for conn, proc, _ in idle:
            conn.send(None)
            proc.join()
    return [rows[slot] for slot in range(len(work))]


def tables(rows: list[Row]) -> str:
    """One table per kernel: a row per signature and target."""
    columns: dict[str, Cell] = {"signature": "signature", "target": "target", **{c: c for c in COLUMNS[:-1]}}
    columns["ok"] = lambda r: "yes" if r["error"] is None else f"NO: {r['error']}"
    kernels = dict.fromkeys(r.kernel for r in rows)
    records = [dataclasses.asdict(r) for r in rows]
    return "\n\n".join(f"{k}\n\n" + table([r for r in records if r["kernel"] == k], columns) for k in kernels)


def _span(values: list[int | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    return str(min(known)) if min(known) == max(known) else f"{min(known)}-{max(known)}"


def summary(rows: list[Row]) -> str:
    """A row per kernel and target: signatures compiled, registers, most spills and shared
    bytes, the narrowest vector width with n a multiple of 16 and without."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.kernel, r.target), []).append(r)
    cells = []
    for (kernel, target), group in groups.items():
        widths = [_span([r.vector_width_bits for r in group if r.signature.endswith(a)]) for a in ALIGNED.values()]
        spills, shared = (
            [getattr(r, c) for r in group if getattr(r, c) is not None] for c in ("spills", "shared_bytes")
        )
        ok = sum(r.ok for r in group)
        cells.append(
            [
                kernel,
                target,
                f"{ok}/{len(group)}",
                _span([r.registers for r in group]),
                max(spills, default="-"),
                max(shared, default="-"),
                *widths,
            ]
        )
    headers = ["kernel", "target", "compiled", "registers", "spills (most)", "shared bytes (most)"]
    return format_table([*headers, *(f"vector bits {a}" for a in ALIGNED.values())], cells)


def kernel_names() -> tuple[str, ...]:
    """The names of the kernels that `variants` lists, in its order."""
    return tuple(dict.fromkeys(kernel_name(v) for v in variants()))


@dataclass
class Options:
    json: str | None = arg(None, "also write one JSON object per row to this file")
    kernels: tuple[str, ...] = arg(kernel_names(), "the kernels to compile", choices=kernel_names())
    targets: tuple[str, ...] = arg(tuple(TARGETS), "the targets to compile for", choices=tuple(TARGETS))
    jobs: int = arg(min(os.cpu_count() or 1, 8), "compiler processes")


def main(argv: list[str] | None = None) -> int:
    p = config_parser(Options, __doc__)
    args = config_from(Options, p.parse_args(argv))
    if not variants():
        p.error("triton is not installed: there is nothing to compile")
    if fused.triton.knobs.runtime.interpret:
        p.error("TRITON_INTERPRET is set: the kernels are interpreted, not compiled; unset it")
    start = time.perf_counter()
    rows = compile_table(args.kernels, args.targets, args.jobs)
    seconds = time.perf_counter() - start
    print(tables(rows) + "\n\nsummary\n\n" + summary(rows))
    failed = [r for r in rows if not r.ok]
    print(f"\n{len(rows)} rows in {seconds:.0f} s, {args.jobs} compiles at a time; {len(failed)} did not compile")
    if args.json:
        write_json(args.json, [r.as_json() for r in rows])
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
