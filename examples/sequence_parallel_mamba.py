"""Train a few steps of a small Mamba language model with each sequence split across processes
(scan_lib.distributed), and check every gradient against the same model run whole in one process.

    torchrun --nproc_per_node 2 examples/sequence_parallel_mamba.py

NCCL with one GPU per process where there are GPUs enough; gloo with the processes sharing the GPUs
there are (messages through host memory); gloo on CPUs without a GPU (Triton's interpreter: small
sizes). Each rank holds positions [start, end) of every sequence; the loss is the mean over all
positions, so the ranks' losses add up to it and their gradients, summed by all_reduce (what
DistributedDataParallel would do), are the whole model's gradients.
"""
import argparse
import os

import torch
import torch.distributed as dist

import scan_lib  # first: without a GPU it switches Triton to its interpreter
from scan_lib import distributed as sequence_parallel


class TinyMamba(torch.nn.Module):
    """Embedding, residual pre-norm Mamba blocks, a linear head."""

    def __init__(self, vocab, d_model, layers, device):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model, device=device)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(d_model, device=device) for _ in range(layers))
        self.blocks = torch.nn.ModuleList(scan_lib.Mamba(d_model, d_state=8, d_conv=4, expand=2, device=device)
                                          for _ in range(layers))
        self.head = torch.nn.Linear(d_model, vocab, device=device)

    def forward(self, tokens, sharded=False):
        x = self.embed(tokens)                                                  # batch x L x d_model
        for norm, block in zip(self.norms, self.blocks):
            y = norm(x)
            x = x + (sequence_parallel.mamba(block, y) if sharded else block(y))
        return self.head(x)                                                     # batch x L x vocab


def batch_of_sequences(step, batch, length, vocab, device):
    """Counting sequences with a random start and stride: predictable, so the loss falls."""
    g = torch.Generator().manual_seed(step)
    start, stride = torch.randint(vocab, (batch, 1), generator=g), torch.randint(1, 4, (batch, 1), generator=g)
    return ((start + stride * torch.arange(length + 1)) % vocab).to(device)   # batch x (L + 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--length", type=int, default=24, help="positions per sequence, all ranks together")
    parser.add_argument("--d-model", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    # chapter 09's rule, for the ranks on this machine (torchrun sets LOCAL_WORLD_SIZE): NCCL with a GPU
    # per rank, else gloo with the ranks sharing the GPUs there are, else gloo on CPUs
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    backend, device_type = sequence_parallel.launch_plan(local_ranks)
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group(backend)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    vocab, batch = 16, 2
    bounds = [args.length * r // ranks for r in range(ranks + 1)]              # uneven when L % ranks != 0
    start, end = bounds[rank], bounds[rank + 1]
    torch.manual_seed(0)
    model = TinyMamba(vocab, args.d_model, args.layers, device)
    whole = TinyMamba(vocab, args.d_model, args.layers, device)                 # the one-process reference
    whole.load_state_dict(model.state_dict())
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, whole)]
    loss_fn = torch.nn.functional.cross_entropy
    worst = 0.0
    for step in range(args.steps):
        sequences = batch_of_sequences(step, batch, args.length, vocab, device)
        inputs, targets = sequences[:, :-1], sequences[:, 1:]
        logits = model(inputs[:, start:end], sharded=True)
        loss = loss_fn(logits.flatten(0, 1), targets[:, start:end].flatten(), reduction="sum") / targets.numel()
        loss.backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
        full_loss = loss_fn(whole(inputs).flatten(0, 1), targets.flatten())
        full_loss.backward()
        for (name, mine), theirs in zip(model.named_parameters(), whole.parameters()):
            error = ((mine.grad - theirs.grad).abs().max() / theirs.grad.abs().max().clamp_min(1e-30)).item()
            worst = max(worst, error)
            assert error < 1e-4, f"step {step}: {name}'s gradient differs from one process by {error:.2e}"
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step}: loss {total.item():.4f} (one process: {full_loss.item():.4f}), "
                  f"worst relative gradient difference so far {worst:.1e}", flush=True)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    if rank == 0:
        print(f"{ranks} ranks, shards {[bounds[r + 1] - bounds[r] for r in range(ranks)]}: every gradient matched one process")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
