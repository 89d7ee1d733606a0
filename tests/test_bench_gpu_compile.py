"""Every Triton kernel compiles ahead of time, without a GPU, for sm_80, sm_90, sm_100, gfx90a
and gfx942 (`experiments.bench.gpu_compile`): no compile error, no register spill, and, where n
is a multiple of 16 (ZeroOptimizer's shards), every block-wide global load and store
vectorized: 128-bit on NVIDIA; at least 64-bit on AMD, where a 64-lane wave gives each lane
4 (Adam: 2048 / (8 warps · 64)) to 16 elements, so 16-bit and int8 data move 64 bits a lane.
With n not a multiple of 16 Triton cannot prove the tail mask uniform over a vector and
emits scalar accesses: those rows only have to compile without spills.

The quick run compiles one or two specializations per kernel and bit width on every target;
the full table (every specialization, `slow`) is compiled by two worker processes. The parsers of the machine code are
checked on written snippets."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import slow_except

pytest.importorskip("triton")

from experiments.bench import gpu_compile as gc

VARIANTS = {f"{gc.kernel_name(v)} {v.label}": v for v in gc.variants()}
QUICK = [
    "adam_kernel grad=bf16 out=bf16 lerp_from_m=1 l2=0",  # ZeroOptimizer's bf16 step
    "adam_kernel grad=fp32 out=none lerp_from_m=0 l2=1",
    "quantize_kernel x=bf16 bits=8",
    "quantize_kernel x=fp32 bits=4",
    "dequantize_kernel out=fp16 bits=8",
    "dequantize_kernel out=bf16 bits=4",
]
MIN_VECTOR_BITS = {"cuda": 128, "hip": 64}


def test_the_variants_cover_the_launches() -> None:
    """3 grads × 3 outs × LERP_FROM_M × L2 Adam specializations, quantize and dequantize for 3
    dtypes × int8 / int4, each labelled once, with a value for every constexpr parameter."""
    assert Counter(gc.kernel_name(v) for v in gc.variants()) == {
        "adam_kernel": 36,
        "quantize_kernel": 6,
        "dequantize_kernel": 6,
    }
    assert len(VARIANTS) == len(gc.variants()) and set(QUICK) <= set(VARIANTS)
    for v in gc.variants():
        assert {k for k, t in v.signature.items() if t == "constexpr"} == set(v.constexprs), v.label
        assert {"num_warps", "enable_fp_fusion"} <= set(v.options), v.label


def problem(row: gc.Row) -> str | None:
    """What is wrong with a compiled row: an error, a spill, a scalar bulk access (n%16=0)."""
    if not row.ok:
        return row.error
    if not row.registers or row.spills != 0 or row.shared_bytes is None:
        return f"registers {row.registers}, spills {row.spills}, shared {row.shared_bytes}"
    aligned = row.signature.endswith(gc.ALIGNED[True])
    if aligned and (row.vector_width_bits or 0) < MIN_VECTOR_BITS[gc.TARGETS[row.target][0]]:
        return f"{row.vector_width_bits}-bit bulk access"
    return None


@pytest.mark.parametrize("name", QUICK)
@pytest.mark.parametrize(
    "target", slow_except(["sm_90", "gfx942"], [t for t in gc.TARGETS if t not in ("sm_90", "gfx942")])
)
def test_compiles_without_spills_and_vectorized(name: str, target: str) -> None:
    for aligned in (True, False):
        row = gc.compile_row(VARIANTS[name], aligned, target)
        assert problem(row) is None, (row, problem(row))


@pytest.mark.slow
def test_every_specialization_compiles_without_spills_and_vectorized() -> None:
    """The whole table (`python -m experiments.bench.gpu_compile`), by two worker processes."""
    rows = gc.compile_table(gc.kernel_names(), tuple(gc.TARGETS), jobs=2)
    assert len(rows) == len(VARIANTS) * len(gc.ALIGNED) * len(gc.TARGETS)
    bad = [(r.kernel, r.signature, r.target, problem(r)) for r in rows if problem(r) is not None]
    assert not bad, bad


def test_a_compile_error_is_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(gc.TARGETS, "gfx000", ("hip", "gfx000", 64))
    row = gc.compile_row(VARIANTS[QUICK[2]], True, "gfx000")
    assert not row.ok and row.error and "\n" not in row.error and row.registers is None
    assert row.as_json()["ok"] is False


def test_a_compiler_that_dies_is_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile that kills its process (as an LLVM abort does) is that row's error, with the
    error line it wrote to stderr; the other rows are compiled."""
    compile_row = gc.compile_row

    def die_on_gfx942(variant: object, aligned: bool, target: str) -> gc.Row:
        if target == "gfx942":
            os.write(2, b"warning: first\nLLVM ERROR: Cannot select\n")
            os._exit(3)
        return compile_row(variant, aligned, target)

    monkeypatch.setattr(gc, "compile_row", die_on_gfx942)
    rows = gc.compile_table(("dequantize_kernel",), ("sm_90", "gfx942"), jobs=2)
    assert len(rows) == 24 and [r.target for r in rows[:2]] == ["sm_90", "gfx942"]
    assert all(r.ok for r in rows if r.target == "sm_90")
    died = "the compiler died (exit code 3): LLVM ERROR: Cannot select"
    assert all(r.error == died for r in rows if r.target == "gfx942")


