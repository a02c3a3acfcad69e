"""Mamba2 state-space math as pure tensor functions (transformers' torch reference, with state in and out).

- `chunk_scan`: the chunked SSD scan over one sequence's chunk of tokens, starting from a saved SSM
  state and returning the state after the last token (chunked prefill continues from it).
- `state_update`: one token per sequence for a whole decode batch: a single batched recurrence step.
- `conv_chunk` / `conv_step`: the causal depthwise conv1d over the (conv state | new tokens) window.
No Python loop runs per token: the scan loops over nothing (every chunk in one einsum), decode is
one tensor op per layer for all running sequences.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[i, j] = sum(x[j+1..i]) for j <= i, -inf above the diagonal."""
    n = x.size(-1)
    x = x[..., None].expand(*x.size(), n)
    x = x.masked_fill(~torch.tril(torch.ones(n, n, device=x.device, dtype=torch.bool), diagonal=-1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(n, n, device=x.device, dtype=torch.bool), diagonal=0), -torch.inf)


def conv_chunk(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU of one sequence's new tokens.

    x [n, C], state [C, K-1] (the inputs before them, zeros for a fresh sequence), weight [C, K].
    Returns (out [n, C], new state [C, K-1])."""
    n = x.shape[0]
    window = torch.cat((state.to(x.dtype), x.t()), dim=1)                   # [C, K-1+n]
    out = F.conv1d(window[None], weight[:, None, :], bias, groups=weight.shape[0])[0]   # [C, n]
    return F.silu(out).t()[:n], window[:, -state.shape[1]:]


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x [B, C], state [B, C, K-1] -> (out [B, C], new state [B, C, K-1])."""
    window = torch.cat((state.to(x.dtype), x[:, :, None]), dim=2)            # [B, C, K]
    out = (window * weight[None]).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out), window[:, :, 1:]


def state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                 B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                 dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrence step for a batch: state [B, H, P, N] (float32), x [B, H, P], dt [B, H],
    A [H] (negative), B/C [B, G, N], D/dt_bias [H]. Returns (y [B, H, P], new state)."""
    b, h, p = x.shape
    g = B.shape[1]
    dt = F.softplus(dt + dt_bias.to(dt.dtype))                              # [B, H]
    dA = torch.exp(dt.float() * A.float())                                  # [B, H]
    Bh = B.repeat_interleave(h // g, dim=1)                                  # [B, H, N]
    Ch = C.repeat_interleave(h // g, dim=1)
    # state * dA + (dt x) outer B, in one pass; y = new state . C as a multiply-sum (a batched gemv
    # of [P, N] x [N] per head is several times slower through bmm on CPU)
    new = torch.addcmul(state * dA[..., None, None], (dt[..., None] * x).float()[..., None],
                        Bh.float()[:, :, None, :])
    y = (new * Ch.float()[:, :, None, :]).sum(-1).to(x.dtype) + x * D[None, :, None]
    return y.to(x.dtype), new


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               D: torch.Tensor, dt_bias: torch.Tensor, chunk_size: int, state: torch.Tensor,
               dt_limit: tuple[float, float] = (0.0, float("inf"))) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD over one sequence's n new tokens: x [n, H, P], dt [n, H], B/C [n, G, N], state [H, P, N]
    (float32, the state before them). Returns (y [n, H, P], state after the last token).

    transformers' mamba2 torch scan, except that B and C stay per group (G groups of K = H / G heads)
    instead of being repeated per head: the C.B scores are computed once per group. Padding the tail
    chunk with dt = 0 leaves the state unchanged, so the final state is the one after token n."""
    n, h, p = x.shape
    g = B.shape[1]
    k = h // g
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    xf = x.float()
    pad = (chunk_size - n % chunk_size) % chunk_size
    d_res = D[:, None].float() * xf
    xs = xf * dt[..., None].float()
    As = A.float() * dt.float()                                              # [n, H]

    def chunks(t: torch.Tensor) -> torch.Tensor:     # [n, ...] -> [c, l, ...] (zero-padded)
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(-1, chunk_size, *t.shape[1:])

    xs = chunks(xs).view(-1, chunk_size, g, k, p)                             # [c, l, g, k, p]
    Bf, Cf = chunks(B.float()), chunks(C.float())                             # [c, l, g, N]
    As = chunks(As).permute(2, 0, 1)                                          # [H, c, l]
    A_cumsum = torch.cumsum(As, dim=-1)
    L = torch.exp(segment_sum(As))                                           # [H, c, l, s]
    scores = torch.einsum("clgn,csgn->cgls", Cf, Bf)                          # [c, g, l, s]: once per group
    M = scores[:, :, None] * L.view(g, k, *L.shape[1:]).permute(2, 0, 1, 3, 4)   # [c, g, k, l, s]
    y_diag = torch.einsum("cgkls,csgkp->clgkp", M, xs)
    decay_states = torch.exp(A_cumsum[:, :, -1:] - A_cumsum)                 # [H, c, l]
    xs_decay = xs * decay_states.view(g, k, *decay_states.shape[1:]).permute(2, 3, 0, 1)[..., None]
    states = torch.einsum("clgn,clgkp->cgkpn", Bf, xs_decay)                  # [c, g, k, p, N]
    states = torch.cat([state[None].to(states.dtype), states.reshape(-1, h, p, states.shape[-1])], dim=0)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cumsum[:, :, -1], (1, 0))))   # [H, z, c]
    new_states = torch.einsum("hcz,zhpn->chpn", decay_chunk, states)
    states, final = new_states[:-1], new_states[-1]
    c_states = torch.einsum("clgn,cgkpn->clgkp", Cf, states.view(-1, g, k, p, states.shape[-1]))
    y_off = c_states * torch.exp(A_cumsum).view(g, k, *A_cumsum.shape[1:]).permute(2, 3, 0, 1)[..., None]
    y = (y_diag + y_off).reshape(-1, h, p)[:n] + d_res
    return y.to(x.dtype), final
