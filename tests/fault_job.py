"""The training command with one worker killed (SIGKILL, no chance to clean up) at a chosen
moment of a chosen step, on torchrun's first attempt only: what a restartable job meets.

    torchrun --max-restarts 1 ... -m tests.fault_job MOMENT STEP RANK -- <experiments.train flags>

MOMENT (STEP counts from 0, as the trainer's loop does):
    forward   as the first pipeline chunk's forward starts
    backward  as the first trained parameter's gradient is computed
    step      inside the optimizer step
    save      in the checkpoint save after STEP, once the shards are written and before the
              checkpoint is complete
    between   after STEP and its save, before the next step
"""

from __future__ import annotations

import os
import signal
import sys

MOMENTS = ("forward", "backward", "step", "save", "between")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(moment: str, at: int) -> None:
    """Patch the trainer so that this process dies at `moment` of step `at`."""
    from optim import ZeroOptimizer
    from research import checkpoint, trainer

    now = {"step": -1}
    take_step = trainer.Trainer.step

    def step(self: trainer.Trainer, s: int) -> object:
        now["step"] = s
        if s == at and moment == "forward":
            self.model[0].register_forward_pre_hook(lambda *args: _die())
        if s == at and moment == "backward":
            next(p for p in self.model.parameters() if p.requires_grad).register_hook(lambda g: _die())
        return take_step(self, s)

    trainer.Trainer.step = step
    optimizer_step = ZeroOptimizer.step

    def zero_step(self: ZeroOptimizer, *args: object) -> object:
        if moment == "step" and now["step"] == at:
            _die()
        return optimizer_step(self, *args)

    ZeroOptimizer.step = zero_step
    digests = checkpoint.files.digests

    def digests_then_die(*args: object) -> object:
        if moment == "save" and now["step"] == at:
            _die()
        return digests(*args)

    checkpoint.files.digests = digests_then_die
    after_step = trainer.Trainer._check_loss_and_save

    def check_then_die(self: trainer.Trainer, s: int, *args: object) -> object:
        result = after_step(self, s, *args)
        if moment == "between" and s == at:
            _die()
        return result

    trainer.Trainer._check_loss_and_save = check_then_die


def main() -> None:
    moment, at, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if moment not in MOMENTS or sys.argv[4] != "--":
        raise SystemExit(f"usage: -m tests.fault_job {{{','.join(MOMENTS)}}} STEP RANK -- <training flags>")
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and int(os.environ.get("RANK", "0")) == rank:
        arm(moment, at)
    from experiments import train

    sys.argv = [sys.argv[0], *sys.argv[5:]]
    train.main()


if __name__ == "__main__":
    main()
