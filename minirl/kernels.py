"""Triton kernels for the trainer's log-probs on CUDA: the fused path of minirl.core.token_logprobs.

    lp, lse, ent = forward(x, targets, temperature, entropy=True)   # (c, V) logits -> (c,) fp32 each
    backward(x, targets, lse, g, temperature, out)                   # out (c, V) = (onehot - p) g / T

Forward reads the logits once: each program walks one row in blocks, keeping the running maximum m
and, per lane, s = sum exp(z - m) and t = sum exp(z - m) z (both rescaled when m grows), so that with
the lanes' sums S and T, log-sum-exp = m + log S and entropy = lse - T / S. Backward reads them once
and writes the gradient once (torch.compile's kernels for the same math made three passes forward and
ran 3x slower: benchmarks/results/2026-12-07-e). Checked against core's plain path:
tests/test_kernels.py under Triton's interpreter on CPU, tests/gpu on CUDA. Hardware: CUDA GPUs (bf16,
fp16 or fp32 logits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096      # logits a program reads at once
NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _forward(x_ptr, x_stride, tgt_ptr, lp_ptr, lse_ptr, ent_ptr, V, inv_t,
             ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    m = tl.max(tl.full([BLOCK], NEG_INF, tl.float32), 0)
    s = tl.zeros([BLOCK], tl.float32)
    t = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(x_row + cols, mask=cols < V, other=NEG_INF).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, 0))
        scale = tl.where(m_new == NEG_INF, 1.0, tl.exp(m - m_new))     # -inf - -inf would be NaN
        e = tl.where(z == NEG_INF, 0.0, tl.exp(z - m_new))
        s = s * scale + e
        if ENTROPY:
            t = t * scale + tl.where(e > 0, e * z, 0.0)                 # 0 * -inf counts 0
        m = m_new
    total = tl.sum(s, 0)
    lse = m + tl.log(total)
    tgt = tl.load(tgt_ptr + row)
    tl.store(lp_ptr + row, tl.load(x_row + tgt).to(tl.float32) * inv_t - lse)
    tl.store(lse_ptr + row, lse)
    if ENTROPY:
        tl.store(ent_ptr + row, lse - tl.sum(t, 0) / total)


@triton.jit
def _backward(x_ptr, x_stride, tgt_ptr, lse_ptr, g_ptr, out_ptr, out_stride, V, inv_t,
              ROUND: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    z = tl.load(x_ptr + row * x_stride + cols, mask=cols < V, other=0.0).to(tl.float32) * inv_t
    p = tl.exp(z - tl.load(lse_ptr + row))
    d = (tl.where(cols == tl.load(tgt_ptr + row), 1.0, 0.0) - p) * (tl.load(g_ptr + row) * inv_t)
    if ROUND:                                                       # to bf16 / fp16: to nearest, as torch
        d = d.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(out_ptr + row * out_stride + cols, d, mask=cols < V)


def usable(x: torch.Tensor) -> bool:
    """Whether these kernels take logits x: bf16, fp16 or fp32, contiguous, on CUDA."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.is_contiguous()


def forward(x: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool):
    """(c, V) logits, (c,) targets -> log p(target), log-sum-exp and (with entropy) entropy per row of
    softmax(x / T), fp32."""
    n, v = x.shape
    lp, lse = (torch.empty(n, dtype=torch.float32, device=x.device) for _ in range(2))
    ent = torch.empty(n if entropy else 1, dtype=torch.float32, device=x.device)
    if n:
        _forward[(n,)](x, x.stride(0), targets.contiguous(), lp, lse, ent, v, 1.0 / temperature,
                       ENTROPY=entropy, BLOCK=BLOCK, num_warps=8)
    return (lp, lse, ent) if entropy else (lp, lse)


def backward(x: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, temperature: float,
             out: torch.Tensor) -> None:
    """out = (onehot(targets) - softmax(x / T)) * g / T in out's dtype, for (c, V) logits and (c, 1)
    targets / log-sum-exp / g."""
    n, v = x.shape
    if n:
        flat = (t.reshape(-1).contiguous() for t in (targets, lse, g))     # g may be a broadcast (stride 0)
        _backward[(n, triton.cdiv(v, BLOCK))](x, x.stride(0), *flat, out, out.stride(0), v, 1.0 / temperature,
                                              ROUND=out.dtype != torch.float32, BLOCK=BLOCK, num_warps=8)
