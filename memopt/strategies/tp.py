"""``+strategy=tp``: tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism
(Korthikanti et al. 2022) over the ``tp`` dimension of the mesh, with ``torch.distributed.tensor.parallel``.

The plan (``form=all_reduce``, the Megatron column-then-row split):

    wte              vocabulary-parallel embedding (RowwiseParallel on nn.Embedding: rows of V)
    attn.qkv         ColwiseParallel: each rank computes q, k, v of its n_head / tp heads
    attn.proj        RowwiseParallel: partial sums, one all-reduce (sequence parallel: reduce-scatter)
    mlp.fc           ColwiseParallel (d_ff / tp columns), GELU on the local columns
    mlp.proj         RowwiseParallel, one all-reduce (reduce-scatter)
    lm_head          ColwiseParallel over the vocabulary (tied with wte: the same Shard(0) rows);
                     logits all-gathered, or kept split with ``loss_parallel`` (vocabulary-parallel
                     cross-entropy: no rank ever holds the (B, T, V) logits)
    sequence_parallel  LayerNorms (SequenceParallel) and the residual stream between the split regions
                     hold T / tp positions; the all-reduces become reduce-scatter + all-gather

``form=all_gather`` is the other form of the seed's overview: every Linear is split by columns and
its output all-gathered at once (no row-parallel layer), so each rank then runs the attention and
GELU on everything: the same parameter bytes per rank, more bytes communicated, no activation saving.

Parameters stay plain tensors of the local shape (what every engine's flat groups, ZeRO stages and
FSDP2 already partition); a forward pre-hook wraps them as DTensors (``DTensor.from_local``, no copy)
for the module call, so the DTensor layers run their collectives, and ``from_local``'s backward
hands each plain parameter its local gradient (all-reduced over tp for replicated parameters whose
gradient is partial, e.g. sequence-parallel LayerNorms). The fused ``qkv`` rows of rank r are the q,
k and v rows of its heads (a permutation of the single-process rows); ``TPLayout`` maps a
single-process tensor to a rank's shard (init from (seed, name)) and back (``full_state``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from memopt.errors import ConfigError
from memopt.parallel.dims import expected_world, resolve_sizes
from memopt.strategies.base import Build, Strategy, register

FORMS = ("all_reduce", "all_gather")


@dataclass
class TPConfig:
    """``+strategy=tp``: tensor parallelism over ``parallel.tp`` ranks."""

    form: str = "all_reduce"  # all_reduce: Megatron column-then-row | all_gather: every Linear column-split, gathered
    sequence_parallel: bool = False  # LayerNorms and the residual stream split over the sequence (all_reduce form)
    loss_parallel: bool = False  # vocabulary-parallel cross-entropy on the split logits (no full logits)


class Rule:
    """How one parameter is split: this rank's rows/columns of the single-process tensor."""

    def __init__(self, full_shape: tuple[int, ...], dim: int, index: torch.Tensor):
        self.full_shape, self.dim, self.index = full_shape, dim, index  # index: this rank's positions along dim

    def local(self, full: torch.Tensor) -> torch.Tensor:
        return full.index_select(self.dim, self.index).contiguous()


