"""AdamW for bfloat16 weights (rlalign.train.bf16_adamw): the stochastic-rounding step is torch's
AdamW step in float32 rounded to a neighbour, keeps a step smaller than the bfloat16 spacing in
expectation (round to nearest loses it), resumes bit for bit; the guard refuses nearest rounding
where most steps of lr would round away."""

from __future__ import annotations

import copy

import pytest
import torch

from rlalign.config import ConfigError
from rlalign.core.rounding import bfloat16_spacing
from rlalign.train.bf16_adamw import StochasticRoundingAdamW, check_bfloat16_steps
from rlalign.train.common import make_optimizer
from rlalign.train.distributed import exit_process
from rlalign.train.run_config import OptimConfig

LR = 1e-6  # an RL fine-tune's learning rate: a twentieth of half the spacing (1.2e-4) of weights near 0.02


def bf16_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(shape, generator=g) * 0.02).bfloat16()) for shape in [(64, 32), (32,), (16, 8)]]


def with_grads(params, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def bfloat16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values just below and just above float32 ``x`` (equal where x is one)."""
    near = x.bfloat16()
    lower = torch.where(near.float() > x, torch.nextafter(near, torch.full_like(near, -float("inf"))), near)
    upper = torch.where(lower.float() < x, torch.nextafter(lower, torch.full_like(lower, float("inf"))), lower)
    return lower, upper


def test_the_step_is_torchs_adamw_in_float32_rounded_to_a_neighbour():
    params = bf16_params()
    exact = [torch.nn.Parameter(p.detach().float()) for p in params]
    for step in range(3):
        with_grads(params, seed=step)
        for p, e in zip(params, exact):
            e.grad = p.grad.float()
        # torch's AdamW over float32 copies of this step's bfloat16 start: the value stochastic rounding rounds
        start = [torch.nn.Parameter(p.detach().float()) for p in params]
        for s, e in zip(start, exact):
            s.grad = e.grad
        reference = torch.optim.AdamW(start, lr=1e-3, weight_decay=0.1)
        if step:
            reference.load_state_dict(reference_state)
        optimizer = optimizer if step else StochasticRoundingAdamW(params, lr=1e-3, weight_decay=0.1)
        optimizer.step()
        reference.step()
        reference_state = copy.deepcopy(reference.state_dict())
        for p, s in zip(params, start):
            lower, upper = bfloat16_neighbours(s.detach())  # the float32 result's two bfloat16 neighbours
            assert torch.all((p.detach() == lower) | (p.detach() == upper))
            state = optimizer.state[p]
            assert p.dtype == torch.bfloat16 and state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
            assert torch.equal(state["exp_avg"], reference.state[s]["exp_avg"]) and torch.equal(state["exp_avg_sq"], reference.state[s]["exp_avg_sq"])


def test_a_step_below_half_the_spacing_is_kept_in_expectation_and_lost_by_nearest_rounding():
    # 200k weights of 0.02 (spacing 2^-13), one gradient sign: Adam's first step is lr (m / sqrt(v) = 1), 1/61 of half the spacing
    w = torch.full((200_000,), 0.02).bfloat16()
    for adamw, expected_mean in ((StochasticRoundingAdamW, -LR), (torch.optim.AdamW, 0.0)):
        p = torch.nn.Parameter(w.clone())
        p.grad = torch.ones_like(p)
        adamw([p], lr=LR, eps=0.0).step()
        moved = p.detach().float() - w.float()  # (N,)
        assert abs(moved.mean().item() - expected_mean) < 0.05 * LR  # stochastic: -lr on average (5 standard deviations: 0.03 lr)
    assert (moved == 0).all()  # nearest: not one weight moved
    assert bfloat16_spacing(w[:1]).item() == 2.0**-13


def test_a_resumed_optimizer_rounds_as_the_straight_one():
    straight = bf16_params()
    optimizer = StochasticRoundingAdamW(straight, lr=1e-4)
    with_grads(straight, 0)
    optimizer.step()
    saved_state, saved_params = copy.deepcopy(optimizer.state_dict()), [p.detach().clone() for p in straight]
    resumed = [torch.nn.Parameter(p) for p in saved_params]
    again = StochasticRoundingAdamW(resumed, lr=1e-4)
    again.load_state_dict(saved_state)  # torch would cast the moments to bfloat16: they stay float32
    assert all(s["exp_avg"].dtype == torch.float32 for s in again.state.values())
    for p in straight + resumed:
        p.grad = None
    with_grads(straight, 1)
    with_grads(resumed, 1)
    optimizer.step()
    again.step()
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_float32_weights_take_torchs_own_step():
    a = [torch.nn.Parameter(p.detach().float()) for p in bf16_params()]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for params in (a, b):
        with_grads(params)
    StochasticRoundingAdamW(a, lr=1e-3).step()
    torch.optim.AdamW(b, lr=1e-3).step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_loaded_state_keeps_float32_moments_for_bfloat16_weights_after_a_float32_one():
    # a model of both dtypes (a float32 head beside bfloat16 layers): each bfloat16 weight's moments load as float32, whatever comes before it
    params = [torch.nn.Parameter(torch.randn(4)), *bf16_params()]
    with_grads(params)
    optimizer = StochasticRoundingAdamW(params, lr=1e-3)
    optimizer.step()
    again = StochasticRoundingAdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-3)
    again.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for p, q in zip(params, again.param_groups[0]["params"]):
        assert again.state[q]["exp_avg"].dtype == again.state[q]["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(again.state[q]["exp_avg_sq"], optimizer.state[p]["exp_avg_sq"])


def test_a_loaded_state_is_the_optimizers_own():
    # optimizer.state_dict() holds the live moments: the optimizer that loads them keeps copies, not the same tensors
    params = bf16_params()
    with_grads(params)
    optimizer = StochasticRoundingAdamW(params, lr=1e-3)
    optimizer.step()
    again = StochasticRoundingAdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-3)
    again.load_state_dict(optimizer.state_dict())
    loaded = [again.state[q]["exp_avg"].clone() for q in again.param_groups[0]["params"]]
    with_grads(params, seed=5)
    optimizer.step()  # steps its own moments in place
    assert all(torch.equal(again.state[q]["exp_avg"], m) for q, m in zip(again.param_groups[0]["params"], loaded))


def test_nearest_rounding_is_refused_where_most_steps_would_round_away():
    # weights of 0.02 (half spacing 6.1e-5) lose a step of lr 1e-6; weights of 1e-5 (half spacing 3.8e-8) keep it
    def weights(lost_share: float, total: int = 100) -> list[torch.Tensor]:
        lost = round(total * lost_share)
        return [torch.tensor([0.02] * lost + [1e-5] * (total - lost)).bfloat16()]

    with pytest.raises(ConfigError, match=r"optim.lr 1e-06 .* on 60% of the trainable weights.*optim.bf16_rounding: stochastic"):
        check_bfloat16_steps(weights(0.6), LR)
    check_bfloat16_steps(weights(0.5), LR)  # half: at the limit, taken
    with pytest.raises(ConfigError, match="on 50% of"):
        check_bfloat16_steps(weights(51 / 101, 101), LR)  # 51 of 101: past half
    check_bfloat16_steps(weights(1.0), 7e-5)  # above half the spacing: taken
    with pytest.raises(ConfigError):
        check_bfloat16_steps(weights(1.0), 6e-5)
    params = bf16_params()
    check_bfloat16_steps([p.detach().float() for p in params], LR)  # float32 weights: exact steps
    with pytest.raises(ConfigError, match="on 100% of"):
        check_bfloat16_steps([torch.zeros(1000), *weights(1.0)], LR)  # float32 ones (a LoRA adapter's, say) are left out of the count
    # through make_optimizer's options: stochastic gives the rounding AdamW, nearest torch's
    assert type(make_optimizer(params, OptimConfig(lr=LR, bf16_rounding="stochastic"), 10)[0]) is StochasticRoundingAdamW
    assert type(make_optimizer(params, OptimConfig(lr=1e-3), 10)[0]) is torch.optim.AdamW


def test_a_regression_learns_with_stochastic_rounding_as_with_float32_weights_and_not_with_nearest():
    # weights near 1 (bfloat16 spacing 2^-7, half of it 3.9e-3) must move ~0.05 each; Adam's steps of
    # about lr = 1e-3 are a quarter of half the spacing: rounded to nearest, not one weight ever moves
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    start = 1 + 0.1 * torch.randn(8, 16, generator=g)
    y = x @ (start + 0.05 * torch.randn(8, 16, generator=g)).T
    final = {}
    for name, dtype, adamw in (("float32", torch.float32, torch.optim.AdamW), ("stochastic", torch.bfloat16, StochasticRoundingAdamW),
                               ("nearest", torch.bfloat16, torch.optim.AdamW)):
        w = torch.nn.Parameter(start.to(dtype, copy=True))
        optimizer = adamw([w], lr=1e-3)
        losses = []
        for _ in range(300):
            loss = ((x.to(dtype) @ w.T).float() - y).pow(2).mean()
            losses.append(loss.item())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        final[name] = (losses[0], losses[-1])
    assert final["float32"][1] < 1e-3 * final["float32"][0]
    assert final["stochastic"][1] < 1e-2 * final["stochastic"][0]  # measured 5e-3: the bfloat16 weights' own quantisation noise remains
    assert final["nearest"][1] == final["nearest"][0]


def test_a_run_with_bfloat16_weights_refuses_nearest_rounding_at_a_small_lr_and_trains_with_stochastic(tmp_path):
    from rlalign.config import load_config
    from rlalign.train.sft import SFTConfig, train

    common = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128", "progress=false", "plots=false",
              "model.dtype=bfloat16", "optim.lr=1e-5", "data.num_train=16", "data.num_eval=4", "batch_size=8", "max_steps=2", "eval_every=100"]
    with pytest.raises(ConfigError, match=r"optim.lr 1e-05 with model.dtype: bfloat16: .* on 84% of the trainable weights"):
        train(load_config(SFTConfig, None, common + [f"output_dir={tmp_path / 'nearest'}"]))
    train(load_config(SFTConfig, None, common + [f"output_dir={tmp_path / 'stochastic'}", "optim.bf16_rounding=stochastic"]))
    from safetensors.torch import load_file

    start = load_file(str(tmp_path / "stochastic" / "base_model" / "model.safetensors"))
    final = load_file(str(tmp_path / "stochastic" / "final" / "model.safetensors"))
    assert final["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    moved = sum(int((final[k] != start[k].to(final[k].dtype)).sum()) for k in start)
    assert moved > 0


def test_the_memory_plan_counts_float32_moments_for_bfloat16_weights_stepped_in_float32():
    from rlalign.train import memory_plan

    model = torch.nn.Linear(16, 8, bias=False).bfloat16()  # 128 weights of 2 bytes
    stochastic, nearest = StochasticRoundingAdamW(model.parameters()), torch.optim.AdamW(model.parameters())
    assert memory_plan._pending_update_bytes(model, stochastic) == 128 * 2 + 2 * 128 * 4  # bfloat16 gradient, float32 moments
    assert memory_plan._pending_update_bytes(model, nearest) == 128 * 2 + 2 * 128 * 2
    model.weight.grad = torch.ones_like(model.weight)
    stochastic.step()
    assert memory_plan._pending_update_bytes(model, stochastic) == 0  # all allocated now


def test_each_weight_and_step_rounds_with_its_own_bits_and_replicas_with_the_same(monkeypatch):
    from rlalign.train import bf16_adamw

    seeds = []
    original = bf16_adamw.stochastic_round_to_bfloat16
    monkeypatch.setattr(bf16_adamw, "stochastic_round_to_bfloat16", lambda x, generator: seeds.append(generator.initial_seed()) or original(x, generator))
    runs = []
    for _ in range(2):  # two replicas: the same steps
        seeds.clear()
        params = bf16_params()
        optimizer = StochasticRoundingAdamW(params, lr=1e-4)
        for step in range(3):
            with_grads(params, step)
            optimizer.step()
        runs.append((list(seeds), [p.detach().clone() for p in params]))
    (seeds_a, weights_a), (seeds_b, weights_b) = runs
    assert len(seeds_a) == 9 and len(set(seeds_a)) == 9  # 3 weights x 3 steps, each its own stream
    assert seeds_a == seeds_b and all(torch.equal(a, b) for a, b in zip(weights_a, weights_b))


def test_a_closure_is_evaluated_with_grad_and_its_loss_returned():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]).bfloat16())
    optimizer = StochasticRoundingAdamW([w], lr=0.1)

    def closure():
        optimizer.zero_grad()
        loss = (w.float() ** 2).sum()
        loss.backward()
        return loss

    assert optimizer.step(closure).item() == 5.0
    assert torch.all(w.detach() < torch.tensor([1.0, 2.0]).bfloat16())  # a step of 0.1 down, larger than the spacing: taken


def test_a_weight_without_a_gradient_is_skipped_and_the_ones_after_it_stepped():
    params = bf16_params()
    with_grads(params)
    params[1].grad = None  # e.g. an embedding row set no token of the batch used
    before = [p.detach().clone() for p in params]
    StochasticRoundingAdamW(params, lr=0.1).step()  # steps far above the spacing: every stepped weight moves
    assert torch.equal(params[1], before[1])
    assert not torch.equal(params[0], before[0]) and not torch.equal(params[2], before[2])


def _accumulator(param: torch.nn.Parameter):
    return param.view_as(param).grad_fn.next_functions[0][0]  # the AccumulateGrad node DDP hooks its gradient sync on


def test_the_step_and_a_resume_keep_each_weights_autograd_node_so_ddps_hooks_keep_firing():
    # DDP registers its gradient allreduce on each weight's AccumulateGrad node: setting a weight's .data
    # to another dtype makes a new node, and the gradients of every later backward go unreduced, silently
    params = bf16_params()
    nodes = [_accumulator(p) for p in params]
    fired = []
    for i, node in enumerate(nodes):
        node.register_hook(lambda *args, i=i: fired.append(i))
    optimizer = StochasticRoundingAdamW(params, lr=1e-3)
    for _ in range(2):
        sum((p.float() ** 2).sum() for p in params).backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    sum((p.float() ** 2).sum() for p in params).backward()
    assert all(_accumulator(p) is node for p, node in zip(params, nodes))
    assert sorted(fired) == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # 3 backwards, each weight's hook every time


def _ddp_replica(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).bfloat16()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = StochasticRoundingAdamW(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + rank)  # each replica its own data
    for _ in range(4):
        optimizer.zero_grad()
        ddp(torch.randn(4, 8, generator=g).bfloat16()).float().pow(2).mean().backward()
        optimizer.step()
    torch.save([p.detach() for p in model.parameters()], f"{out}/rank{rank}.pt")
    exit_process(0)  # not the Gloo group's teardown: destroying it can deadlock on the GIL, and finalization can abort


def test_ddp_replicas_stay_equal(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_ddp_replica, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    torch.manual_seed(0)
    start = [p.detach().bfloat16() for p in torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).bfloat16().parameters()]
    a, b = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # the gradients were averaged at every step, not only the first
    assert any(not torch.equal(x, s) for x, s in zip(a, start))  # and they trained
