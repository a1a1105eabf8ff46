"""The accuracy cases: measured by tests/test_common_mistakes.py against the rounding
floor, and recorded per architecture in ``tests/adiffs/<arch>.txt``.

Each case names one way attention kernels go wrong numerically (docs/numerical-lessons.md)
and has two sizes: small for Triton's interpreter (CPU), GPU-sized for the device.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from tests.helpers import Results, exact_attention, floor_attention, kernel_attention

# (batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, head_dim_v)
Shape = tuple[int, int, int, int, int, int, int]
CPU = (1, 37, 53, 2, 1, 64, 64)
GPU = (2, 2048, 3001, 8, 2, 128, 128)

BACKENDS = {"split": ("split", False), "fused": ("fused", False), "fused-det": ("fused", True)}
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Case:
    """One forward + backward call: inputs ``randn * magnitude`` in ``dtype``, upstream
    gradient ``randn``; ``inputs`` may rewrite them (a row made to see a very negative score)."""

    name: str
    dtype: torch.dtype
    cpu: Shape = CPU
    cuda: Shape = GPU
    mask: dict = field(default_factory=dict)
    softmax_scale: float | None = None
    magnitude: float = 1.0
    backend: str = "split"

    @property
    def id(self) -> str:
        return f"{self.name}-{DTYPE_NAMES[self.dtype]}-{self.backend}"

    def shape(self, device: str) -> Shape:
        return self.cpu if device == "cpu" else self.cuda

    def inputs(self, device: str) -> tuple[torch.Tensor, ...]:
        batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, head_dim_v = self.shape(device)
        gen = torch.Generator(device).manual_seed(zlib.crc32(self.id.encode()))

        def randn(*shape, scale=self.magnitude):
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(self.dtype)

        q = randn(batch, seqlen_q, heads_q, head_dim)
        k = randn(batch, seqlen_k, heads_k, head_dim)
        v = randn(batch, seqlen_k, heads_k, head_dim_v)
        dout = randn(batch, seqlen_q, heads_q, head_dim_v, scale=1.0)
        return q, k, v, dout

    def run(self, device: str) -> tuple[Results, Results, Results]:
        """(kernel, floor, exact) results of this case on ``device``."""
        q, k, v, dout = self.inputs(device)
        kw = dict(softmax_scale=self.softmax_scale, **self.mask)
        backend, deterministic = BACKENDS[self.backend]
        kernel = kernel_attention(q, k, v, dout, backend=backend, deterministic=deterministic, **kw)
        return kernel, floor_attention(q, k, v, dout, **kw), exact_attention(q, k, v, dout, **kw)


CASES = [
    Case("sharp", torch.float16, magnitude=4.0, mask={"causal": True}),
    Case("sharp", torch.bfloat16, magnitude=4.0, mask={"causal": True}, backend="fused"),
    Case("sharp", torch.float32, magnitude=4.0, mask={"causal": True}, backend="fused-det"),
    Case("zero-scale", torch.float16, softmax_scale=0.0, mask={"window_size": (7, 3), "diagonal": "top_left"}),
    Case("zero-scale", torch.bfloat16, softmax_scale=0.0, backend="fused"),
    Case("negative-scale", torch.float16, softmax_scale=-0.7, magnitude=2.0, mask={"causal": True}),
    Case("negative-scale", torch.bfloat16, softmax_scale=-0.7, magnitude=2.0, mask={"window_size": (9, 4)},
         backend="fused"),
    Case("one-key", torch.float16, mask={"window_size": (0, 0)}, softmax_scale=-0.1, magnitude=4.0),
    Case("one-key-last-row", torch.float16, mask={"window_size": (0, -1)}, softmax_scale=-0.1, magnitude=4.0,
         backend="fused"),
    Case("one-key-tl", torch.bfloat16, mask={"window_size": (0, 0), "diagonal": "top_left"}, backend="fused-det"),
    Case("masked-rows-br", torch.float16, cpu=(2, 50, 21, 2, 1, 32, 32), cuda=(2, 3001, 2048, 8, 2, 128, 128),
         mask={"causal": True}),
    Case("masked-rows-br", torch.bfloat16, cpu=(2, 50, 21, 2, 1, 32, 32), cuda=(2, 3001, 2048, 8, 2, 128, 128),
         mask={"window_size": (3, 0)}, backend="fused"),
    Case("large", torch.float16, magnitude=30.0, mask={"causal": True}),
    Case("large", torch.bfloat16, magnitude=100.0, backend="fused"),
    Case("large-negative-scale", torch.float16, magnitude=10.0, softmax_scale=-1.0, backend="fused"),
    Case("window-left-unbounded", torch.float16, mask={"window_size": (-1, 5)}),
    Case("window-right-unbounded", torch.bfloat16, mask={"window_size": (6, -1), "diagonal": "top_left"},
         backend="fused"),
    Case("head-dim-1", torch.float32, cpu=(1, 17, 31, 2, 2, 1, 1), cuda=(2, 1000, 1500, 4, 2, 1, 1),
         mask={"causal": True}),
    Case("head-dims-7-13", torch.float16, cpu=(2, 31, 33, 3, 1, 7, 13), cuda=(2, 1031, 2049, 6, 2, 7, 13),
         backend="fused"),
    Case("head-dims-72-40", torch.bfloat16, cpu=(1, 63, 17, 4, 2, 72, 40), cuda=(1, 2047, 513, 8, 2, 72, 40),
         mask={"window_size": (11, 2)}, backend="fused-det"),
    Case("head-dims-200-72", torch.float16, cpu=(1, 23, 41, 2, 1, 200, 72), cuda=(2, 777, 3001, 4, 1, 200, 72),
         mask={"causal": True, "diagonal": "top_left"}),
    Case("length-1", torch.float16, cpu=(3, 1, 1, 2, 2, 32, 32), cuda=(64, 1, 1, 8, 8, 128, 128), backend="fused"),
]
