"""Adapters that put ZeroOptimizer into other trainers: `lightning.ZeroStrategy` and
`hf.ZeroTrainer`. Each imports its framework lazily, so `optim` never requires it."""
