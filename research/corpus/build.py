"""Rebuild ``stdlib.jsonl.gz``, the embedded default corpus, from this interpreter's standard
library: ``python research/corpus/build.py`` (CPython 3.11 gives the shipped file; the gzip
header carries no name or time, so the output is byte-for-byte reproducible)."""

from __future__ import annotations

import gzip
import json
import sys
import sysconfig
from pathlib import Path

# Pure-Python modules of CPython's Lib/, sorted; ~1.5 MB of source in all.
MODULES = sorted(
    [
        "abc",
        "argparse",
        "ast",
        "base64",
        "bisect",
        "calendar",
        "cmd",
        "codecs",
        "collections/__init__",
        "colorsys",
        "configparser",
        "contextlib",
        "copy",
        "csv",
        "dataclasses",
        "datetime",
        "enum",
        "fnmatch",
        "fractions",
        "functools",
        "getopt",
        "gettext",
        "glob",
        "graphlib",
        "gzip",
        "heapq",
        "hmac",
        "json/__init__",
        "json/decoder",
        "json/encoder",
        "keyword",
        "linecache",
        "numbers",
        "operator",
        "os",
        "pathlib",
        "pickle",
        "pprint",
        "queue",
        "random",
        "re/__init__",
        "reprlib",
        "sched",
        "secrets",
        "shlex",
        "shutil",
        "statistics",
        "string",
        "tempfile",
        "textwrap",
        "threading",
        "tokenize",
        "traceback",
        "types",
        "warnings",
        "weakref",
    ]
)


def main() -> None:
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = Path(__file__).with_name("stdlib.jsonl.gz")
    with open(out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as f:
        for name in MODULES:
            text = (lib / f"{name}.py").read_text(encoding="utf-8")
            f.write((json.dumps({"text": text, "source": f"Lib/{name}.py"}) + "\n").encode("utf-8"))
    print(f"wrote {out} ({len(MODULES)} modules from Python {sys.version.split()[0]}, {out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
