"""StochasticRoundingAdamW on FSDP2's shards (two gloo processes): each rank steps and rounds its own
shard of every bfloat16 weight. Checked against torch's AdamW in float32 on the full tensors (each
new weight one of the two bfloat16 neighbours of its float32 step, the float32 moments equal to the last bit), fused as
make_optimizer builds it, and a checkpoint written and loaded through rlalign's FSDP2 state dicts resumes bit for bit."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from rlalign.train import distributed
from rlalign.train.bf16_adamw import StochasticRoundingAdamW
from tests.train.test_bf16_adamw import bfloat16_neighbours

STEPS, RESUME_AT = 3, 2
LR, WD = 1e-3, 0.1


def _model(weights: list[torch.Tensor] | None = None) -> torch.nn.Module:
    """The tiny model, sharded by FSDP2 over the two ranks (its last weight, 1 x 12, wholly on rank 0)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1)).bfloat16()
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights or []):
            p.copy_(w)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model


def _full(t) -> torch.Tensor:
    return t.full_tensor().detach().clone()


def _backward(model, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(10 * step + rank)  # each rank its own data
    model(torch.randn(6, 16, generator=g).bfloat16()).float().pow(2).mean().backward()


def _sharded_run(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model = _model()
    optimizer = StochasticRoundingAdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)  # as make_optimizer builds it
    record = []
    for step in range(STEPS):
        if step == RESUME_AT:  # a checkpoint of the state before this step, written at once as the trainers do (it holds live step counts)
            state = distributed.optimizer_state(model, optimizer)
            if rank == 0:
                torch.save(state, f"{out}/optimizer.pt")
            weights = [_full(p) for p in model.parameters()]
        optimizer.zero_grad()
        _backward(model, step, rank)
        before, grads = [_full(p) for p in model.parameters()], [_full(p.grad) for p in model.parameters()]
        optimizer.step()
        after = [_full(p) for p in model.parameters()]
        moments = [(_full(optimizer.state[p]["exp_avg"]), _full(optimizer.state[p]["exp_avg_sq"])) for p in model.parameters()]
        record.append({"before": before, "grads": grads, "after": after, "moments": moments})
    # resume: a fresh model and optimizer loaded from the checkpoint take the last step again
    dist.barrier()
    resumed = _model(weights)
    again = StochasticRoundingAdamW(resumed.parameters(), lr=LR, weight_decay=WD, fused=True)
    distributed.load_optimizer_state(resumed, again, torch.load(f"{out}/optimizer.pt", weights_only=False))
    _backward(resumed, RESUME_AT, rank)
    again.step()
    resumed_after = [_full(p) for p in resumed.parameters()]
    moment_dtypes = {str(again.state[p][key].dtype) for p in resumed.parameters() for key in ("exp_avg", "exp_avg_sq")}
    # two equal rows, one a rank, a step of a quarter of the spacing: rounded alike only if both ranks drew the same bits
    rows = torch.nn.Parameter(distribute_tensor(torch.full((2, 4096), 0.02).bfloat16(), resumed[0].weight.device_mesh, [Shard(0)]))
    rows.grad = distribute_tensor(torch.ones(2, 4096).bfloat16(), rows.device_mesh, [Shard(0)])
    StochasticRoundingAdamW([rows], lr=2.0**-15, eps=0.0, weight_decay=0.0).step()  # spacing at 0.02: 2^-13
    rounded = _full(rows)
    if rank == 0:
        torch.save({"record": record, "resumed_after": resumed_after, "moment_dtypes": moment_dtypes, "rounded_rows": rounded}, f"{out}/record.pt")
    distributed.exit_process(0)


def test_each_shard_takes_adamws_float32_step_rounded_and_resumes_bit_for_bit(tmp_path):
    mp.spawn(_sharded_run, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    saved = torch.load(tmp_path / "record.pt", weights_only=False)
    exact = [torch.nn.Parameter(w.float()) for w in saved["record"][0]["before"]]
    reference = torch.optim.AdamW(exact, lr=LR, weight_decay=WD, fused=True)
    for step in saved["record"]:
        with torch.no_grad():
            for e, w, g in zip(exact, step["before"], step["grads"]):
                e.copy_(w.float())  # this step starts from the bfloat16 weights
                e.grad = g.float()
        reference.step()
        for e, after, (m, v) in zip(exact, step["after"], step["moments"]):
            lower, upper = bfloat16_neighbours(e.detach())
            assert torch.all((after == lower) | (after == upper))  # every entry of both shards rounded to a neighbour
            # fused kernels on a shard and on the whole tensor may round the last bit apart (where an entry falls in the vector lanes)
            torch.testing.assert_close(m, reference.state[e]["exp_avg"], rtol=2**-22, atol=0)
            torch.testing.assert_close(v, reference.state[e]["exp_avg_sq"], rtol=2**-22, atol=0)
    first, last = saved["record"][0], saved["record"][-1]
    moved = [(a != b) for a, b in zip(last["after"], first["before"])]
    assert all(m.chunk(2)[0].any() and m.chunk(2)[1].any() for m in moved if m.shape[0] > 1)  # both ranks' shards trained (dim 0 split)
    assert all(torch.equal(a, b) for a, b in zip(saved["resumed_after"], last["after"]))  # the resumed step rounds as the straight one
    assert saved["moment_dtypes"] == {"torch.float32"}
    first_row, second_row = saved["rounded_rows"]
    start = torch.tensor(0.02).bfloat16()
    assert all(0.2 < (row != start).float().mean() < 0.3 for row in (first_row, second_row))  # a quarter of them rounded down
    assert not torch.equal(first_row, second_row)  # each shard its own random bits
