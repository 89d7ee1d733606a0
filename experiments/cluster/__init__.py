"""A multi-host cluster on one Linux machine, over a network whose link rates we set:
`python -m experiments.cluster --hosts H --procs-per-host P --link RATE -- <torchrun args>`
(docs/training.md, "A cluster on one machine"). Needs root for the network namespaces."""
