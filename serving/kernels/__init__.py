"""TEMPORARY local reference of the kernel API (replaced by the kernels branch)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x, weight, eps, residual=None):
    s = x + residual if residual is not None else x
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(s.dtype), s


def _rot(x):
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def rotary_kv_write(q, k, v, cos, sin, k_cache, v_cache, slots, positions):
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q2 = q * c + _rot(q) * s
    k2 = k * c + _rot(k) * s
    k_cache[slots, :, positions] = k2.to(k_cache.dtype)
    v_cache[slots, :, positions] = v.to(v_cache.dtype)
    return q2


def silu_mul(gate_up):
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


def decode_attention(q, k_cache, v_cache, slots, lengths, scale):
    B, Hq, D = q.shape
    L = int(lengths.max())
    K = k_cache[:, :, :L].index_select(0, slots)  # (B, Hkv, L, D)
    V = v_cache[:, :, :L].index_select(0, slots)
    Hkv = K.shape[1]
    G = Hq // Hkv
    qg = q.view(B, Hkv, G, D).float()
    s = torch.matmul(qg, K.float().transpose(-1, -2)) * scale  # (B, Hkv, G, L)
    valid = torch.arange(L, device=q.device).view(1, 1, 1, L) < lengths.view(B, 1, 1, 1)
    s = s.masked_fill(~valid, float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.matmul(p, V.float())  # (B, Hkv, G, D)
    return o.reshape(B, Hq, D).to(q.dtype)


def prefill_attention(q, k_cache, v_cache, slots, starts, lengths, scale):
    B, T, Hq, D = q.shape
    L = int(lengths.max())
    K = k_cache[:, :, :L].index_select(0, slots)
    V = v_cache[:, :, :L].index_select(0, slots)
    Hkv = K.shape[1]
    G = Hq // Hkv
    qg = q.permute(0, 2, 1, 3).reshape(B, Hkv, G * T, D).float()
    s = torch.matmul(qg, K.float().transpose(-1, -2)).view(B, Hkv, G, T, L) * scale
    qpos = starts.view(B, 1) + torch.arange(T, device=q.device).view(1, T)  # (B, T)
    qpos = torch.minimum(qpos, lengths.view(B, 1) - 1)
    keys = torch.arange(L, device=q.device)
    valid = keys.view(1, 1, L) <= qpos.unsqueeze(-1)  # (B, T, L)
    s = s.masked_fill(~valid.view(B, 1, 1, T, L), float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.matmul(p.view(B, Hkv, G * T, L), V.float()).view(B, Hkv, G, T, D)
    return o.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D).to(q.dtype)


def lora_shrink(x, A, w):
    return (x @ A.t()) * w


def lora_expand_add(y, h, B):
    return y.addmm_(h, B.t())


def capturable(device):
    return False
