"""How ranks are laid out (``ParallelDims``) and how a model is split across them.

Importing this package is light: torch.distributed.tensor (≈1.3 s of imports,
torch._dynamo included) is not pulled in; ``DeviceMesh`` itself comes with torch.
"""

from parallel.dims import ParallelDims

__all__ = ["ParallelDims"]
