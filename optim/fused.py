"""Fused mixed-precision Adam / AdamW step over flat fp32 master shards.

The math is torch.optim.Adam / AdamW (amsgrad=False, maximize=False). With t = `step`
(already incremented: 1 on the first step) and g = grad * grad_scale, the grad read in its
own dtype and everything computed in fp32::

    AdamW:  p <- p * (1 - lr*wd)          Adam (L2):  g <- g + wd*p
    m <- lerp(m, g, 1 - beta1)            = beta1*m + (1 - beta1)*g
    v <- beta2*v + (1 - beta2)*g*g
    p <- p - lr/(1 - beta1^t) * m / (sqrt(v)/sqrt(1 - beta2^t) + eps)
    out <- p.to(out.dtype)                (when a low-precision output shard is given)

Backends, all updating masters, exp_avgs and exp_avg_sqs in place:

- "triton": one kernel launch per shard, a single pass reading g, p, m, v and writing
  p, m, v, out (28 bytes/param with bf16 grad and bf16 out). Runs on CPU tensors under
  TRITON_INTERPRET=1, which is how its numerics are tested without a GPU.
- "torch_fused": torch._fused_adam(w)_ on fp32 grads, then the copy into out.
- "apex": apex's amp_C.multi_tensor_adam on fp32 grads, then the copy into out.
- "torch": torch._foreach_* ops in the order of torch's own foreach Adam, so the result is
  bitwise equal to torch.optim.Adam(W) on CPU.
Bias corrections and step sizes are computed on the host in float64, like torch's
non-capturable path, and handed to the kernels as fp32 scalars.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BACKENDS = ("triton", "torch_fused", "apex", "torch")
_UNSUPPORTED_OPTIONS = ("amsgrad", "maximize", "differentiable")
_TRITON_BLOCK = 2048
# fp fusion: contract a*b + c to fma, as nvcc does for torch's kernels
_TRITON_OPTIONS = {"num_warps": 8, "enable_fp_fusion": True}
TRITON_FLOATS = ("fp32", "bf16", "fp16")  # Triton's names of the float dtypes the kernels take


@dataclass(frozen=True)
class _Hyper:
    """One step's hyperparameters and the host-side scalars derived from them."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw: bool
    step: int
    grad_scale: float

    @property
    def decay(self) -> float:
        """AdamW's parameter factor 1 - lr*wd (1 for Adam)."""
        return 1 - self.lr * self.weight_decay if self.adamw else 1.0

    @property
    def l2(self) -> float:
        """Adam's gradient term coefficient wd (0 for AdamW)."""
        return 0.0 if self.adamw else self.weight_decay

    @property
    def neg_step_size(self) -> float:
        """-lr / (1 - beta1^t)."""
        return (self.lr / (1 - self.beta1**self.step)) * -1

    @property
    def bias_correction2_sqrt(self) -> float:
        """(1 - beta2^t) ** 0.5."""
        return (1 - self.beta2**self.step) ** 0.5


class _Shards(NamedTuple):
    """The lists a step works on, one entry per shard."""

    masters: list[Tensor]
    grads: list[Tensor]
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    params_out: list[Tensor | None]


# ---- backend discovery ---------------------------------------------------------------------
@functools.cache
def _apex_kernels() -> tuple[Callable[..., Any], Any] | None:
    """(multi_tensor_applier, amp_C) when NVIDIA apex with its CUDA extensions is installed."""
    try:
        import amp_C
        from apex.multi_tensor_apply import multi_tensor_applier
    except ImportError:
        return None
    return (multi_tensor_applier, amp_C) if multi_tensor_applier.available else None


