"""Measure on the machine at hand what the planner needs and write it as a hardware file:
`python -m experiments.calibrate --hosts H --procs-per-host P --link RATE --config C --out
FILE.yaml` (docs/planner.md)."""
