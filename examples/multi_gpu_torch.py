"""``torch_bridge`` under torch.distributed: DDP, FSDP2 (``fully_shard``) and a patched HF model under FSDP2.

    torchrun --nproc_per_node 2 examples/multi_gpu_torch.py [--backend pallas|pallas_launch|triton|...] [--steps 3]

Every rank builds the same model (same seed), trains ``--steps`` SGD steps on its slice of one global batch, and
checks:

1. each rank's bridge runs on that rank's GPU (the output's device, the JAX device the bridge picked) and leaves
   torch's current device alone (JAX's first use switches the thread to another GPU; the bridge puts it back);
2. DDP: parameters after training equal a single-GPU run on the whole batch (float32, rel ≤ 1e-5: only the
   order of the gradient all-reduce differs);
3. FSDP2: the same with every block and the root ``fully_shard``-ed;
4. a tiny HF Llama patched with ``patch_hf_model`` then ``fully_shard``-ed trains like the unpatched one under
   FSDP2 (losses and parameters, rel ≤ 1e-4).

Rank 0 prints one line per check; the exit code is 1 if any check failed on any rank. Needs ≥ 2 GPUs and NCCL.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import torch_bridge
from pallas_norm import registry
from pallas_norm_tools.tiny_models import tiny_model, tokens
from torch_bridge.jax_device import jax_device_for

HIDDEN, ROWS, RTOL, RTOL_HF = 256, 16, 1e-5, 1e-4


class Block(torch.nn.Module):
    """``h + down(silu(up(norm(h))))`` with our RMSNorm (Gemma mode, so the weight starts at 0)."""

    def __init__(self, backend: str):
        super().__init__()
        self.norm = torch_bridge.RMSNorm(HIDDEN, offset=1.0, casting="gemma", backend=backend)
        self.up, self.down = torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, h):
        return h + self.down(torch.nn.functional.silu(self.up(self.norm(h))))


def make_model(backend: str, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(backend), Block(backend),
                                torch_bridge.RMSNorm(HIDDEN, backend=backend)).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def global_batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(100 + step)
    x, target = torch.randn(2, ROWS, HIDDEN, generator=g)
    return x.to(device), target.to(device)


def train(model, steps, device, rank, world, local: bool):
    """SGD on the mean-squared error; ``local``: only this rank's rows of each global batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, target = global_batch(step, device)
        if local:
            x, target = x.chunk(world)[rank], target.chunk(world)[rank]
        loss = (model(x) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
            for n, p in model.named_parameters()}


def max_rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in b)


def check(results: list, name: str, ok: bool, detail: str) -> None:
    results.append((name, ok, detail))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=registry.DEFAULT_TORCH_BACKEND, choices=registry.TORCH_BACKENDS)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    results: list = []

    x = torch.randn(4, HIDDEN, device=device)
    y = torch_bridge.rms_norm(x, torch.ones(HIDDEN, device=device), backend=args.backend)
    jax_dev = jax_device_for(x) if args.backend != "triton" else None
    current = torch.cuda.current_device()
    on_own = (y.device == device and current == local_rank
              and (jax_dev is None or jax_dev.local_hardware_id == local_rank))
    check(results, "bridge on this rank's GPU", on_own,
          f"y on {y.device}, JAX device {jax_dev}, torch's current device afterwards cuda:{current}")

    reference = full_params(train(make_model(args.backend, device), args.steps, device, rank, world, local=False))
    ddp = DistributedDataParallel(make_model(args.backend, device), device_ids=[local_rank])
    err = max_rel(full_params(train(ddp, args.steps, device, rank, world, local=True).module), reference)
    check(results, "DDP == single GPU", err <= RTOL, f"max rel param diff {err:.1e}")

    fsdp = make_model(args.backend, device)
    for block in fsdp[:2]:
        fully_shard(block)
    fully_shard(fsdp)
    err = max_rel(full_params(train(fsdp, args.steps, device, rank, world, local=True)), reference)
    check(results, "FSDP2 == single GPU", err <= RTOL, f"max rel param diff {err:.1e}")

    hf_runs = {}
    for variant in ("hf", "patched"):
        model = tiny_model("llama", layers=2, hidden=64, device=str(device))
        if variant == "patched":
            torch_bridge.patch_hf_model(model, backend=args.backend)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt, losses = torch.optim.SGD(model.parameters(), lr=0.5), []
        ids = tokens(batch=2 * world, length=16, device=str(device)).chunk(world)[rank]
        for _ in range(args.steps):
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        hf_runs[variant] = (losses, full_params(model))
    (l_hf, p_hf), (l_ours, p_ours) = hf_runs["hf"], hf_runs["patched"]
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(l_ours, l_hf))
    param_err = max_rel(p_ours, p_hf)
    check(results, "FSDP2 patched HF == unpatched", max(loss_err, param_err) <= RTOL_HF,
          f"losses {['%.5f' % v for v in l_ours]}, max rel loss diff {loss_err:.1e}, param diff {param_err:.1e}")

    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    failed = any(not ok for rank_results in gathered for _, ok, _ in rank_results)
    if rank == 0:
        print(f"world {world}, backend {args.backend}, {args.steps} steps, torch {torch.__version__}")
        for r, rank_results in enumerate(gathered):
            for name, ok, detail in rank_results:
                print(f"rank {r}  {'ok  ' if ok else 'FAIL'}  {name}: {detail}")
        print("FAILED" if failed else "all checks passed")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