def triton_runs_on(device: torch.device) -> bool:
    """Triton compiles for CUDA; CPU tensors run only under its interpreter (TRITON_INTERPRET=1)."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and bool(triton.knobs.runtime.interpret))


def available_backends(device: torch.device | str) -> list[str]:
    """The backends that run on `device`, in preference order (CUDA: triton, apex,
    torch_fused, torch; CPU: torch_fused (vectorized, ~4x the foreach ops here), torch)."""
    device = torch.device(device)
    usable = {
        "triton": triton_runs_on(device),
        "apex": device.type == "cuda" and _apex_kernels() is not None,
        "torch_fused": device.type in _get_fused_kernels_supported_devices(),
        "torch": True,
    }
    order = ("triton", "apex", "torch_fused", "torch") if device.type == "cuda" else ("torch_fused", "torch", "triton")
    return [b for b in order if usable[b]]


def pick_backend(device: torch.device | str, requested: str | None = None) -> str:
    """`requested` if it runs on `device`, else ValueError; None picks the first available."""
    device = torch.device(device)
    available = available_backends(device)
    if requested is None:
        return available[0]
    if requested not in available:
        raise ValueError(
            f"Adam backend {requested!r} is not available on {device.type}; available: {', '.join(available)}."
        )
    return requested


def adam_hyperparams(group: dict[str, Any], optimizer_class: type) -> dict[str, Any] | None:
    """The keyword arguments of `adam_step_` (lr, beta1, beta2, eps, weight_decay, adamw) for a
    param group of exactly torch.optim.Adam or AdamW; None for any other class (a subclass may
    override step) or an option this step does not implement (amsgrad, maximize, differentiable)."""
    if optimizer_class not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    if any(group.get(option) for option in _UNSUPPORTED_OPTIONS):
        return None
    beta1, beta2 = group["betas"]
    return {
        "lr": float(group["lr"]),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "eps": float(group["eps"]),
        "weight_decay": float(group["weight_decay"]),
        "adamw": optimizer_class is torch.optim.AdamW or bool(group.get("decoupled_weight_decay")),
    }


# ---- the step --------------------------------------------------------------------------------
def adam_step_(
    backend: str,
    masters: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    params_out: list[Tensor | None],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    step: int,
    grad_scale: float = 1.0,
) -> None:
    """One Adam (adamw=False) or AdamW step of `backend` on fp32 `masters` with the math of the
    module docstring; `params_out[i]`, when not None, receives masters[i].to(its dtype)."""
    if backend not in _STEPS:
        raise ValueError(f"unknown Adam backend {backend!r}; known: {', '.join(BACKENDS)}.")
    if step < 1:
        raise ValueError(f"step={step} must be >= 1 (it is incremented before the update).")
    shards = _Shards(masters, grads, exp_avgs, exp_avg_sqs, params_out)
    _check_shards(shards)
    if not masters:
        return
    scalars = (float(x) for x in (lr, beta1, beta2, eps, weight_decay))
    _STEPS[backend](shards, _Hyper(*scalars, adamw=bool(adamw), step=int(step), grad_scale=float(grad_scale)))


def _check_shards(s: _Shards) -> None:
    """Same-length lists of contiguous same-size shards; masters and Adam state in fp32."""
    if len({len(tensors) for tensors in s}) != 1:
        raise ValueError("masters, grads, exp_avgs, exp_avg_sqs and params_out must have the same length.")
    for master, grad, exp_avg, exp_avg_sq, out in zip(*s):
        if any(t.dtype != torch.float32 for t in (master, exp_avg, exp_avg_sq)):
            raise ValueError("master shards, exp_avg and exp_avg_sq must be float32.")
        shards = [t for t in (master, grad, exp_avg, exp_avg_sq, out) if t is not None]
        if any(t.numel() != master.numel() or not t.is_contiguous() for t in shards):
            raise ValueError("master, grad, exp_avg, exp_avg_sq and output shards must be contiguous and of one size.")


def _fp32_grads(s: _Shards, h: _Hyper) -> list[Tensor]:
    """float32(g) * grad_scale; the caller's tensors are returned (never modified) for fp32 g and scale 1."""
    grads32 = [g.float() for g in s.grads]
    return grads32 if h.grad_scale == 1.0 else torch._foreach_mul(grads32, h.grad_scale)


def _copy_out(s: _Shards) -> None:
    """out <- master.to(out.dtype) (round to nearest even)."""
    for master, out in zip(s.masters, s.params_out):
        if out is not None:
            out.copy_(master)


