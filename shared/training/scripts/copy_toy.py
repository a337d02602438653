"""Toy: does block-decoding masking teach a bidirectional masked-diffusion model to copy a long passage?

Rows: four (name, 32-token passage) pairs whose even positions are shared (the same sentence frame), a query
name, the answer = that name's passage. Share 0: the answer masked at one ratio t ~ U(0.02, 1) (loss 1/t);
share 0.5: half the rows block-masked (clean answer prefix of k*8 tokens, the next block at ratio t, every
later token masked, loss weight 1 there). Eval: 128 rows decoded in blocks of 8, one token per step, most
confident first; token accuracy. A 4-layer, 128-wide bidirectional transformer, one CPU thread.

    python shared/training/scripts/copy_toy.py STEPS SHARE     # e.g. 2500 0.0 and 2500 0.5 (~40 min each)
"""

import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

V, NP, PL, B = 96, 4, 32, 8  # vocab, passages, passage length, decode block
MASK, QRY = 0, 1  # special ids; names 2..17, content 18..V-1
T = NP * (PL + 1) + 2 + PL


def rows(n, g):
    names = torch.stack([torch.randperm(16, generator=g)[:NP] + 2 for _ in range(n)])
    content = torch.randint(18, V, (n, NP, PL), generator=g)
    # distractors share the first half of a frame: passages 1..3 copy passage 0's even positions
    content[:, 1:, ::2] = content[:, :1, ::2]
    ctx = torch.cat([names[:, :, None], content], dim=2).reshape(n, -1)
    pick = torch.randint(0, NP, (n,), generator=g)
    ans = content[torch.arange(n), pick]
    x = torch.cat([ctx, torch.full((n, 1), QRY), names[torch.arange(n), pick][:, None], ans], dim=1)
    return x


class Net(nn.Module):
    def __init__(s, d=128, L=4, h=4):
        super().__init__()
        s.emb = nn.Embedding(V, d)
        s.pos = nn.Embedding(T, d)
        s.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, h, 4 * d, 0.0, batch_first=True, norm_first=True) for _ in range(L)
        )
        s.out = nn.Linear(d, V)

    def forward(s, x):
        hdn = s.emb(x) + s.pos(torch.arange(x.shape[1]))
        for layer in s.layers:
            hdn = layer(hdn)
        return s.out(hdn)


def mask(x, share, g):
    n = x.shape[0]
    a0 = T - PL
    t = torch.rand(n, 1, generator=g).clamp_min(0.02)
    m = torch.zeros_like(x, dtype=torch.bool)
    rnd = torch.rand(n, PL, generator=g) < t
    blockrow = torch.rand(n, generator=g) < share
    k = torch.randint(0, PL // B, (n,), generator=g)
    pos = torch.arange(PL)[None]
    lo = (k * B)[:, None]
    blk = (pos >= lo) & (pos < lo + B)
    after = pos >= lo + B
    bm = (blk & rnd) | after
    am = torch.where(blockrow[:, None], bm, rnd)
    am[am.sum(1) == 0, -1] = True
    m[:, a0:] = am
    w = torch.where(blockrow[:, None] & after, torch.ones_like(t), 1 / t).expand(n, PL)
    return m, w


def train(share, steps, seed=0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), 1e-3, weight_decay=0.01)
    for s in range(steps):
        x = rows(32, g)
        m, w = mask(x, share, g)
        lr = 1e-3 * min(1, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / steps))
        [pg.__setitem__("lr", lr) for pg in opt.param_groups]
        logits = net(x.masked_fill(m, MASK))
        a0 = T - PL
        ce = F.cross_entropy(logits[:, a0:].reshape(-1, V), x[:, a0:].reshape(-1), reduction="none").view(
            -1, PL
        )
        mm = m[:, a0:].float()
        loss = ((ce * w * mm).sum(1) / mm.sum(1).clamp_min(1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if s % 500 == 0:
            print(f"share {share} step {s} loss {loss.item():.3f}", flush=True)
    return net


@torch.no_grad()
def evaluate(net, n=128, seed=99):
    g = torch.Generator().manual_seed(seed)
    x = rows(n, g)
    a0 = T - PL
    y = x.clone()
    y[:, a0:] = MASK
    for b in range(PL // B):
        for _ in range(B):
            p = net(y).softmax(-1)
            conf, tok = p.max(-1)
            sl = slice(a0 + b * B, a0 + (b + 1) * B)
            c = conf[:, sl].masked_fill(y[:, sl] != MASK, -1)
            j = c.argmax(1)
            rowsi = torch.arange(n)
            y[rowsi, a0 + b * B + j] = tok[rowsi, a0 + b * B + j]
    return (y[:, a0:] == x[:, a0:]).float().mean().item()


if __name__ == "__main__":
    steps = int(sys.argv[1])
    share = float(sys.argv[2])
    t0 = time.time()
    torch.set_num_threads(1)
    net = train(share, steps)
    print(
        f"RESULT share {share} steps {steps} token_acc {evaluate(net):.3f} ({time.time() - t0:.0f}s)",
        flush=True,
    )
