"""ROCm builds of torch, checked on the CPU by setting what the code reads: an AMD GPU is a
"cuda" device there (torch.version.hip set, torch.cuda.get_device_name "AMD Instinct ..."),
its collectives are RCCL's under the "nccl" backend name, Triton compiles for it. The peak
and bandwidth table, the fused Adam and quantizer backends, the planner's GPUs and the GPU
suite's header all do what they do on NVIDIA GPUs, with AMD's numbers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from experiments.bench import fused_step_bandwidth
from experiments.bench.gpu_suite import report
from optim import fused, quantize
from parallel import comm
from research import costmodel, metrics
from research.costmodel.datasheet import gpu_peak_flops

CUDA = torch.device("cuda")


@pytest.fixture
def rocm(monkeypatch: pytest.MonkeyPatch):
    """A ROCm build of torch on an AMD GPU called `name` (set with rocm(name))."""
    monkeypatch.setattr(torch.version, "hip", "6.3.42131", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None, raising=False)

    def on(name: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return on


@pytest.mark.parametrize(
    "name, bf16, fp32, hbm",
    [
        ("AMD Instinct MI300X", 1307.4, 163.4, 5300),
        ("AMD Instinct MI325X", 1307.4, 163.4, 6000),
        ("AMD Instinct MI250X/MI250", 191.5, 47.9, 1638.4),  # one GCD
        ("AMD Instinct MI210", 181.0, 45.3, 1638.4),
    ],
)
def test_amd_gpus_have_their_peaks_and_bandwidth(rocm, name: str, bf16: float, fp32: float, hbm: float) -> None:
    rocm(name)
    assert metrics.peak_flops(CUDA, torch.bfloat16) == pytest.approx(bf16 * 1e12)
    assert metrics.peak_flops(CUDA, torch.float16) == pytest.approx(bf16 * 1e12)
    assert gpu_peak_flops(name, torch.float32) == pytest.approx(fp32 * 1e12)
    assert fused_step_bandwidth.hbm_peak(CUDA) == pytest.approx(hbm)


def test_cdna2_has_no_tf32(rocm) -> None:
    """MI250X matrix cores take fp32, not TF32: fp32 counts at its matrix rate either way."""
    assert gpu_peak_flops("AMD Instinct MI250X", torch.float32, tf32=True) == pytest.approx(47.9e12)
    assert gpu_peak_flops("AMD Instinct MI300X", torch.float32, tf32=True) == pytest.approx(653.7e12)


def test_kernels_and_collectives_pick_their_gpu_paths(rocm) -> None:
    """Fused Adam: triton first (apex is absent on a plain ROCm install), torch's fused kernels
    next; the ZeRO++ quantizers: triton; collectives: the default backend of a "cuda" device
    is "nccl", which ROCm's torch serves with RCCL, and comm lets it take "cuda" tensors."""
    rocm("AMD Instinct MI300X")
    pytest.importorskip("triton")
    assert fused.available_backends(CUDA)[:2] == ["triton", "torch_fused"]
    assert "apex" not in fused.available_backends(CUDA)
    assert quantize.pick_backend(CUDA) == "triton"
    assert dist.Backend.default_device_backend_map["cuda"] == "nccl"
    assert "cuda" in comm._RUNS_ON["nccl"]


def test_the_planner_knows_amd_gpus() -> None:
    mi300x, mi250x = costmodel.GPUS["mi300x"], costmodel.GPUS["mi250x"]
    assert mi300x.memory_bytes == 196592 * 2**20 and mi300x.peak_flops == pytest.approx(1307.4e12)
    assert mi250x.memory_bytes == 64 * 2**30 and mi250x.hbm_bandwidth == pytest.approx(1638.4e9)
    from research.model import GPTConfig

    model = GPTConfig(vocab_size=51200, n_layers=32, n_heads=32, d_model=4096, max_seq_len=2048)
    for gpu in (mi300x, mi250x):
        plan = costmodel.plan(model, costmodel.Cluster(gpu, 64), 512, 2048, zero=1, recompute="selective")
        assert plan.ranked, plan.rejected
    # 192 GB per GPU holds what 64 GB per GCD cannot without more model parallelism
    fits = {
        g.name: costmodel.plan(model, costmodel.Cluster(g, 8), 64, 2048, tp=1, pp=1, zero=0) for g in (mi300x, mi250x)
    }
    assert fits["mi300x"].ranked and not fits["mi250x"].ranked


def test_the_gpu_suite_names_rocm_and_rccl() -> None:
    assert report._toolkit({"cuda": None, "hip": "6.3.42131", "nccl": "2.21.5"}) == " (ROCm 6.3.42131, RCCL 2.21.5)"
    assert report._toolkit({"cuda": "13.0", "hip": None, "nccl": "2.28.9"}) == " (CUDA 13.0, NCCL 2.28.9)"
    assert report._toolkit({}) == ""