def _torch_step(s: _Shards, h: _Hyper) -> None:
    """The op sequence of torch.optim.adam._multi_tensor_adam (non-capturable), so results
    are bitwise those of torch.optim.Adam(W) with .grad = float32(g) * grad_scale."""
    grads32 = _fp32_grads(s, h)
    if h.weight_decay != 0:
        if h.adamw:
            torch._foreach_mul_(s.masters, h.decay)
        else:
            grads32 = torch._foreach_add(grads32, s.masters, alpha=h.weight_decay)
    torch._foreach_lerp_(s.exp_avgs, grads32, 1 - h.beta1)
    torch._foreach_mul_(s.exp_avg_sqs, h.beta2)
    torch._foreach_addcmul_(s.exp_avg_sqs, grads32, grads32, 1 - h.beta2)
    denom = torch._foreach_sqrt(s.exp_avg_sqs)
    torch._foreach_div_(denom, [h.bias_correction2_sqrt] * len(denom))
    torch._foreach_add_(denom, h.eps)
    torch._foreach_addcdiv_(s.masters, s.exp_avgs, denom, [h.neg_step_size] * len(denom))
    _copy_out(s)


def _torch_fused_step(s: _Shards, h: _Hyper) -> None:
    """torch._fused_adam(w)_ on float32(g) * grad_scale. Its own grad_scale argument is not
    used: it divides by the scale and overwrites the caller's grads with the result."""
    fused = torch._fused_adamw_ if h.adamw else torch._fused_adam_
    step = torch.tensor(float(h.step), device=s.masters[0].device)
    fused(
        s.masters,
        _fp32_grads(s, h),
        s.exp_avgs,
        s.exp_avg_sqs,
        [],
        [step] * len(s.masters),
        lr=h.lr,
        beta1=h.beta1,
        beta2=h.beta2,
        weight_decay=h.weight_decay,
        eps=h.eps,
        amsgrad=False,
        maximize=False,
    )
    _copy_out(s)


def _apex_step(s: _Shards, h: _Hyper) -> None:
    """amp_C.multi_tensor_adam(chunk, noop, [g, p, m, v], lr, beta1, beta2, eps, step, mode,
    bias_correction, wd) with mode 1 = AdamW, 0 = L2; it needs one dtype across the four
    lists, so g is float32(g) * grad_scale."""
    kernels = _apex_kernels()
    if kernels is None:
        raise ValueError("Adam backend 'apex' needs NVIDIA apex built with its CUDA extensions (amp_C).")
    multi_tensor_applier, amp_C = kernels
    noop_flag = torch.zeros(1, dtype=torch.int32, device=s.masters[0].device)
    multi_tensor_applier(
        amp_C.multi_tensor_adam,
        noop_flag,
        [_fp32_grads(s, h), s.masters, s.exp_avgs, s.exp_avg_sqs],
        h.lr,
        h.beta1,
        h.beta2,
        h.eps,
        h.step,
        int(h.adamw),
        1,
        h.weight_decay,
    )
    _copy_out(s)


def _triton_step(s: _Shards, h: _Hyper) -> None:
    """One `_adam_kernel` launch per shard."""
    if triton is None:
        raise ValueError("Adam backend 'triton' needs triton installed.")
    lerp_weight = 1 - h.beta1
    for master, grad, exp_avg, exp_avg_sq, out in zip(*s):
        n = master.numel()
        if n == 0:
            continue
        _adam_kernel[(triton.cdiv(n, _TRITON_BLOCK),)](
            master, grad, exp_avg, exp_avg_sq, master if out is None else out, n,
            h.grad_scale, h.decay, h.l2, lerp_weight, h.beta2, 1 - h.beta2,
            h.bias_correction2_sqrt, h.eps, h.neg_step_size,
            LERP_FROM_M=abs(lerp_weight) < 0.5, L2=h.l2 != 0, HAS_OUT=out is not None,
            BLOCK=_TRITON_BLOCK, **_TRITON_OPTIONS,
        )  # fmt: skip


