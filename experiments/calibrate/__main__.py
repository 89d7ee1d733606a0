"""python -m experiments.calibrate --hosts H --procs-per-host P --link RATE --config C --out FILE.yaml

Runs `experiments.calibrate.measure` on the emulated cluster (experiments.cluster: H hosts
as network namespaces, links shaped to RATE, P processes each; root needed), so the numbers
are measured under the process count and network a run will have, and writes the hardware
file that `python -m experiments.plan --hardware FILE.yaml` reads.
"""

from __future__ import annotations

import argparse
import sys

from experiments.cluster.__main__ import main as cluster_main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.calibrate", description=__doc__.split("\n\n")[1])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--procs-per-host", type=int, default=2)
    p.add_argument("--link", default="1gbit", help="every host's link rate (tc units)")
    p.add_argument("--config", required=True, help="the run's config: its model and micro-batch give η")
    p.add_argument("--out", required=True, help="the hardware file to write (YAML)")
    p.add_argument("--name", default="calibrated", help="the system's name in the file")
    args = p.parse_args(argv)
    return cluster_main(
        [
            *("--hosts", str(args.hosts), "--procs-per-host", str(args.procs_per_host), "--link", args.link),
            *("--", "-m", "experiments.calibrate.measure", "--config", args.config, "--out", args.out),
            *("--name", args.name),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
