"""PyTorch peer of cohort's examples/gpt: the same byte-level GPT, layout and step, in PyTorch DTensor TP + DDP.

Launch (CPU, gloo; world size = dp * tp, tp innermost so ranks 0..tp-1 form the first tp group):
  OMP_NUM_THREADS=1 /root/.cache/cohort/pytorch-2.13.0/bin/python -m torch.distributed.run --standalone \
      --nproc-per-node 4 bench/gpt_tp_peer.py --tp 2 --dp 2 --max-steps 30
  OMP_NUM_THREADS=1 /root/.cache/cohort/pytorch-2.13.0/bin/python bench/gpt_tp_peer.py --max-steps 30   # tp 1 dp 1
Prints from rank 0:  RESULT gpt_peer dp=D tp=T steps=S tokens_per_s=X loss=L
(tokens/s: global tokens (batch * context per step) over the steps after the first 5, training only;
loss: the last step's training loss, averaged over the dp ranks.)

Model (examples/gpt/model.hpp): vocab 256, learned positions, L pre-norm blocks
x + proj(attn(qkv(ln1 x))), x + fc2(gelu_erf(fc1(ln2 x))), final LayerNorm, bias-free head; no dropout.
Attention is written op for op as in model.hpp (matmul, causal masked_fill, softmax, matmul), not SDPA.
Weights are drawn as model.hpp draws them: each full weight from its own generator seeded
seed * 1000003 + slot, N(0, 0.02) (residual projections 0.02 / sqrt(2L), positions 0.01, biases 0),
so every tp degree starts from slices of the same full weights. The fused qkv weight [3*dim, dim]
(rows q|k|v) is stored with its rows regrouped per head (head h: q_h, k_h, v_h), so ColwiseParallel's
contiguous row shard hands each tp rank whole heads, as cohort's ColumnParallelLinear(blocks=3) does.
Training: AdamW(weight_decay 0), warmup + cosine LR to 0.1 * peak, global grad-norm clip (--clip 1.0);
each step every rank draws the same global batch of random windows (seed * 7919 + step) and takes its
dp slice. Data: /usr/share/games/fortunes files without '.' in the name, sorted, joined; first 90%.

Parallelism (torch.distributed, PyTorch 2.13 CPU build, gloo):
  DeviceMesh ("dp", "tp"); parallelize_module over mesh["tp"]:
    tok  RowwiseParallel(input Replicate, output Replicate)  vocab-parallel embedding
    qkv, fc1  ColwiseParallel;  proj, fc2  RowwiseParallel
    head ColwiseParallel(output Shard(-1), DTensor out) + loss_parallel() cross-entropy
  LayerNorms and positions stay plain (replicated) tensors.
  dp > 1: DistributedDataParallel(model, device_mesh=mesh["dp"]): DDP swaps the DTensor params for
    local-shard Parameters (tensor.parallel.ddp._pre_dp_module_transform) and back in its hooks; after the
    first forward they are missing from model.parameters(), so the optimizer and clip use the list taken
    before it. (DDP(process_group=...) on DTensor params fails: "aten.cat.default got mixed torch.Tensor
    and DTensor".)
  Gradient clipping: computed here (squared norms of sharded grads summed over tp, replicated ones once):
    torch.nn.utils.clip_grad_norm_ fails on mixed DTensor/plain grads ("aten._foreach_norm.Scalar got
    mixed torch.Tensor and DTensor"), and under DDP it would see local shards and clip per rank.
  tp 1 builds no DTensor at all (plain modules, plain cross-entropy): the single-process peer.
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=0, help="0: world size / tp")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=32, help="sequences per step over all dp ranks")
    p.add_argument("--max-steps", type=int, default=0, help="0: one pass over the training text")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", default="/usr/share/games/fortunes")
    p.add_argument("--timing-warmup", type=int, default=5)
    p.add_argument("--print-every", type=int, default=0, help="print the loss every N steps (0: never)")
    return p.parse_args()


def draw(shape, seed, slot, std):  # model.hpp's draw(): N(0, std) from the weight's own generator
    return torch.empty(shape).normal_(0.0, std, generator=torch.Generator().manual_seed(seed * 1000003 + slot))


def linear(n_in, n_out, seed, slot, std, bias=True):
    m = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        m.weight.copy_(draw([n_out, n_in], seed, slot, std))
        if bias:
            m.bias.zero_()
    return m


class Block(nn.Module):
    def __init__(self, a, layer):
        super().__init__()
        d, slot, res = a.dim, 16 * (layer + 1), 0.02 / math.sqrt(2 * a.layers)
        self.hd = d // a.heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = linear(d, 3 * d, a.seed, slot, 0.02)
        with torch.no_grad():  # rows q|k|v -> per head (q_h, k_h, v_h): a contiguous shard holds whole heads
            self.qkv.weight.copy_(self.qkv.weight.view(3, a.heads, self.hd, d).transpose(0, 1).reshape(3 * d, d))
        self.proj = linear(d, d, a.seed, slot + 1, res)
        self.fc1 = linear(d, 4 * d, a.seed, slot + 2, 0.02)
        self.fc2 = linear(4 * d, d, a.seed, slot + 3, res)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.qkv(self.ln1(x)).view(B, T, -1, 3, self.hd)  # [B, T, this rank's heads, q|k|v, hd]
        q, k, v = (t.transpose(1, 2) for t in h.unbind(3))  # [B, heads, T, hd]
        att = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.hd)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        att = torch.softmax(att.masked_fill(future, float("-inf")), -1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(B, T, -1)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok = nn.Embedding(256, a.dim)
        with torch.no_grad():
            self.tok.weight.copy_(draw([256, a.dim], a.seed, 1, 0.02))
        self.pos = nn.Parameter(draw([a.context, a.dim], a.seed, 2, 0.01))
        self.blocks = nn.ModuleList(Block(a, l) for l in range(a.layers))
        self.ln_f = nn.LayerNorm(a.dim)
        self.head = linear(a.dim, 256, a.seed, 3, 0.02, bias=False)

    def forward(self, ids):  # logits [B, T, 256] (a DTensor sharded over the vocabulary under tp)
        x = self.tok(ids) + self.pos[: ids.size(1)]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def tensor_parallel(model, tp_mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.qkv": ColwiseParallel(), f"blocks.{i}.proj": RowwiseParallel(),
                     f"blocks.{i}.fc1": ColwiseParallel(), f"blocks.{i}.fc2": RowwiseParallel()})
    return parallelize_module(model, tp_mesh, plan)


def load_text(folder):
    names = sorted(n for n in os.listdir(folder) if "." not in n and os.path.isfile(os.path.join(folder, n)))
    data = b"".join(open(os.path.join(folder, n), "rb").read() for n in names)
    text = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return text[: len(text) - int(len(text) * 0.1)]  # the training 90%


def batch(text, a, step, first, count):  # data.hpp's batch(): rows [first, first + count) of the global batch
    gen = torch.Generator().manual_seed(a.seed * 7919 + step)
    starts = torch.randint(len(text) - a.context - 1, (a.batch,), generator=gen)[first:first + count]
    w = text[starts[:, None] + torch.arange(a.context + 1)].long()
    return w[:, :-1], w[:, 1:]


def lr_at(step, a, total):  # cohort::torch::warmup_cosine_lr(step, warmup, total, lr, 0.1)
    if a.warmup > 0 and step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    if total <= a.warmup:
        return a.lr
    t = min(1.0, max(0.0, (step - a.warmup) / (total - a.warmup)))
    return 0.1 * a.lr + 0.9 * a.lr * 0.5 * (1 + math.cos(math.pi * t))


def clip_grads(params, max_norm, tp_group):
    """Global-norm clip over tp-sharded and replicated grads; returns the norm."""
    from torch.distributed.tensor import DTensor

    sharded, replicated = torch.zeros(()), torch.zeros(())
    for p in params:
        if p.grad is None:
            continue
        # The grad's own placements: tok.weight is Shard(0) but its DTensor grad arrives Replicate.
        # Under DDP the params are local shards whose DTensor spec DDP keeps in _st_info.
        g, spec = (p.grad.to_local(), p.grad._spec) if isinstance(p.grad, DTensor) else (p.grad, getattr(p, "_st_info", None))
        assert spec is None or not any(pl.is_partial() for pl in spec.placements)
        if spec is not None and any(pl.is_shard() for pl in spec.placements):
            sharded += g.float().pow(2).sum()
        else:
            replicated += g.float().pow(2).sum()
    if tp_group is not None:
        dist.all_reduce(sharded, group=tp_group)
    norm = (sharded + replicated).sqrt().item()
    if norm > max_norm:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


def main():
    a = parse()
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    a.dp = a.dp or max(1, world // a.tp)
    assert a.dp * a.tp == world, f"--dp {a.dp} x --tp {a.tp} != world size {world}"
    assert a.dim % a.heads == 0 and a.heads % a.tp == 0 and 256 % a.tp == 0 and a.batch % a.dp == 0
    torch.manual_seed(a.seed)  # the same on every rank (the weights come from their own generators anyway)

    tp_group = dp_group = None
    model = Gpt(a)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (a.dp, a.tp), mesh_dim_names=("dp", "tp"))  # inits gloo
        dp_group = mesh["dp"].get_group()
        if a.tp > 1:
            tp_group = mesh["tp"].get_group()
            model = tensor_parallel(model, mesh["tp"])
        if a.dp > 1:
            model = nn.parallel.DistributedDataParallel(model, device_mesh=mesh["dp"])
    dp_rank = rank // a.tp

    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    text = load_text(a.data)
    total = a.max_steps or max(1, len(text) // (a.batch * a.context))
    local = a.batch // a.dp
    if a.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel
        loss_ctx = loss_parallel
    else:
        import contextlib
        loss_ctx = contextlib.nullcontext

    t0, loss_val = None, float("nan")
    for step in range(total):
        if step == a.timing_warmup:
            t0 = time.perf_counter()
        x, y = batch(text, a, step, dp_rank * local, local)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a, total)
        opt.zero_grad(set_to_none=True)
        with loss_ctx():
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        if a.clip > 0:
            clip_grads(params, a.clip, tp_group)
        opt.step()
        lv = torch.tensor(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
        if a.dp > 1:
            dist.all_reduce(lv, group=dp_group)
        loss_val = lv.item() / a.dp
        if rank == 0 and a.print_every and ((step + 1) % a.print_every == 0 or step == 0):
            print(f"step {step + 1} loss {loss_val:.6f}", flush=True)
    secs = time.perf_counter() - t0 if t0 is not None else 0.0
    timed = total - a.timing_warmup
    tps = timed * a.batch * a.context / secs if timed > 0 and secs > 0 else 0.0
    if rank == 0:
        print(f"RESULT gpt_peer dp={a.dp} tp={a.tp} steps={total} tokens_per_s={tps:.0f} loss={loss_val:.4f}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