class KernelVariant(NamedTuple):
    """One specialization of a Triton kernel as a launch compiles it: what `triton.compile`
    needs to build the same binary ahead of time, without a GPU."""

    kernel: Any  # the @triton.jit function
    label: str  # the specialization in words, e.g. "grad=bf16 out=none lerp_from_m=1 l2=0"
    signature: dict[str, str]  # argument -> Triton type: "*bf16", "i32", "fp32" or "constexpr"
    constexprs: dict[str, Any]
    options: dict[str, Any]  # the launch's compile options (num_warps, enable_fp_fusion)


def kernel_signature(kernel: Any, types: dict[str, str]) -> dict[str, str]:
    """Triton's signature of `kernel`: "constexpr" for its constexpr parameters, `types[name]`
    for the others, "fp32" (a Python float) where `types` does not name one."""
    return {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "fp32") for p in kernel.params}


def triton_variants() -> list[KernelVariant]:
    """Every specialization `_triton_step` launches: grad fp32 / bf16 / fp16 × out bf16 / fp16 /
    none × LERP_FROM_M × L2, with its launch options (for shards under 2^31 elements: n is i32)."""
    if triton is None:
        return []
    variants = []
    for grad, out, lerp_from_m, l2 in itertools.product(
        TRITON_FLOATS, ("bf16", "fp16", None), (True, False), (True, False)
    ):
        pointers = {"master_ptr": "fp32", "grad_ptr": grad, "exp_avg_ptr": "fp32", "exp_avg_sq_ptr": "fp32"}
        types = {name: f"*{dtype}" for name, dtype in {**pointers, "out_ptr": out or "fp32"}.items()}
        variants.append(
            KernelVariant(
                _adam_kernel,
                f"grad={grad} out={out or 'none'} lerp_from_m={int(lerp_from_m)} l2={int(l2)}",
                kernel_signature(_adam_kernel, {**types, "n": "i32"}),
                {"LERP_FROM_M": lerp_from_m, "L2": l2, "HAS_OUT": out is not None, "BLOCK": _TRITON_BLOCK},
                _TRITON_OPTIONS,
            )
        )
    return variants


_STEPS: dict[str, Callable[..., None]] = {
    "triton": _triton_step,
    "torch_fused": _torch_fused_step,
    "apex": _apex_step,
    "torch": _torch_step,
}


if triton is not None:

    @triton.jit
    def to_rne(x, dtype: tl.constexpr):
        """x.to(dtype), rounding to nearest even; to bf16 on the bits, as c10 does (the
        interpreter's own fp32 -> bf16 cast truncates)."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            bits = tl.where(x != x, 0x7FC0, bits)
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)

    @triton.jit
    def _adam_kernel(
        master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, n,
        grad_scale, decay, l2, lerp_weight, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size,
        LERP_FROM_M: tl.constexpr, L2: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """The module docstring's update for one BLOCK of a shard, with torch's op order:
        m = lerp as torch computes it (m + w*(g - m) for w < 0.5, else g - (g - m)*(1 - w)),
        v = v*beta2 + (1 - beta2)*(g*g), p = p + (-step_size) * (m / denom), IEEE sqrt and div."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32) * grad_scale
        p = tl.load(master_ptr + offsets, mask=mask) * decay
        m = tl.load(exp_avg_ptr + offsets, mask=mask)
        v = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
        if L2:
            g = g + l2 * p
        if LERP_FROM_M:  # noqa: SIM108 - a branch on a triton constexpr, kept as the compiler sees it
            m = m + lerp_weight * (g - m)
        else:
            m = g - (g - m) * (1.0 - lerp_weight)
        v = v * beta2 + one_minus_beta2 * (g * g)
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        p = p + neg_step_size * tl.div_rn(m, denom)
        tl.store(master_ptr + offsets, p, mask=mask)
        tl.store(exp_avg_ptr + offsets, m, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)
        if HAS_OUT:
            tl.store(out_ptr + offsets, to_rne(p, out_ptr.dtype.element_ty), mask=mask)
