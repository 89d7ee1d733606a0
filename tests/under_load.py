"""Run pytest on a busy machine: busy-loop processes beside it, stopped when it ends.

    python -m tests.under_load                    # the default suite beside two busy loops
    python -m tests.under_load --busy 4 -- tests/test_multinode.py -k lost_host

Each busy process spins on one core for as long as pytest runs (a shared node whose cores
other jobs keep busy); the exit code is pytest's. The suite's timing-dependent tests derive
their limits from what they wait for, so they hold here as on an idle machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

SPIN = "while True: pass"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=2, help="busy-loop processes beside pytest (default 2)")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default -q)")
    args = parser.parse_args(argv)
    if args.busy < 0:
        parser.error(f"--busy={args.busy} must be 0 or more")
    busy = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy)]
    started = time.monotonic()
    try:
        code = subprocess.call([sys.executable, "-m", "pytest", *(args.pytest_args or ["-q"])])
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    print(f"under_load: pytest exit {code} in {time.monotonic() - started:.0f} s beside {args.busy} busy loops")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