def test_command_writes_the_rows_and_fails_on_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "rows.json"
    argv = ["--kernels", "dequantize_kernel", "--targets", "sm_90", "--jobs", "1", "--json", str(out)]
    assert gc.main(argv) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 12 and all(r["ok"] for r in rows)
    assert all(list(r) == ["kernel", "signature", "target", *gc.COLUMNS[:-1], "ok"] for r in rows)
    monkeypatch.setattr(gc, "compile_table", lambda *a: [gc.Row("k", "s", "sm_90", error="E: bad")])
    assert gc.main(argv) == 1


def test_access_widths() -> None:
    assert gc.access_width("\t@%p1 ld.global.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd2 + 0 ];") == 128
    assert gc.access_width("\tld.global.L1::evict_last.v2.b32 { %r1, %r2 }, [ %rd1 + 0 ];") == 64
    assert gc.access_width("\t@%p2 st.global.b16 [ %rd3 + 0 ], { %rs1 };") == 16
    assert gc.access_width("\tld.param.b64 \t%rd7, [_kernel_param_2];") is None
    assert gc.access_width("\tglobal_load_dwordx4 v[0:3], v[4:5], off") == 128
    assert gc.access_width("\tbuffer_store_dwordx2 v[2:3], v1, s[4:7], 0 offen") == 64
    assert gc.access_width("\tglobal_store_short v[0:1], v2, off") == 16
    assert gc.access_width("\tglobal_load_ubyte v3, v[0:1], off") == 8
    assert gc.access_width("\tglobal_load_b128 v[0:3], v4, s[0:1]") == 128
    assert gc.access_width("\ts_load_dword s0, s[0:1], 0x0") is None


PTX = """\t.loc\t1 116 13
\t// begin inline asm
\t.loc\t1 116 13
\tmov.u32 %r1, 0x0;
\t.loc\t1 117 13
\tld.global.b32 { %r1 }, [ %rd1 + 0 ];
\t// end inline asm
\t.loc\t1 125 17
\t// begin inline asm
\t@%p1 ld.global.v2.b32 { %r2, %r3 }, [ %rd2 + 0 ];
\t// end inline asm
\t.file\t1 "/repo/optim/k.py"
"""
TTIR = """#loc = loc("/repo/optim/k.py":110:0)
module {
    %s = tt.load %p : !tt.ptr<f32> loc(#loc3)
    %q = tt.load %ps, %mask : tensor<2048x!tt.ptr<i8>> loc(#loc4)
}
#loc2 = loc("/repo/optim/k.py":116:13)
#loc3 = loc("s"(#loc2))
#loc4 = loc("/repo/optim/k.py":125:17)
"""


def test_scalar_pointer_accesses_are_left_out() -> None:
    """LLVM numbers the lines inside an inline-asm block on from its first .loc: the block is
    its first line; the TTIR's scalar-pointer load (named loc) is matched by that line."""
    assert gc.global_accesses(PTX) == [(("k.py", 116), 32), (("k.py", 125), 64)]
    assert gc.scalar_access_lines(TTIR) == {("k.py", 116)}
    assert gc.bulk_vector_width(PTX, TTIR) == 64