class TPLayout:
    """The tensor-parallel split of a model: which parameters are split, how, and over which ranks."""

    def __init__(self, dim, rules: dict[str, Rule], all_rules: dict, device):
        self.dim, self.rules, self.all_rules = dim, rules, all_rules  # all_rules: rank -> rules (for full_state)
        self.device = device  # where the gathers run (NCCL gathers device tensors)

    @property
    def sharded(self) -> set[str]:
        """Names of the parameters split over tp (the others are replicated on every tp rank)."""
        return set(self.rules)

    def full_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The single-process tensors from this rank's ``state`` (a collective over tp)."""
        out = dict(state)
        for name in sorted(state):
            if name not in self.rules:
                continue
            local = state[name].detach().to(self.device).contiguous()
            parts = torch.empty((self.dim.size * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=self.device)
            self.dim.all_gather(parts, local)  # every rank's rows, in rank order (concatenated along dim 0)
            parts = parts.view(self.dim.size, *local.shape)
            r = self.rules[name]
            full = torch.empty(r.full_shape, dtype=local.dtype, device=self.device)
            for rank in range(self.dim.size):
                full.index_copy_(r.dim, self.all_rules[rank][name].index.to(self.device), parts[rank])
            out[name] = full.to(state[name].device)
        return out

    def local_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tensors from single-process ones (``full_state``'s inverse, no communication):
        a split parameter's rows or columns, the others unchanged (resuming a checkpoint)."""
        return {name: self.rules[name].local(t) if name in self.rules else t for name, t in state.items()}


def _index(n: int, tp: int, rank: int, blocks: int = 1) -> torch.Tensor:
    """Positions of rank's share of a dimension of size n made of ``blocks`` equal parts (qkv: 3)
    each split evenly over tp (rank takes the r-th slice of every part)."""
    part = n // blocks
    step = part // tp
    return torch.cat([torch.arange(b * part + rank * step, b * part + (rank + 1) * step) for b in range(blocks)])


# Each architecture's module names: (column-parallel Linears of attention with their (dim, blocks),
# attention's row-parallel output, the MLP's column-parallel Linears, its row-parallel output, the
# block's norms, the final norm, a learned position table or None). GPT fuses q, k and v (three parts,
# each split); Llama's q, k and v are separate (grouped-query attention: k and v hold n_kv_head heads,
# split over tp like q's n_head, so rank r's query heads use rank r's key/value heads) and its SwiGLU
# has two column-parallel inputs (gate, up) into one row-parallel output (down).
ARCH = {
    "gpt": ({"attn.qkv": 3}, "attn.proj", ("mlp.fc",), "mlp.proj", ("ln1", "ln2"), "ln_f", "wpe"),
    "llama": ({"attn.q_proj": 1, "attn.k_proj": 1, "attn.v_proj": 1}, "attn.o_proj",
              ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj", ("attn_norm", "mlp_norm"), "norm", None),
}


def split_fields(m) -> list[tuple[str, int]]:
    """The model's fields each tensor-parallel rank holds 1/tp of: ``parallel.tp`` must divide every one."""
    dims = [("n_head", m.n_head), ("d_ff", m.ff), ("vocab_size", m.vocab_size), ("d_model", m.d_model)]
    if m.arch == "llama":  # grouped-query attention: the key/value heads are split too (none replicated)
        dims.insert(1, ("n_kv_head", m.kv_heads))
    return dims


def tp_sizes(m, world: int) -> list[int]:
    """The ``parallel.tp`` values ``TPStrategy.validate`` accepts for model config ``m`` on ``world`` ranks:
    divisors of the world size > 1 dividing every split field; none for an architecture without a plan here
    or with dropout."""
    if m.arch not in ARCH or m.dropout > 0:
        return []
    return _dividing(split_fields(m), world)


def _dividing(dims: list[tuple[str, int]], world: int) -> list[int]:
    return [d for d in range(2, world + 1) if world % d == 0 and all(n % d == 0 for _, n in dims)]


def _plan(c: TPConfig, n_layer: int, arch: str = "gpt"):
    """{module path: ParallelStyle} and {parameter name: (dim, blocks)} for the chosen form."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel)

    attn_in, attn_out, mlp_in, mlp_out, norms, final_norm, pos = ARCH[arch]
    sp = c.sequence_parallel
    seq = Shard(1) if sp else Replicate()
    logits = Shard(-1) if c.loss_parallel else Replicate()  # loss_parallel: the local (B, T, V/tp) columns
    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=logits)}
    split = {"wte.weight": (0, 1), "lm_head.weight": (0, 1)}
    if sp:
        if pos is not None:
            plan[pos] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        plan[final_norm] = SequenceParallel()
    for i in range(n_layer):
        b = f"blocks.{i}"
        if c.form == "all_reduce":
            for m, parts in [*attn_in.items(), *((m, 1) for m in mlp_in)]:
                plan[f"{b}.{m}"] = ColwiseParallel(input_layouts=seq)
                split.update({f"{b}.{m}.weight": (0, parts), f"{b}.{m}.bias": (0, parts)})
            for m in (attn_out, mlp_out):
                plan[f"{b}.{m}"] = RowwiseParallel(output_layouts=seq)
                split[f"{b}.{m}.weight"] = (1, 1)
            if sp:
                plan.update({f"{b}.{n}": SequenceParallel() for n in norms})
        else:  # every Linear column-parallel, its output all-gathered
            for m in (*attn_in, attn_out, *mlp_in, mlp_out):
                plan[f"{b}.{m}"] = ColwiseParallel(output_layouts=Replicate())
                split.update({f"{b}.{m}.weight": (0, 1), f"{b}.{m}.bias": (0, 1)})
    return plan, split


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy from this rank's vocabulary columns of the logits (Megatron's
    vocabulary-parallel loss): the max, the sum of exponentials and the target's logit are reduced
    over tp (three all-reduces of N values), so no rank holds the (N, V) logits."""

    @staticmethod
    def forward(ctx, logits, targets, lo: int, dim):
        # logits (N, V/tp) fp32 of the vocabulary rows [lo, lo + V/tp); targets (N,)
        import torch.distributed as dist

        m = logits.max(dim=-1).values
        dim.all_reduce_(m, op=dist.ReduceOp.MAX)
        z = logits - m.unsqueeze(-1)
        t = targets - lo
        outside = (t < 0) | (t >= logits.size(-1))
        t = t.masked_fill(outside, 0)
        picked = z.gather(-1, t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dim.all_reduce_(picked)
        e = z.exp()
        s = e.sum(dim=-1)
        dim.all_reduce_(s)
        e.div_(s.unsqueeze(-1))  # this rank's columns of the softmax, kept for the backward
        ctx.save_for_backward(e, t, outside)
        return s.log() - picked

    @staticmethod
    def backward(ctx, grad):
        p, t, outside = ctx.saved_tensors
        g = p.clone()
        g.scatter_add_(-1, t.unsqueeze(-1), -(~outside).to(g.dtype).unsqueeze(-1))  # softmax - one_hot
        return g * grad.unsqueeze(-1), None, None, None


class VocabParallelLoss:
    """The model's ``loss_head`` slot with a vocabulary-parallel head: this rank's logits (B, T, V/tp)
    and the mean of the per-token losses (the logits returned are this rank's columns)."""

    def __init__(self, dim, vocab: int):
        self.dim, self.lo = dim, dim.rank * (vocab // dim.size)

    def __call__(self, x: torch.Tensor, head, targets: torch.Tensor | None):
        logits = head(x)  # (B, T, V/tp)
        if targets is None:
            return logits, None
        return logits, _VocabParallelCE.apply(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                                              self.lo, self.dim).mean()


class _LocalParams:
    """Forward pre-hook: the module sees its plain local parameters as DTensors (``from_local``: a
    view, differentiable) for the call; the post-hook drops them again."""

    def __init__(self, specs: dict[str, tuple]):
        self.specs = specs  # parameter leaf name -> (mesh, placements, global shape, global stride)

    def pre(self, module, _args):
        from torch.distributed.tensor import DTensor

        for name, (mesh, placements, shape, stride) in self.specs.items():
            module.__dict__[name] = DTensor.from_local(module._parameters[name], mesh, placements, run_check=False,
                                                       shape=shape, stride=stride)

    def post(self, module, _args, _out):
        for name in self.specs:
            module.__dict__.pop(name, None)


def _to_local_params(model) -> None:
    """Replace every DTensor parameter by a plain parameter of its local shape (ties kept) and
    install the hooks that wrap it back for the module's forward."""
    from torch.distributed.tensor import DTensor

    memo: dict[int, torch.nn.Parameter] = {}
    for mod in model.modules():
        specs = {}
        for name, p in list(mod._parameters.items()):
            if isinstance(p, DTensor):
                if id(p) not in memo:
                    memo[id(p)] = torch.nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
                specs[name] = (p.device_mesh, tuple(p.placements), p.shape, p.stride())
                mod._parameters[name] = memo[id(p)]
        if specs:
            hooks = _LocalParams(specs)
            mod.register_forward_pre_hook(hooks.pre)
            mod.register_forward_hook(hooks.post)


@register
class TPStrategy(Strategy):
    name, Config, phase, order = "tp", TPConfig, "model", 1  # after moe (refused), before flash_attn / ckpt
    uses = ("tp",)
    excludes = ("moe", "flash_attn", "chunked_loss", "cpu_offload")
    excludes_why = ("tensor parallelism splits the dense MLP, the sdpa/naive attention core and the output layer "
                    "through its module; tp with MoE experts, the Triton FlashAttention core, the chunked loss (its "
                    "cross-entropy does not reduce over vocabulary columns split between ranks) or cpu_offload (the "
                    "host optimizer step has no tensor-parallel norm and overflow vote) is not built; strategy.tp.loss_parallel=true also avoids the full logits")

    def validate(self, c: TPConfig, cfg) -> None:
        p, m = "strategy.tp", cfg.model
        if c.form not in FORMS:
            raise ConfigError(f"{p}.form={c.form!r} is not one of: {', '.join(FORMS)}")
        tp = resolve_sizes(cfg.parallel, expected_world(cfg))["tp"]
        if tp < 2:
            raise ConfigError(f"strategy tp needs parallel.tp >= 2 (got {tp}): set parallel.tp to a divisor of the world "
                              f"size {expected_world(cfg)} greater than 1, or drop +strategy=tp")
        if c.sequence_parallel and c.form != "all_reduce":
            raise ConfigError(f"{p}.sequence_parallel=true needs {p}.form=all_reduce: the all_gather form has no "
                              "row-parallel layer whose all-reduce becomes a reduce-scatter")
        if m.arch not in ARCH:
            raise ConfigError(f"strategy tp has a plan for model.arch in {sorted(ARCH)} (got {m.arch!r}); use ZeRO "
                              "(+strategy=zero3) or engine=fsdp2 to spread it over ranks")
        dims = split_fields(m)
        for field, n in dims:
            if n % tp:
                world = expected_world(cfg)
                able = _dividing(dims, world)
                fix = (f"use parallel.tp in {able}" if able else f"no tp > 1 divides it and the world size {world}: make "
                       f"model.{field} a multiple of {tp}, or drop +strategy=tp")
                raise ConfigError(f"model.{field}={n} is not divisible by parallel.tp={tp}: each tensor-parallel rank "
                                  f"holds {field} / tp of it; {fix}")
        if c.sequence_parallel and m.seq_len % tp:
            raise ConfigError(f"model.seq_len={m.seq_len} is not divisible by parallel.tp={tp}: sequence parallelism "
                              f"gives each rank seq_len / tp positions")
        if m.dropout > 0:
            raise ConfigError(f"model.dropout={m.dropout} with strategy tp is not built: dropout inside split regions "
                              "needs per-rank random streams (Megatron's RNG tracker); set model.dropout=0")

    def apply(self, model, c: TPConfig, build: Build) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        dim = build.dims.tp
        tp, rank = dim.size, dim.rank
        plan, split = _plan(c, len(model.blocks), build.cfg.model.arch)
        tied = model.lm_head.weight is model.wte.weight
        parallelize_module(model, dim.mesh, plan)
        if tied:  # parallelize_module distributes each module's weight on its own: tie the two Shard(0) copies
            model.lm_head.weight = model.wte.weight
        _to_local_params(model)
        if c.form == "all_reduce":
            for b in model.blocks:
                b.attn.n_head //= tp  # this rank's heads (and key/value heads: grouped-query attention)
                if hasattr(b.attn, "n_kv_head"):
                    b.attn.n_kv_head //= tp
        names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        full = {n: tuple(s) for n, s in _full_shapes(model, split, tp).items()}
        all_rules = {r: {n: Rule(full[n], d, _index(full[n][d], tp, r, k)) for n, (d, k) in split.items() if n in names}
                     for r in range(tp)}
        layout = TPLayout(dim, all_rules[rank], all_rules, build.device)
        model.tensor_parallel = layout
        if c.loss_parallel:
            model.loss_head = VocabParallelLoss(dim, build.cfg.model.vocab_size)
        single = model.init_tensor  # the single-process init; a split parameter gets its rows of it

        def init_tensor(name, shape, seed):
            rule = layout.rules.get(name)
            return single(name, shape, seed) if rule is None else rule.local(single(name, rule.full_shape, seed))

        model.init_tensor = init_tensor


def _full_shapes(model, split: dict, tp: int) -> dict:
    """Single-process shapes of the split parameters (local shape x tp along the split dimension)."""
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if n in split:
            d = split[n][0]
            shape = list(p.shape)
            shape[d] *= tp
            out[n] = shape
    return out
